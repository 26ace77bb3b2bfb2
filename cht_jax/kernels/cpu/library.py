"""Builds the C++ kernels (once per machine, cached) and registers them with XLA:CPU.

Cache: `$CHT_JAX_KERNEL_CACHE` (default ~/.cache/cht_jax), keyed by sources, jaxlib, flags, CPU.
"""

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import subprocess
import tempfile

from absl import logging
import jax
import jaxlib

_SOURCES = tuple(pathlib.Path(__file__).with_name(name)
                 for name in ('conv_block.cc', 'encoder.cc'))
_HEADERS = (pathlib.Path(__file__).with_name('threads.h'),)
_TARGETS = {  # XLA custom-call target: the library's handler symbol.
    'cht_conv_block_norm_forward': 'ChtConvBlockNormForward',
    'cht_conv_block_norm_train_forward': 'ChtConvBlockNormTrainForward',
    'cht_conv_block_norm_backward': 'ChtConvBlockNormBackward',
    'cht_encoder_forward': 'ChtEncoderForward',
}
_COMPILER_FLAGS = ('-O3', '-march=native', '-std=c++17', '-shared', '-fPIC')


class KernelBuildError(RuntimeError):
  """The C++ kernels could not be compiled or loaded."""


def _cache_dir() -> pathlib.Path:
  default = pathlib.Path.home() / '.cache' / 'cht_jax'
  return pathlib.Path(os.environ.get('CHT_JAX_KERNEL_CACHE', default))


def _cpu_signature() -> str:
  """-march=native binds the build to this CPU's instruction set."""
  try:
    with open('/proc/cpuinfo') as f:
      flags = next((line for line in f if line.startswith('flags')), '')
  except OSError:
    flags = ''
  return platform.machine() + flags


def build() -> pathlib.Path:
  """The compiled library's path, compiled first where the cache lacks it (KernelBuildError
  where there is no compiler or the sources do not compile)."""
  key = hashlib.sha256(b'\0'.join([
      *(source.read_bytes() for source in _SOURCES + _HEADERS), jaxlib.__version__.encode(),
      ' '.join(_COMPILER_FLAGS).encode(), _cpu_signature().encode()])).hexdigest()[:16]
  library = _cache_dir() / f'fused_cpu_{key}.so'
  if library.exists():
    return library
  compiler = os.environ.get('CXX', 'g++')
  names = ' and '.join(source.name for source in _SOURCES)
  logging.info('Compiling %s into %s (once per machine, a few seconds).', names, library)
  library.parent.mkdir(parents=True, exist_ok=True)
  # Build to a temporary name and rename: concurrent processes never see half a file.
  with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
    partial = pathlib.Path(tmp) / library.name
    command = [compiler, *_COMPILER_FLAGS, f'-I{jax.ffi.include_dir()}', *map(str, _SOURCES),
               '-o', str(partial)]
    try:
      subprocess.run(command, check=True, capture_output=True, text=True)
    except FileNotFoundError as e:
      raise KernelBuildError(
          f"model.conv_impl='fused_cpu' needs a C++ compiler ({compiler!r} not found; "
          "set CXX or install g++), or use --config.model.conv_impl=patches.") from e
    except subprocess.CalledProcessError as e:
      raise KernelBuildError(
          f"Compiling {names} failed ({' '.join(command)}):\n{e.stderr[-2000:]}\n"
          'Use --config.model.conv_impl=patches to run without it.') from e
    os.replace(partial, library)
  return library


@functools.cache
def load() -> None:
  """Builds (once per machine) and registers the kernels with XLA:CPU."""
  library = ctypes.cdll.LoadLibrary(str(build()))
  for name, symbol in _TARGETS.items():
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)),
                                platform='cpu')


@functools.cache
def build_error() -> str | None:
  """Why the kernels cannot be used here (e.g. no compiler), or None."""
  try:
    load()
  except (KernelBuildError, OSError) as e:
    return str(e)
  return None
