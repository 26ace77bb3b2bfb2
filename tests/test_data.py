"""Tests of cht_jax.data: episode sampling, class splits, the Omniglot loader."""

import io
import os
import random
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds

from cht_jax.data import episodes
from cht_jax.data import omniglot

from conftest import OMNIGLOT_ARCHIVES, REPO_ROOT, require_archives

# --------------------------------------------------------------------------
# Episodes. Class c, image m is base[c] + m, with base[c] a random (so
# rotation-asymmetric) pattern in 0..199: the content of a sampled image tells
# its class, its image index and its rotation.
# --------------------------------------------------------------------------

NUM_CLASSES, NUM_IMAGES, SIZE = 30, 10, 8


@pytest.fixture(scope='module')
def bases():
  return np.random.default_rng(0).integers(0, 200, (NUM_CLASSES, SIZE, SIZE),
                                           dtype=np.uint8)


@pytest.fixture(scope='module')
def class_images(bases):
  images = bases[:, None] + np.arange(NUM_IMAGES, dtype=np.uint8)[None, :,
                                                                     None, None]
  return jnp.asarray(images[..., None])  # [C, M, S, S, 1]


def _to_uint8(x):
  return np.round((np.asarray(x) + 1.0) * 128.0).astype(np.int64)[..., 0]


def _identify(image, bases):
  """(class, image index, quarter turns) of one sampled image [S, S]."""
  unrotated = np.stack([np.rot90(image, -r) for r in range(4)])
  diff = unrotated[:, None] - bases[None].astype(np.int64)  # [4, C, S, S]
  offset = diff[..., :1, :1]
  match = (diff == offset).all((-2, -1)) & (offset[..., 0, 0] >= 0) & (
      offset[..., 0, 0] < NUM_IMAGES)
  (r,), (c,) = np.nonzero(match)  # Exactly one match.
  return int(c), int(offset[r, c, 0, 0]), int(r)


def _identify_episode(ep, spec, bases):
  """Per task, per label: list of (class, image, rotation), support first."""
  t, k, n, q = spec[:4]
  sup = _to_uint8(ep['support_images']).reshape(t, k, n, SIZE, SIZE)
  qry = _to_uint8(ep['query_images']).reshape(t, k, q, SIZE, SIZE)
  return [[[_identify(im, bases) for im in np.concatenate([sup[i, j],
                                                            qry[i, j]])]
           for j in range(k)] for i in range(t)]


SPEC = episodes.EpisodeSpec(num_tasks=3, ways=4, shots=2, queries_per_class=3)
_sample_episode = jax.jit(episodes.sample_episode, static_argnums=(2, 3))
_sample_episodes = jax.jit(episodes.sample_episodes, static_argnums=(2, 3, 4))


def test_episode_shapes_dtypes_labels(class_images):
  ep = _sample_episode(jax.random.key(0), class_images, SPEC, False)
  t, k, n, q = SPEC[:4]
  assert ep['support_images'].shape == (t, k * n, SIZE, SIZE, 1)
  assert ep['query_images'].shape == (t, k * q, SIZE, SIZE, 1)
  assert ep['support_images'].dtype == ep['query_images'].dtype == jnp.float32
  for name, per_class in (('support_labels', n), ('query_labels', q)):
    assert ep[name].dtype == jnp.int32
    expected = np.tile(np.repeat(np.arange(k), per_class), (t, 1))
    np.testing.assert_array_equal(ep[name], expected)
  assert ep['class_ids'].shape == (t, k)
  assert ep['class_ids'].dtype == jnp.int32


def test_disjoint_classes_and_distinct_images(class_images, bases):
  ep = _sample_episode(jax.random.key(1), class_images, SPEC, False)
  ids = np.asarray(ep['class_ids'])
  assert len(set(ids.ravel())) == SPEC.num_tasks * SPEC.ways
  for i, task in enumerate(_identify_episode(ep, SPEC, bases)):
    for j, samples in enumerate(task):
      assert {c for c, _, _ in samples} == {ids[i, j]}
      assert {r for _, _, r in samples} == {0}
      assert len({m for _, m, _ in samples}) == len(samples)  # N+Q distinct.


