"""Shared fixtures: a tiny HyperTransformer, random episodes, real Omniglot.

Tolerances. The suite passes on any x86-64 CPU (with or without AVX-512) and on
a GPU host. Two results of the same compiled program on the same machine are
compared bit for bit (resume, restore, the same seed twice); two different
compiled paths (a scan against a plain apply, vmap against a loop, a C++ kernel
against XLA, one device against several) at float32 rounding: about 1e-5
relative or absolute, more only where the test says why (sums of many terms,
a few training steps). An accuracy moves by whole queries: a rounding-level
flip of one argmax is the tolerance there.
"""

import atexit
import fcntl
import importlib.util
import os
import pathlib
import shutil
import tempfile
import time

# One persistent XLA compilation cache for the whole run, set before JAX is
# imported so that this process and every process started after it compile a
# given program once: most tests compile the same tiny configs. That includes
# the subprocesses tests start and pytest-xdist's workers (they inherit the
# environment of the process that loaded this file first, which alone makes
# and removes the folder). A per-run folder, so that no stale entry outlives a
# change of JAX or of the code.
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  _XLA_CACHE = tempfile.mkdtemp(prefix='cht_jax_tests_xla_cache_')
  atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _XLA_CACHE
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '-1')
# Most of the suite's time is XLA:CPU compiling hundreds of small kernels, each run a few
# times. So LLVM optimises them least (docs/performance.md, "The test suite's time"): the
# same HLO programs, their kernels slower, their float32 results different from a default
# build's at rounding level only, as between two CPUs, which the tolerances allow (above).
# Where a GPU or TPU plugin is installed the suite runs there, compiled as usual.
# Subprocesses inherit the flags.
_XLA_TEST_FLAGS = ['--xla_llvm_disable_expensive_passes=true']
if not (importlib.util.find_spec('jax_plugins') or importlib.util.find_spec('libtpu')):
  _XLA_TEST_FLAGS.append('--xla_backend_optimization_level=0')
for _flag in _XLA_TEST_FLAGS:
  if _flag.split('=')[0] not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()
# On a GPU host the suite runs several JAX processes at once (workers, subprocesses):
# none may take most of the memory up front, as JAX does by default.
os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds

from cht_jax.data import omniglot
from cht_jax.models import hypertransformer as ht_lib
from cht_jax.runtime import devices

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
# Read from the shared folder beside the checkout, never copied into it.
OMNIGLOT_ARCHIVES = REPO_ROOT.parent / 'shared' / 'data' / 'omniglot'

TINY = dict(num_tasks=3, ways=3, shots=2, queries=2, image_size=16)


def make_ht(**fields) -> ht_lib.HyperTransformer:
  """The HyperTransformer of the paper's Omniglot config (configs/omniglot_base.py, where
  its settings are written), in the modules' plain forms (conv_impl 'patches',
  encoder_impl 'xla', activation extractors as wide as the CNN), `fields` replaced."""
  from cht_jax import models  # pylint: disable=g-import-not-at-top
  from configs import omniglot_t5  # pylint: disable=g-import-not-at-top
  plain = {'conv_impl': 'patches', 'encoder_impl': 'xla', 'activation_features': None}
  return models.build_hypertransformer(omniglot_t5.get_config()).clone(**{**plain, **fields})


@pytest.fixture(scope='session')
def tiny_ht():
  return make_ht(num_ways=TINY['ways'], channels=(4, 4, 4, 4), cnn_embedding_dim=5,
                 embedding_dim=8, image_features=8, num_layers=1, num_heads=2)


def override(config, overrides: dict):
  """Sets dotted fields in place, as --config.x.y=... does: {'optim.name': 'sgd'}."""
  with config.unlocked():
    for dotted, value in overrides.items():
      node = config
      *path, leaf = dotted.split('.')
      for name in path:
        node = node[name]
      node[leaf] = value
  return config


def tiny_config(**overrides):
  """configs/omniglot_t2.py:tiny with dotted overrides: tiny_config(**{'optim.name': 'sgd'}).

  With distinct support and query draws, the configs' default when the suite's golden
  numbers were computed (test_methods, test_semisupervised); tests that step test_methods'
  configs then share its compiled programs. The original's draws, the default now, are
  test_original_conventions'."""
  from configs import omniglot_t2  # pylint: disable=g-import-not-at-top
  config = override(omniglot_t2.get_config('tiny'), {'episode.independent_draws': False})
  return override(config, overrides)  # T=2, 3-way 1-shot, 16x16.


def shallow_config(**overrides):
  """tiny_config with two conv blocks, not four: for tests whose assertions do not depend
  on the depth (it compiles in a fraction of the time). The whole-loss tests of
  test_fused_cpu, test_continual and test_mixed_precision share its programs."""
  return tiny_config(**{'model.num_blocks': 2, **overrides})


def class_images(num_classes=12, images_per_class=20, size=16, seed=0):
  """uint8 [C, M, H, W, 1]: a random template per class plus per-image noise."""
  rng = np.random.default_rng(seed)
  templates = rng.integers(0, 256, (num_classes, 1, size, size, 1))
  noise = rng.integers(-40, 40, (num_classes, images_per_class, size, size, 1))
  return np.clip(templates + noise, 0, 255).astype(np.uint8)


