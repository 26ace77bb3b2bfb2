"""C++ kernels for XLA:CPU: the generated CNN's conv block and the encoder's forward pass.

- `conv_relu_pool_norm` (`conv_impl='fused_cpu'`, `fused_cpu.cc`): the
  generated CNN's block, conv -> ReLU -> 2x2 max-pool -> BatchNorm, as one
  call each way, forward and backward.
- `encoder_forward` (`encoder_impl='fused_cpu'`, `fused_cpu_encoder.cc`): a
  whole `transformer.Encoder` stack's forward pass as one call, on the calling
  thread and one helper from XLA's pool (`fused_cpu_threads.h`). It has no
  gradient: `transformer.Encoder` uses it only where nothing differentiates it.

The library is compiled with the machine's C++ compiler on first use and cached
(`$CHT_JAX_KERNEL_CACHE`, by default ~/.cache/cht_jax), keyed by the sources,
jaxlib's version and the CPU. The kernels give the same numbers as the JAX
forms up to float rounding; the conv block's gradients are the same except
where two positive pre-activations of a pooling window tie (all the gradient
goes to the first, where JAX's reduce-max splits it). The conv block has a
first derivative only: nothing in CHT's training differentiates twice, but
second-order MAML cannot use it.

Why they exist: with 8 channels and 28-40 tokens, XLA:CPU runs the model as
thousands of small operations (patch gathers, transposes, pooling, and each
encoder layer's ~22 operations), most of them ~1 us of work behind a
thread-pool hand-off; see docs/performance.md. Under a device mesh a custom
call must run inside `shard_map` (as `train.batch_grads` and evaluation do):
XLA's partitioner does not know how to split it and would gather the batch
around it.
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
import jax.numpy as jnp
import jaxlib
import numpy as np

_SOURCES = tuple(pathlib.Path(__file__).with_name(name)
                 for name in ('fused_cpu.cc', 'fused_cpu_encoder.cc'))
_HEADERS = (pathlib.Path(__file__).with_name('fused_cpu_threads.h'),)
_TARGETS = {  # XLA custom-call target: the library's handler symbol.
    'cht_conv_block_norm_forward': 'ChtConvBlockNormForward',
    'cht_conv_block_norm_train_forward': 'ChtConvBlockNormTrainForward',
    'cht_conv_block_norm_backward': 'ChtConvBlockNormBackward',
    'cht_encoder_forward': 'ChtEncoderForward',
}
_COMPILER_FLAGS = ('-O3', '-march=native', '-std=c++17', '-shared', '-fPIC')


class KernelBuildError(RuntimeError):
  """The C++ kernel could not be compiled or loaded."""


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


def _compile() -> pathlib.Path:
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
  """Compiles (once per machine) and registers the kernel with XLA:CPU."""
  library = ctypes.cdll.LoadLibrary(str(_compile()))
  for name, symbol in _TARGETS.items():
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)),
                                platform='cpu')


def available() -> bool:
  """Whether the kernel builds and loads here (False without a compiler)."""
  return build_error() is None


@functools.cache
def build_error() -> str | None:
  """Why the kernel cannot be used here, or None."""
  try:
    load()
  except (KernelBuildError, OSError) as e:
    return str(e)
  return None


def resolve(field: str, impl: str, fallback: str) -> str:
  """What config field `field` = `impl` stands for on this backend.

  'auto' is 'fused_cpu' on CPU where the library builds (else, with a warning
  on CPU, `fallback`); an explicit 'fused_cpu' must be able to run; any other
  value stands for itself.

  Raises:
    ValueError: 'fused_cpu' asked for where it cannot run.
  """
  on_cpu = jax.default_backend() == 'cpu'
  if impl == 'auto':
    if on_cpu and not available():
      logging.log_first_n(logging.WARNING, "%s='auto': the fused CPU kernel is not available "
                          "(%s); using '%s'.", 1, field, build_error(), fallback)
    return 'fused_cpu' if on_cpu and available() else fallback
  if impl == 'fused_cpu':
    if not on_cpu:
      raise ValueError(f"{field}='fused_cpu' runs on CPU only, not on "
                       f'{jax.default_backend()}; use auto or {fallback}.')
    if not available():
      raise ValueError(f"{field}='fused_cpu': {build_error()}")
  return impl


def _pooled_shapes(x: jax.Array, kernel: jax.Array):
  *lead, h, w, _ = x.shape
  shape = (*lead, h // 2, w // 2, kernel.shape[-1])
  return jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, jnp.int8)


def unsupported(x: jax.Array, kernel: jax.Array) -> str | None:
  """Why the kernel cannot take these inputs, or None."""
  if x.dtype != jnp.float32 or kernel.dtype != jnp.float32:
    return f'it handles float32 only, got {x.dtype} and {kernel.dtype}'
  k = kernel.shape[0]
  if (x.ndim != 4 or kernel.ndim != 4 or kernel.shape[1] != k or k % 2 != 1
      or kernel.shape[2] != x.shape[-1] or kernel.shape[3] not in (8, 16, 32, 64)):
    return (f'it needs x [N, H, W, C_in] and an odd square kernel [k, k, C_in, C_out] '
            f'with C_out in (8, 16, 32, 64), got {kernel.shape} for {x.shape}')
  return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _conv_relu_pool_norm(x, kernel, scale, bias, epsilon):
  # Where nothing differentiates it: no winners or statistics kept.
  call = jax.ffi.ffi_call('cht_conv_block_norm_forward', _pooled_shapes(x, kernel)[0],
                          vmap_method='broadcast_all')
  return call(x, kernel, scale, bias, epsilon=np.float32(epsilon))


def _norm_fwd(x, kernel, scale, bias, epsilon):
  pooled, winner = _pooled_shapes(x, kernel)
  stats = jax.ShapeDtypeStruct(scale.shape, jnp.float32)  # mean and 1 / std, [C_out].
  call = jax.ffi.ffi_call('cht_conv_block_norm_train_forward',
                          (pooled, pooled, winner, stats, stats), vmap_method='broadcast_all')
  y, pooled, winner, mean, inv = call(x, kernel, scale, bias, epsilon=np.float32(epsilon))
  return y, (x, kernel, scale, pooled, winner, mean, inv)


def _norm_bwd(epsilon, residuals, dy):
  del epsilon
  x, kernel, scale = residuals[:3]
  shapes = tuple(jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in (x, kernel, scale, scale))
  return tuple(jax.ffi.ffi_call('cht_conv_block_norm_backward', shapes,
                                vmap_method='broadcast_all')(*residuals, dy))


_conv_relu_pool_norm.defvjp(_norm_fwd, _norm_bwd)


def conv_relu_pool_norm(x: jax.Array, kernel: jax.Array, scale: jax.Array, bias: jax.Array,
                        epsilon: float) -> jax.Array:
  """The generated CNN's block on the CPU, one call each way.

  conv2d(x, kernel, stride 1, 'SAME') -> ReLU -> 2x2 max-pool -> BatchNorm with
  the statistics of the pooled output (`cnn.batch_stat_norm`). Where nothing
  differentiates it, a lighter forward call keeps neither the pooling winners
  nor the statistics.

  Args:
    x: [N, H, W, C_in] float32.
    kernel: [k, k, C_in, C_out] float32, k odd, C_out in (8, 16, 32, 64).
    scale, bias: [C_out] float32.
    epsilon: added to the variance.

  Returns:
    [N, H // 2, W // 2, C_out].

  Raises:
    ValueError: for inputs the kernel does not handle.
  """
  reason = unsupported(x, kernel)
  if reason:
    raise ValueError(f"model.conv_impl='fused_cpu': {reason}; use auto or patches.")
  load()
  return _conv_relu_pool_norm(x, kernel, scale, bias, epsilon)


ENCODER_ACTIVATIONS = ('relu', 'gelu', 'leaky_relu')  # The kernel's activation codes.
# Each layer's parameters in the order the kernel reads them.
_ENCODER_LAYER_PARAMS = tuple(
    [(('attention', name), leaf) for name in ('query', 'key', 'value', 'output')
     for leaf in ('kernel', 'bias')]
    + [(('attention_norm',), 'scale'), (('attention_norm',), 'bias')]
    + [((name,), leaf) for name in ('ffn_inner', 'ffn_output') for leaf in ('kernel', 'bias')]
    + [(('ffn_norm',), 'scale'), (('ffn_norm',), 'bias')])


def encoder_forward(params: dict, tokens: jax.Array, num_heads: int,
                    activation: str) -> jax.Array:
  """`transformer.Encoder`'s forward pass as one call (no gradient of its own).

  Args:
    params: the Encoder's params: {'layer_0': ..., 'layer_1': ...}.
    tokens: [L, E] float32 (vmap adds batch dimensions).
    num_heads, activation: the Encoder's attributes.

  Returns:
    [L, E], equal to the Encoder's output up to float rounding.
  """
  load()
  leaves = []
  for i in range(len(params)):
    layer = params[f'layer_{i}']
    for path, leaf in _ENCODER_LAYER_PARAMS:
      module = layer
      for name in path:
        module = module[name]
      leaves.append(module[leaf])
  # 'expand_dims': under vmap, unbatched parameters get size-1 leading
  # dimensions, which the kernel reads as shared (no copies).
  call = jax.ffi.ffi_call('cht_encoder_forward', jax.ShapeDtypeStruct(tokens.shape, jnp.float32),
                          vmap_method='expand_dims')
  return call(tokens, *leaves, num_heads=np.int64(num_heads),
              activation=np.int64(ENCODER_ACTIVATIONS.index(activation)))