def test_same_classes_mode(class_images, bases):
  """Every task has the same classes, each with its own images (no image in two
  tasks: no query of one task is a support image of another) and one rotation."""
  spec = SPEC._replace(task_classes='same', num_tasks=2)  # 2 * (2 + 3) = all 10 images.
  for seed in range(3):
    ep = _sample_episode(jax.random.key(seed), class_images, spec, True)
    ids = np.asarray(ep['class_ids'])
    assert (ids == ids[:1]).all() and len(set(ids[0])) == spec.ways
    samples = _identify_episode(ep, spec, bases)  # [T][K][N+Q] of (class, image, turns).
    for j in range(spec.ways):
      of_class = [s for task in samples for s in task[j]]
      assert {c for c, _, _ in of_class} == {ids[0, j]}
      assert len({m for _, m, _ in of_class}) == len(of_class) == 10
      assert len({r for _, _, r in of_class}) == 1
  with pytest.raises(ValueError, match=r'3 tasks \* \(2 \+ 3\) = 15 distinct'):
    episodes.validate_spec(SPEC._replace(task_classes='same'), class_images.shape)


def test_same_classes_evaluation_queries_avoid_every_support_image(class_images, bases):
  spec = SPEC._replace(task_classes="same", num_tasks=2)
  ep = episodes.sample_evaluation_episode(jax.random.key(7), class_images, spec, 3)
  t, k, n, q = spec[:4]
  support = _to_uint8(ep['support_images']).reshape(t, k, n, SIZE, SIZE)
  queries = _to_uint8(ep['query_images']).reshape(3, t, k, q, SIZE, SIZE)
  for j in range(k):
    support_ids = [_identify(im, bases)[1] for i in range(t) for im in support[i, j]]
    assert len(set(support_ids)) == t * n  # Distinct support batches.
    query_ids = {_identify(im, bases)[1] for r in range(3) for i in range(t) for im in queries[r, i, j]}
    assert not query_ids & set(support_ids)


def test_rotation_same_for_support_and_query_of_a_class(class_images, bases):
  eps = _sample_episodes(jax.random.key(3), class_images, SPEC, 6,
                                 rotate=True)
  rotations = []
  for b in range(6):
    ep = jax.tree.map(lambda x, b=b: x[b], eps)
    for i, task in enumerate(_identify_episode(ep, SPEC, bases)):
      for j, samples in enumerate(task):
        assert {c for c, _, _ in samples} == {int(ep['class_ids'][i, j])}
        assert len({r for _, _, r in samples}) == 1
        rotations.append(samples[0][2])
  assert set(rotations) == {0, 1, 2, 3}


def test_deterministic_in_key(class_images):
  a = _sample_episodes(jax.random.key(4), class_images, SPEC, 6, True)
  b = _sample_episodes(jax.random.key(4), class_images, SPEC, 6, True)
  c = _sample_episodes(jax.random.key(5), class_images, SPEC, 6, True)
  for name in a:
    assert a[name].shape[0] == 6
    np.testing.assert_array_equal(a[name], b[name])
  assert not np.array_equal(a['class_ids'], c['class_ids'])
  # Episodes of a batch differ.
  assert not np.array_equal(a['class_ids'][0], a['class_ids'][1])


def test_normalize_range():
  x = episodes.normalize(jnp.arange(256, dtype=jnp.uint8))
  assert x.dtype == jnp.float32
  assert float(x.min()) == -1.0 and float(x.max()) == 127 / 128
  np.testing.assert_allclose(x[128], 0.0)


@pytest.mark.parametrize('spec, rotate, shape, match', [
    (episodes.EpisodeSpec(5, 20, 1, 3), False, (50, 20, 8, 8, 1),
     r'episode.ways \* episode.num_tasks = 20 \* 5 = 100 distinct classes.*only 50'),
    (episodes.EpisodeSpec(5, 60, 1, 3, 'same'), False, (50, 20, 8, 8, 1),
     'episode.ways = 60'),
    (episodes.EpisodeSpec(1, 5, 5, 16), False, (50, 20, 8, 8, 1),
     r'shots \+ episode.queries_per_class = 5 \+ 16 = 21'),
    (episodes.EpisodeSpec(1, 5, 1, 1, 'mixed'), False, (50, 20, 8, 8, 1),
     'episode.task_classes'),
    (episodes.EpisodeSpec(1, 0, 1, 1), False, (50, 20, 8, 8, 1),
     'episode.ways must be >= 1'),
    (episodes.EpisodeSpec(1, 5, 1, 1), True, (50, 20, 8, 6, 1), 'square'),
])
def test_spec_validation(spec, rotate, shape, match):
  with pytest.raises(ValueError, match=match):
    episodes.sample_episodes(jax.random.key(0), jnp.zeros(shape, jnp.uint8),
                             spec, 2, rotate)