def training_classes() -> jax.Array:
  """test_methods' 20 training classes, put replicated on the data mesh as the trainer
  puts them: a test stepping a tiny config on them runs the program test_methods
  compiles for that config, which the persistent compilation cache holds."""
  return jax.device_put(class_images(20), jax.NamedSharding(devices.data_mesh(), jax.P()))


def same_machine(values, golden_values, ulps: int = 2) -> bool:
  """Whether float32 `values` are `golden_values` to `ulps` ulps each: the fingerprint of
  the machine (CPU type, XLA build) that wrote a golden run, where a test checks the
  rest of the run closely; elsewhere rounding sends a long run apart."""
  values, golden = np.float32(values), np.float32(golden_values)
  return bool(np.all(np.abs(values - golden) <= ulps * np.spacing(np.abs(golden))))


def normal(seed: int, shape: tuple[int, ...]) -> jax.Array:
  """float32 standard-normal test inputs from NumPy: `jax.random.normal` compiles a sampler
  for every shape, and XLA:CPU's compile time grows with the shape."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def make_episode(seed: int, num_tasks=TINY['num_tasks'], ways=TINY['ways'],
                 shots=TINY['shots'], queries=TINY['queries'], size=TINY['image_size']):
  """Random images, class-major labels: [T, K*N, H, W, 1] and [T, K*Q, H, W, 1]."""
  images = normal(seed, (num_tasks, ways * (shots + queries), size, size, 1))
  labels = lambda n: jnp.tile(jnp.repeat(jnp.arange(ways), n), (num_tasks, 1))
  return {
      'support_images': images[:, :ways * shots],
      'support_labels': labels(shots),
      'query_images': images[:, ways * shots:],
      'query_labels': labels(queries),
  }


@pytest.fixture(scope='session')
def tiny_episode():
  return make_episode(1)


def init_params(ht: ht_lib.HyperTransformer, episode: dict, jit: bool = False):
  """`ht`'s parameters from key 0, initialised on `episode`'s first task with theta = 0
  (the first task's theta_prev): returns (params, theta). Tests that build the same
  config and episode this way compile the same init.

  Eager by default: tests that initialise several configs op by op reuse those small
  programs from one config to the next, which a jitted init (one program per config)
  would not. `jit` compiles it as one program, faster for a single config."""
  theta = ht_lib.zeros_theta(ht.cnn, episode['support_images'].shape[2:])
  init = lambda key, images, labels, theta: ht.init(key, images, labels, theta)
  params = (jax.jit(init) if jit else init)(
      jax.random.key(0), episode['support_images'][0], episode['support_labels'][0],
      theta)['params']
  return params, theta


@pytest.fixture(scope='session')
def tiny_params(tiny_ht, tiny_episode):
  return init_params(tiny_ht, tiny_episode, jit=True)[0]  # One config: jitted is faster.


# pytest-xdist (pyproject's addopts) hands each worker one test file at a time, in collection
# order (`--no-loadscope-reorder`; its own reorder sorts by number of tests, which put the
# slowest file, of three tests, last). The slowest files go first, so that the two workers
# end together; `methods` second, as it needs no Omniglot while the first file prepares it.
# The order is by `--durations` per file; a file not named here runs after these.
SLOWEST_FILES_FIRST = ('test_reliability.py', 'test_methods.py', 'test_semisupervised.py',
                       'test_baselines.py', 'test_datasets.py', 'test_evaluate.py',
                       'test_parallel.py', 'test_multiprocess.py', 'test_train.py',
                       'test_fused_cpu.py', 'test_models.py', 'test_continual.py')


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(SLOWEST_FILES_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # Stable: files stay whole.


def require_archives():
  if not OMNIGLOT_ARCHIVES.is_dir():
    pytest.skip(f'Omniglot archives not found at {OMNIGLOT_ARCHIVES} '
                '(../shared/data/omniglot from the repository root).')


@pytest.fixture(scope='session')
def prepared_omniglot(tmp_path_factory):
  """A TFDS data_dir with omniglot prepared from the real archives, and its 16 x 16 images
  cached (cht_jax_cache/), once per run.

  Under pytest-xdist the workers share it: the first prepares it, under a lock,
  in the run's base folder (the parent of each worker's own).
  """
  require_archives()
  tfds.disable_progress_bar()
  root = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    root = root.parent
  data_dir = root / 'tfds_omniglot'
  with open(root / 'tfds_omniglot.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (data_dir / '.prepared').exists():
      data_dir.mkdir(exist_ok=True)
      start = time.time()
      omniglot.prepare_omniglot(str(data_dir), str(OMNIGLOT_ARCHIVES))
      # The tiny configs' resized images too: every process that trains one reads this
      # cache, and a job's processes would each build it at once.
      omniglot.load_omniglot(str(data_dir), None, image_size=TINY['image_size'])
      (data_dir / '.prepared').touch()
      print(f'\nTFDS omniglot preparation: {time.time() - start:.1f} s')
  return str(data_dir)