def test_rejects_float_images():
  with pytest.raises(ValueError, match='uint8'):
    episodes.sample_episode(jax.random.key(0),
                            jnp.zeros((10, 5, 4, 4, 1), jnp.float32),
                            episodes.EpisodeSpec(1, 2, 1, 1), False)


# --------------------------------------------------------------------------
# Class splits and grouping.
# --------------------------------------------------------------------------


def test_ht_split():
  splits = omniglot.class_split('ht', 2022)
  assert [len(splits[s]) for s in omniglot.SPLITS] == [1150, 50, 423]
  everything = np.concatenate([splits[s] for s in omniglot.SPLITS])
  np.testing.assert_array_equal(np.sort(everything), np.arange(1623))
  # Same as HT's `random.seed(2022); random.shuffle(...)`.
  state = random.getstate()
  try:
    random.seed(2022)
    ids = list(range(1623))
    random.shuffle(ids)
  finally:
    random.setstate(state)
  np.testing.assert_array_equal(everything, ids)
  again = omniglot.class_split('ht', 2022)
  for s in omniglot.SPLITS:
    np.testing.assert_array_equal(splits[s], again[s])
  assert not np.array_equal(omniglot.class_split('ht', 1)['train'],
                            splits['train'])


def test_alphabet_split():
  splits = omniglot.class_split('alphabet')
  np.testing.assert_array_equal(splits['train'], np.arange(914))
  np.testing.assert_array_equal(splits['validation'], np.arange(914, 964))
  np.testing.assert_array_equal(splits['test'], np.arange(964, 1623))
  with pytest.raises(ValueError, match='split_scheme'):
    omniglot.class_split('random')


def test_class_images_from_examples():
  labels = np.array([3, 1, 3, 1, 7, 3, 1, 7])
  images = np.arange(8) * 10
  with pytest.raises(omniglot.DataError, match='exactly 3'):
    omniglot.class_images_from_examples(images, labels, 3)
  ids, grouped = omniglot.class_images_from_examples(
      images, labels, 3, allow_incomplete_classes=True)
  np.testing.assert_array_equal(ids, [1, 3])
  np.testing.assert_array_equal(grouped, [[10, 30, 60], [0, 20, 50]])
  ids, grouped = omniglot.class_images_from_examples(images[:6],
                                                     labels[:6] * 0, 6)
  np.testing.assert_array_equal(ids, [0])
  np.testing.assert_array_equal(grouped, [images[:6]])


# --------------------------------------------------------------------------
# The Omniglot loader.
# --------------------------------------------------------------------------


def test_load_omniglot_under_mock_data(tmp_path):
  with tfds.testing.mock_data(num_examples=1000):
    out = omniglot.load_omniglot(str(tmp_path), None, image_size=14,
                                 images_per_class=2,
                                 allow_incomplete_classes=True)
    with pytest.raises(omniglot.DataError):
      omniglot.load_omniglot(str(tmp_path), None, image_size=14)
  for split in omniglot.SPLITS:
    assert out[split].dtype == np.uint8
    assert out[split].shape[1:] == (2, 14, 14, 1)
    assert 0 < len(out[split]) <= len(omniglot.class_split()[split])
  # Nothing prepared or cached: only the lock taken to prepare.
  assert [str(p.relative_to(tmp_path)) for p in tmp_path.rglob('*') if p.is_file()] == [
      'cht_jax_cache/prepare.lock']


class _FailingBuilder:
  """A TFDS builder whose preparation raises `error`."""

  def __init__(self, error):
    self.error = error

  def download_and_prepare(self, **kwargs):
    raise self.error


def test_tfds_failures_become_one_paragraph(monkeypatch):
  tfds.enable_progress_bar()
  monkeypatch.setattr(sys, 'stderr', io.StringIO())  # A log file, not a terminal.
  error = OSError('No space left on device\n  Traceback ...\n  more lines')
  with pytest.raises(omniglot.DataError) as e:
    omniglot.download_and_prepare(_FailingBuilder(error), 'Could not prepare X in /d',
                                  'Free some space.')
  assert str(e.value) == ('Could not prepare X in /d (OSError: No space left on device). '
                          'Free some space.')
  ours = omniglot.DataError('Our own message.')  # Already says what to do.
  with pytest.raises(omniglot.DataError, match='^Our own message.$'):
    omniglot.download_and_prepare(_FailingBuilder(ours), 'Could not', 'Fix.')
  # Progress bars off: in a log file each redraw was a line (230,000 of them).
  from tensorflow_datasets.core.utils import tqdm_utils  # pylint: disable=g-import-not-at-top
  assert isinstance(tqdm_utils.tqdm(range(1)), tqdm_utils.EmptyTqdm)


def test_missing_archive(tmp_path):
  manual = tmp_path / 'manual'
  manual.mkdir()
  (manual / 'images_background_small1.zip').write_bytes(b'x')
  # What a killed preparation leaves (TFDS's folder, ours), removed before preparing.
  stale = [tmp_path / 'tfds' / 'omniglot' / 'incomplete.4NKX0G_3.0.0',
           tmp_path / 'tfds' / 'downloads' / 'cht_jax_extract_k2j4x']
  for folder in stale:
    folder.mkdir(parents=True)
    (folder / 'part.tfrecord').write_bytes(b'x')
  with pytest.raises(omniglot.DataError,
                     match=r'images_background\.zip.*missing from') as e:
    omniglot.prepare_omniglot(str(tmp_path / 'tfds'), str(manual))
  assert 'data.manual_dir' in str(e.value)
  assert not any(folder.exists() for folder in stale)


# A run that loads Omniglot, its preparation (`_prepare_locked`) a stand-in that works until
# the file `go` appears, its TFDS read (`_read_omniglot`) one of blank images.
_PREPARING_RUN = """
import os, sys, time
from absl import logging
import numpy as np
from cht_jax.data import omniglot

def prepare(data_dir, manual_dir):
  print('preparing', flush=True)
  while not os.path.exists(go):
    time.sleep(0.05)

def read(data_dir, splits, size, *args):
  return {s: np.zeros((len(ids), 20, size, size, 1), np.uint8) for s, ids in splits.items()}

logging.use_absl_handler()
logging.set_verbosity(logging.INFO)
data_dir, go = sys.argv[1:]
omniglot._prepare_locked, omniglot._read_omniglot = prepare, read
out = omniglot.load_omniglot(data_dir, None, image_size=2)
print({s: len(v) for s, v in out.items()}, flush=True)
"""


def test_concurrent_preparations_of_a_data_dir_take_turns(tmp_path):
  """The second of two runs preparing one data dir failed after 65 s, blaming the free space:
  now it waits for the first, then reads the cache the first wrote."""
  data_dir, go = str(tmp_path / 'tfds'), str(tmp_path / 'go')
  run = lambda: subprocess.Popen(  # pylint: disable=g-long-lambda
      [sys.executable, '-c', _PREPARING_RUN, data_dir, go], cwd=REPO_ROOT,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  first = run()
  assert first.stdout.readline() == 'preparing\n'  # It holds the lock.
  second = run()
  waiting = f'Waiting for another process preparing {data_dir} (host '
  seen = ''
  while waiting not in seen and second.poll() is None:
    seen += second.stderr.readline()
  open(go, 'w').close()
  outputs = [p.communicate(timeout=60) for p in (first, second)]
  assert [first.returncode, second.returncode] == [0, 0], outputs
  sizes = "{'train': 1150, 'validation': 50, 'test': 423}\n"
  assert outputs[0][0] == sizes
  assert outputs[1][0] == sizes, outputs[1]  # Not prepared again: read from the cache.
  assert waiting in seen and 'Omniglot loaded from cache' in outputs[1][1], seen + outputs[1][1]


def test_a_cache_folder_that_cannot_be_written(tmp_path, monkeypatch, caplog):
  """Was a 38-line PermissionError traceback, the images read thrown away: now a warning
  naming the folder and the fix, and the run goes on with the images in memory."""
  blank = {s: np.zeros((len(ids), 20, 2, 2, 1), np.uint8)
           for s, ids in omniglot.class_split().items()}
  monkeypatch.setattr(omniglot, '_prepare_locked', lambda *args: None)  # Prepared earlier.
  monkeypatch.setattr(omniglot, '_read_omniglot', lambda *args: blank)
  folder = tmp_path / 'cht_jax_cache'
  folder.write_text('')  # Not a folder: cannot be written, even by root.
  out = omniglot.load_omniglot(str(tmp_path), None, image_size=2)
  assert out is blank
  warnings = [r.getMessage() for r in caplog.records if r.levelname == 'WARNING']
  assert any(f'Could not write the cache {folder}/omniglot_ht_2022_2.npz' in w and
             'going on with the images in memory' in w and f'Make {folder} a folder' in w
             for w in warnings), warnings
  assert any(w.startswith(f'Cannot lock {folder}/prepare.lock') for w in warnings), warnings




@pytest.mark.parametrize('name, damage', [
    ('images_evaluation.zip', 'truncate'),  # Rebuilt: SHA256SUMS applies.
    ('images_background_small1.zip', 'flip'),  # Upstream: TFDS's checksum.
])
def test_corrupt_archive_raises(tmp_path, name, damage):
  require_archives()
  manual = tmp_path / 'manual'
  shutil.copytree(OMNIGLOT_ARCHIVES, manual)
  path = manual / name
  path.chmod(0o644)
  data = bytearray(path.read_bytes())
  if damage == 'truncate':
    data = data[:len(data) // 2]
  else:
    data[len(data) // 2] ^= 0xFF
  path.write_bytes(bytes(data))
  with pytest.raises(omniglot.DataError, match=name) as e:
    omniglot.prepare_omniglot(str(tmp_path / 'tfds'), str(manual))
  assert str(manual) in str(e.value) and 'expected' in str(e.value)
  assert not (tmp_path / 'tfds' / 'omniglot').exists()


def test_real_omniglot(prepared_omniglot, monkeypatch):
  data_dir = prepared_omniglot
  builder = tfds.builder('omniglot', data_dir=data_dir)
  assert builder.is_prepared()
  assert type(builder).__module__.startswith('tensorflow_datasets.')
  # Prepared: no archives needed any more, no download tried.
  omniglot.prepare_omniglot(data_dir, None)

  start = time.time()
  out = omniglot.load_omniglot(data_dir, None, 'ht', 2022, 28)
  print(f'\nload_omniglot (read + resize + cache): {time.time() - start:.1f} s')
  assert {s: out[s].shape for s in omniglot.SPLITS} == {
      'train': (1150, 20, 28, 28, 1),
      'validation': (50, 20, 28, 28, 1),
      'test': (423, 20, 28, 28, 1)}
  everything = np.concatenate([out[s] for s in omniglot.SPLITS])
  assert everything.dtype == np.uint8
  assert everything.min() == 0 and everything.max() == 255
  assert 200 < everything.mean() < 250  # White background, dark strokes.
  # Different classes look different, the images of a class are distinct.
  assert not np.array_equal(out['train'][0, 0], out['train'][1, 0])
  assert len({out['test'][0, i].tobytes() for i in range(20)}) == 20

  with monkeypatch.context() as patch:  # The second load reads the cache alone.
    patch.setattr(omniglot, '_read_split', lambda *args: pytest.fail('TFDS read again'))
    cached = omniglot.load_omniglot(data_dir, None, 'ht', 2022, 28)
  for s in omniglot.SPLITS:
    np.testing.assert_array_equal(cached[s], out[s])

  alphabet = omniglot.load_omniglot(data_dir, None, 'alphabet', 2022, 28)
  assert [len(alphabet[s]) for s in omniglot.SPLITS] == [914, 50, 659]
  # Both schemes index the same class images by global id.
  ht_test_ids = omniglot.class_split('ht', 2022)['test']
  first = ht_test_ids[0]
  where = ('train', first) if first < 914 else (
      ('validation', first - 914) if first < 964 else ('test', first - 964))
  np.testing.assert_array_equal(alphabet[where[0]][where[1]], out['test'][0])
  assert os.path.exists(os.path.join(
      data_dir, 'cht_jax_cache', 'omniglot_ht_2022_28.npz'))
