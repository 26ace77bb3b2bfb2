"""Omniglot through the stock TFDS `omniglot` builder, with class splits.

* `prepare_omniglot` prepares TFDS `omniglot` 3.0.0 in `data_dir`, offline from
  the four archives when at hand (checked against TFDS's registered checksums
  or a `SHA256SUMS` file beside them), else by the normal TFDS download.
* `load_omniglot` returns uint8 [C, 20, H, W, 1] per split, cached as `.npz`
  under `<data_dir>/cht_jax_cache/`: grey, or with `binarize=True` 0 and 255
  as the original HT's NumPy cache holds them (see `binarize_images`).
* Both prepare under `preparation_lock` (`<data_dir>/cht_jax_cache/prepare.lock`):
  of two processes sharing a data dir, the second waits and then reads what the
  first made.

Class ids are TFDS's `label`, a global id from the file names (`XXXX_YY.png`):
the 964 background characters are 0..963, the 659 evaluation ones 964..1622,
in the original release's order, not the alphabetical order of the alphabets.

Also holds what all data loaders share: `DataError` and `download_and_prepare`.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import glob
import hashlib
import os
import random
import re
import shutil
import socket
import sys
import tempfile
import time
import zipfile
from typing import Iterator, Sequence

from absl import logging
import numpy as np

NUM_CLASSES = 1623
NUM_BACKGROUND_CLASSES = 964
IMAGES_PER_CLASS = 20
HT_SPLIT_SIZES = (1150, 50, 423)  # train, validation, test.
ALPHABET_NUM_VALIDATION = 50
SPLITS = ('train', 'validation', 'test')
SPLIT_SCHEMES = ('ht', 'alphabet')

ARCHIVES = (
    'images_background.zip',
    'images_evaluation.zip',
    'images_background_small1.zip',
    'images_background_small2.zip',
)
SUMS_FILENAME = 'SHA256SUMS'
_UPSTREAM_URL = 'https://github.com/brendenlake/omniglot/raw/master/python/'
_CACHE_DIRNAME = 'cht_jax_cache'
_LOCK_NAME = 'prepare.lock'
_EXTRACT_PREFIX = 'cht_jax_extract_'
_TFDS_GCS_URL = 'https://storage.googleapis.com/tfds-data/'
_PROBE_TIMEOUT_S = 10


class DataError(RuntimeError):
  """The data is missing, corrupt, or not what the loader expects."""


def class_split(split_scheme: str = 'ht', split_seed: int = 2022) -> dict[str, np.ndarray]:
  """Returns {'train', 'validation', 'test'} -> int64 [C_split] global class ids.

  'ht': HyperTransformer's split, ids 0..1622 shuffled by `random.Random(split_seed)`
  (as `random.seed(split_seed); random.shuffle(ids)`), then 1150 train, 50 validation,
  423 test. 'alphabet': background ids 0..913 train, the last 50 (914..963, not whole
  alphabets) validation, evaluation ids 964..1622 test.
  """
  if split_scheme == 'ht':
    ids = list(range(NUM_CLASSES))
    random.Random(split_seed).shuffle(ids)
    n_train, n_val, _ = HT_SPLIT_SIZES
    parts = ids[:n_train], ids[n_train:n_train + n_val], ids[n_train + n_val:]
  elif split_scheme == 'alphabet':
    n_train = NUM_BACKGROUND_CLASSES - ALPHABET_NUM_VALIDATION
    parts = (range(n_train), range(n_train, NUM_BACKGROUND_CLASSES),
             range(NUM_BACKGROUND_CLASSES, NUM_CLASSES))
  else:
    raise ValueError(f'data.split_scheme must be one of {SPLIT_SCHEMES}, got {split_scheme!r}.')
  return {name: np.asarray(p, np.int64) for name, p in zip(SPLITS, parts)}


def _sha256(path: str) -> tuple[str, int]:
  digest = hashlib.sha256()
  size = 0
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
      size += len(block)
  return digest.hexdigest(), size


def _read_sums(folder: str) -> dict[str, str]:
  """Parses `<folder>/SHA256SUMS` (sha256sum format); {} if absent."""
  path = os.path.join(folder, SUMS_FILENAME)
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    rows = [line.split() for line in f]
  return {row[1].lstrip('*'): row[0].lower() for row in rows if len(row) == 2}


def error_summary(error: Exception) -> str:
  """'TypeName: first line of the message' (at most 300 characters), for a DataError."""
  first_line = (str(error).strip().splitlines() or [''])[0][:300]
  return f'{type(error).__name__}: {first_line}'


def download_and_prepare(builder, failure: str, fix: str, **kwargs) -> None:
  """`builder.download_and_prepare(**kwargs)`, its failure a one-paragraph DataError.

  TFDS errors are often pages long; this raises `failure (first line). fix`
  instead. A DataError of our own builders passes as it is. TFDS's progress
  bars are turned off unless stderr is a terminal: in a log file each redraw
  is a line, hundreds of thousands of them.
  """
  if not getattr(sys.stderr, 'isatty', lambda: False)():
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    tfds.disable_progress_bar()
  try:
    builder.download_and_prepare(**kwargs)
  except DataError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise DataError(f'{failure} ({error_summary(e)}). {fix}') from None


def _fix_hint(folder: str) -> str:
  return (f'Put the four Omniglot archives ({", ".join(ARCHIVES)}) from {_UPSTREAM_URL} (or a '
          f'checked offline copy with its {SUMS_FILENAME}) in {folder}, or point the config '
          'field `data.manual_dir` at a folder that has them.')


def _verified_url_infos(folder: str, registered: dict) -> dict:
  """Checks the archives in `folder`; returns url -> `UrlInfo` of each file there. A
  DataError where one is missing, or its sha256 matches neither TFDS's registered one
  (`registered`: the stock url_infos) nor `SHA256SUMS`'s."""
  from tensorflow_datasets.core.download import checksums  # pylint: disable=g-import-not-at-top
  from tensorflow_datasets.core import utils as tfds_utils  # pylint: disable=g-import-not-at-top

  missing = [a for a in ARCHIVES if not os.path.isfile(os.path.join(folder, a))]
  if missing:
    raise DataError(
        f'Omniglot archive(s) {", ".join(missing)} missing from {folder} (found only '
        f'{sorted(set(ARCHIVES) - set(missing))}); all four are needed to prepare the TFDS '
        '`omniglot` dataset offline. ' + _fix_hint(folder))
  by_name = {info.filename or os.path.basename(url): (url, info)
             for url, info in registered.items()}
  sums = _read_sums(folder)
  url_infos = {}
  for name in ARCHIVES:
    path = os.path.join(folder, name)
    sha, size = _sha256(path)
    url, tfds_info = by_name.get(name, (_UPSTREAM_URL + name, None))
    trusted = {}
    if tfds_info is not None:
      trusted[tfds_info.checksum] = 'the upstream archive registered by TFDS'
    if name in sums:
      trusted.setdefault(sums[name], f'listed in {folder}/{SUMS_FILENAME}')
    if sha not in trusted:
      expected = ' or '.join(f'{h} ({why})' for h, why in trusted.items()) or (
          f'a checksum listed in {folder}/{SUMS_FILENAME} (none found)')
      raise DataError(
          f'Omniglot archive {name} in {folder} has sha256 {sha} ({size} bytes), expected '
          f'{expected}. The file is corrupt, truncated or a different version: replace it '
          'with a fresh copy. ' + _fix_hint(folder))
    logging.info('Omniglot archive %s: sha256 ok (%s).', name, trusted[sha])
    url_infos[url] = checksums.UrlInfo(size=tfds_utils.Size(size), checksum=sha, filename=name)
  return url_infos


def _offline_builder(data_dir: str | None, url_infos: dict):
  """The stock Omniglot builder with `url_infos` of the local archives."""
  from tensorflow_datasets.image_classification import omniglot as tfds_omniglot  # pylint: disable=g-import-not-at-top

  class OfflineOmniglot(tfds_omniglot.Omniglot, skip_registration=True):
    name = 'omniglot'  # Same name, so the stock builder reads the result.

  OfflineOmniglot.url_infos = url_infos
  # Recorded as `module_name` in dataset_info.json: keep the stock value.
  OfflineOmniglot.__module__ = tfds_omniglot.Omniglot.__module__
  return OfflineOmniglot(data_dir=data_dir)


def _unreachable(urls: Sequence[str]) -> str | None:
  """Why none of `urls` answers a HEAD request, or None if one does."""
  import urllib.error  # pylint: disable=g-import-not-at-top
  import urllib.request  # pylint: disable=g-import-not-at-top

  reasons = []
  for url in urls:
    try:
      urllib.request.urlopen(urllib.request.Request(url, method='HEAD'),
                             timeout=_PROBE_TIMEOUT_S).close()
      return None
    except urllib.error.HTTPError:
      return None  # A server answered: the network works.
    except (urllib.error.URLError, OSError) as e:
      reasons.append(f'{url}: {getattr(e, "reason", e)}')
  return '; '.join(reasons)


@contextlib.contextmanager
def preparation_lock(root: str) -> Iterator[None]:
  """Holds `<root>/cht_jax_cache/prepare.lock` (flock) for the block: one process at a time
  prepares or caches data in `root`; another waits (saying so), then finds it ready. The
  kernel releases the lock when its holder dies, so a killed run leaves none held. Where
  the lock cannot be taken (a data dir that cannot be written, a file system without
  flock), the block runs without it, with a warning."""
  fd = _lock(os.path.join(root, _CACHE_DIRNAME, _LOCK_NAME), root)
  try:
    yield
  finally:
    if fd is not None:
      os.close(fd)  # Releases the lock.


def _lock(path: str, root: str) -> int | None:
  """The file descriptor of the lock file `path` (created if need be), locked; None, with a
  warning, where it cannot be."""
  fd = None
  try:
    if '://' in path:  # gs:// and the like: no local file to lock.
      raise OSError('not on a local file system')
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
      fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # The umask's permissions.
    except PermissionError:
      fd = os.open(path, os.O_RDONLY)  # Another user's: flock needs no write access.
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(fd, 200, 0).decode(errors='replace').strip() or 'unknown'
      logging.info('Waiting for another process preparing %s (%s; lock %s).', root, holder,
                   path)
      start = time.time()
      fcntl.flock(fd, fcntl.LOCK_EX)
      logging.info('Waited %.0f s for %s.', time.time() - start, path)
  except OSError as e:
    if fd is not None:
      os.close(fd)
    logging.warning('Cannot lock %s (%s: %s): going on without it, so another process '
                    'preparing the data there at the same time could disturb this one.',
                    path, type(e).__name__, e.strerror or e)
    return None
  with contextlib.suppress(OSError):  # Another user's lock file (read-only): not named.
    os.ftruncate(fd, 0)
    os.pwrite(fd, (f'host {socket.gethostname()}, process {os.getpid()}, since '
                   f'{datetime.datetime.now().isoformat(timespec="seconds")}\n').encode(), 0)
  return fd


def _remove_stale_preparations(builder) -> None:
  """Removes what an interrupted preparation left: TFDS's `incomplete.*` folders beside the
  dataset's version folders, and our extraction folders. Only under `preparation_lock`,
  whose holder alone prepares: any such folder is a dead process's."""
  root = os.fspath(builder.data_dir_root)
  stale = (glob.glob(os.path.join(os.path.dirname(os.fspath(builder.data_dir)), 'incomplete.*'))
           + glob.glob(os.path.join(root, 'downloads', _EXTRACT_PREFIX + '*')))
  for path in filter(os.path.isdir, stale):
    logging.info('Removing %s, left by an interrupted preparation.', path)
    shutil.rmtree(path, ignore_errors=True)


def prepare_omniglot(data_dir: str | None, manual_dir: str | None) -> None:
  """Makes sure the TFDS `omniglot` dataset is prepared in `data_dir` (None: default).

  The archives are looked for in `manual_dir`, then `<data_dir>/downloads/manual/`.
  The first folder with any must have all four, each with a known sha256; it is
  then prepared offline by a subclass of the stock builder with their
  `url_infos`. With none, TFDS downloads, unless neither the upstream server
  nor TFDS's GCS bucket answers a HEAD request: then this fails at once
  (TFDS would retry for minutes). A DataError where an archive is missing or
  corrupt, or the download failed. Prepares under `preparation_lock`, after
  removing what an interrupted preparation left.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  builder = tfds.builder('omniglot', data_dir=data_dir)
  if builder.is_prepared():  # Without the lock: a data dir others prepared may be read-only.
    logging.info('Omniglot already prepared in %s.', builder.data_dir)
    return
  with preparation_lock(_data_dir_root(data_dir)):
    _prepare_locked(data_dir, manual_dir)


def _prepare_locked(data_dir: str | None, manual_dir: str | None) -> None:
  """`prepare_omniglot` where the caller holds `preparation_lock`."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  builder = tfds.builder('omniglot', data_dir=data_dir)
  if builder.is_prepared():  # By the process this one waited for, or long ago.
    logging.info('Omniglot already prepared in %s.', builder.data_dir)
    return
  _remove_stale_preparations(builder)
  root = os.fspath(builder.data_dir_root)
  folders = [os.path.join(root, 'downloads', 'manual')]
  if manual_dir:
    folders.insert(0, os.path.expanduser(manual_dir))
  found = [f for f in folders if any(os.path.isfile(os.path.join(f, a)) for a in ARCHIVES)]
  folder = found[0] if found else folders[0]
  start = time.time()
  if found:
    logging.info('Preparing Omniglot offline from %s into %s.', folder, root)
    url_infos = _verified_url_infos(folder, type(builder).url_infos or {})
    offline = _offline_builder(data_dir, url_infos)
    # Extract into a fresh scratch folder, removed afterwards (32k PNGs).
    os.makedirs(os.path.join(root, 'downloads'), exist_ok=True)
    extract_dir = tempfile.mkdtemp(prefix=_EXTRACT_PREFIX, dir=os.path.join(root, 'downloads'))
    try:
      download_and_prepare(
          offline, f'Could not prepare Omniglot from the archives in {folder} into {root}',
          'The archives passed their checksums: check the free space and write access of that '
          'folder.',
          download_config=tfds.download.DownloadConfig(
              manual_dir=folder, extract_dir=extract_dir, try_download_gcs=False))
    finally:
      shutil.rmtree(extract_dir, ignore_errors=True)
  else:
    logging.info('No Omniglot archives in %s: downloading with TFDS into %s.',
                 ' or '.join(folders), root)
    # Under tfds.testing.mock_data nothing is downloaded: nothing to check.
    mocked = type(builder).download_and_prepare.__module__.startswith(
        'tensorflow_datasets.testing')
    offline = not mocked and _unreachable(
        list(type(builder).url_infos or {})[:1] + [_TFDS_GCS_URL])
    if offline:  # Fail now rather than after minutes of TFDS retries.
      raise DataError(
          f'No Omniglot archives in {" or ".join(folders)}, and no network to '
          f'download them ({offline}). ' + _fix_hint(folder))
    download_and_prepare(builder, f'Could not download Omniglot with TFDS into {root}',
                         'On a machine without internet access: ' + _fix_hint(folder))
  logging.info('Omniglot prepared in %s in %.1f s.', builder.data_dir, time.time() - start)


def class_images_from_examples(
    images: np.ndarray, labels: np.ndarray, images_per_class: int = IMAGES_PER_CLASS,
    allow_incomplete_classes: bool = False) -> tuple[np.ndarray, np.ndarray]:
  """Groups examples [E, ...] by label [E]: (class_ids int64 [C] ascending, [C, M, ...]).

  Each class keeps its first M = `images_per_class` examples. Unless
  `allow_incomplete_classes` (mock data), a class without exactly M raises
  DataError; with it, classes with fewer are dropped.
  """
  images, labels = np.asarray(images), np.asarray(labels).astype(np.int64)
  if images.shape[0] != labels.shape[0]:
    raise ValueError(f'{images.shape[0]} images but {labels.shape[0]} labels.')
  order = np.argsort(labels, kind='stable')
  class_ids, starts, counts = np.unique(labels[order], return_index=True, return_counts=True)
  if not allow_incomplete_classes:
    bad = np.flatnonzero(counts != images_per_class)
    if bad.size:
      raise DataError(
          f'{bad.size} class(es) do not have exactly {images_per_class} images, e.g. class '
          f'{class_ids[bad[0]]} has {counts[bad[0]]}. The prepared dataset is incomplete or not '
          'Omniglot 3.0.0: delete its folder and prepare it again.')
  keep = counts >= images_per_class
  if not keep.all():
    logging.warning('Dropping %d of %d classes with fewer than %d images.', (~keep).sum(),
                    keep.size, images_per_class)
  index = order[starts[keep, None] + np.arange(images_per_class)]
  return class_ids[keep], images[index]


def _read_split(builder, split: str, image_size: int):
  """Reads one TFDS split: uint8 [E, S, S, 1] images and int64 [E] labels."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  def resize(images, labels):
    images = tf.image.resize(tf.cast(images[..., :1], tf.float32), (image_size, image_size),
                             method='bilinear')
    images = tf.cast(tf.clip_by_value(tf.round(images), 0, 255), tf.uint8)
    return images, labels

  ds = builder.as_dataset(split=split, shuffle_files=False)
  ds = ds.map(lambda ex: (ex['image'], ex['label']), num_parallel_calls=tf.data.AUTOTUNE)
  ds = ds.batch(1024).map(resize, num_parallel_calls=tf.data.AUTOTUNE)
  try:
    batches = list(tfds.as_numpy(ds.prefetch(tf.data.AUTOTUNE)))
  except tf.errors.OpError as e:
    # TF wraps the reason: '{{function_node ...}} corrupted record at 42 [Op:...]'.
    reason = re.sub(r'\{\{.*?\}\}|\[Op:.*', '', e.message or '').split('\n')[0]
    raise DataError(
        f'The prepared TFDS omniglot in {builder.data_dir} cannot be read (split {split!r}: '
        f'{type(e).__name__}: {reason.strip()[:200]}). Delete that folder and run again to '
        'prepare it afresh from the archives.') from None
  if not batches:
    return np.zeros((0, image_size, image_size, 1), np.uint8), np.zeros((0,), np.int64)
  return (np.concatenate([b[0] for b in batches]),
          np.concatenate([b[1] for b in batches]).astype(np.int64))


def _check_labels(train_labels, test_labels, strict: bool) -> None:
  """Checks TFDS labels are global ids, background (train) first."""
  problems = [
      f"split '{split}' has labels {labels.min()}..{labels.max()}, expected {lo}..{hi - 1}"
      for split, labels, lo, hi in (('train', train_labels, 0, NUM_BACKGROUND_CLASSES),
                                    ('test', test_labels, NUM_BACKGROUND_CLASSES, NUM_CLASSES))
      if labels.size and (labels.min() < lo or labels.max() >= hi)]
  if not problems:
    return
  msg = ('TFDS omniglot labels are not global ids with the background set first: '
         + '; '.join(problems) + '.')
  if strict:
    raise DataError(msg + ' The prepared dataset is not Omniglot 3.0.0.')
  logging.warning('%s (allowed: allow_incomplete_classes=True)', msg)


def _data_dir_root(data_dir: str | None) -> str:
  """TFDS's data dir for `data_dir` (None or '': $TFDS_DATA_DIR, else ~/tensorflow_datasets)."""
  root = data_dir or os.environ.get('TFDS_DATA_DIR') or '~/tensorflow_datasets'
  return os.path.expanduser(os.fspath(root))


def _cache_path(root: str, split_scheme: str, split_seed: int, image_size: int,
                binarize: bool = False) -> str:
  """The cache file; binarised images have their own."""
  suffix = '_binary' if binarize else ''
  return os.path.join(root, _CACHE_DIRNAME,
                      f'omniglot_{split_scheme}_{split_seed}_{image_size}{suffix}.npz')


# Grey levels from here up become background (255), the others stroke (0).
BINARIZE_THRESHOLD = 128


def binarize_images(images: np.ndarray) -> np.ndarray:
  """uint8 images of the resize -> uint8 with only 0 (stroke) and 255 (background).

  The original HT reads a NumPy cache of boolean pixels, True -> 255, False -> 0
  (hypertransformer/tf/core/train_lib.py, `_load_cache` and `_convert_bool`).
  Omniglot's 1-bit PNGs are 1 on the background, so 255 = background here too;
  each pixel goes to the nearer value, at the stored resolution.
  """
  return np.where(np.asarray(images) >= BINARIZE_THRESHOLD, 255, 0).astype(np.uint8)


def _save_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
  """Writes a compressed .npz atomically (temp file + os.replace)."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix='.npz.tmp')
  try:
    # mkstemp's 0600 would hide the cache from the other users of a shared data dir.
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    with os.fdopen(fd, 'wb') as f:
      np.savez_compressed(f, **arrays)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def _select(class_ids: np.ndarray, class_images: np.ndarray,
            wanted: Sequence[int], split: str, strict: bool) -> np.ndarray:
  """class_images rows of the `wanted` ids, in that order."""
  pos = np.searchsorted(class_ids, wanted)
  pos = np.minimum(pos, max(len(class_ids) - 1, 0))
  found = (class_ids[pos] == wanted) if len(class_ids) else np.zeros(len(wanted), bool)
  if not found.all():
    if strict:
      raise DataError(f"{(~found).sum()} classes of split '{split}' are missing, e.g. "
                      f'{np.asarray(wanted)[~found][0]}.')
    pos = pos[found]
  return class_images[pos]


def load_omniglot(
    data_dir: str | None, manual_dir: str | None, split_scheme: str = 'ht',
    split_seed: int = 2022, image_size: int = 28, images_per_class: int = IMAGES_PER_CLASS,
    allow_incomplete_classes: bool = False, binarize: bool = False) -> dict[str, np.ndarray]:
  """Loads Omniglot class images per split, preparing the data if needed.

  TFDS's 105x105 PNGs are resized bilinearly (no antialiasing) to S =
  `image_size` and rounded to uint8 (0 = stroke, 255 = background). Only a
  complete, checked dataset is cached, so a second call reads one .npz. See
  `prepare_omniglot` for `data_dir` and `manual_dir`, `class_split` for the
  split. `allow_incomplete_classes` (mock data) drops classes with fewer than
  M = `images_per_class` images and only warns about labels that are not
  global ids. `binarize`: see `binarize_images`; cached in a file of its own.

  Returns {'train', 'validation', 'test'} -> uint8 [C_split, M, S, S, 1] (C 1150/50/423
  for 'ht', 914/50/659 for 'alphabet'); a DataError for missing or corrupt data, or
  classes without exactly M images.
  """
  splits = class_split(split_scheme, split_seed)  # Validates the scheme.
  # Mock data (tests) never reads or writes the cache of the real dataset.
  use_cache = images_per_class == IMAGES_PER_CLASS and not allow_incomplete_classes
  if binarize:
    return _load_binarized(data_dir, manual_dir, split_scheme, split_seed, image_size,
                           images_per_class, allow_incomplete_classes, use_cache)
  if not use_cache:
    prepare_omniglot(data_dir, manual_dir)
    return _read_omniglot(data_dir, splits, image_size, images_per_class,
                          allow_incomplete_classes)
  # Before TFDS is imported: a cached run needs no TensorFlow (GPU images often lack it).
  root = _data_dir_root(data_dir)
  cache = _cache_path(root, split_scheme, split_seed, image_size)
  out = _read_cache(cache, 'Omniglot')
  if out is not None:
    return out
  with preparation_lock(root):
    out = _read_cache(cache, 'Omniglot')  # Made by the process this one waited for?
    if out is None:
      _prepare_locked(data_dir, manual_dir)
      out = _read_omniglot(data_dir, splits, image_size, images_per_class)
      _save_cache(cache, out, 'Omniglot')
  return out


def _read_omniglot(data_dir: str | None, splits: dict[str, np.ndarray], image_size: int,
                   images_per_class: int = IMAGES_PER_CLASS,
                   allow_incomplete_classes: bool = False) -> dict[str, np.ndarray]:
  """The class images of `splits` from the prepared TFDS `omniglot` (see `load_omniglot`)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  builder = tfds.builder('omniglot', data_dir=data_dir)
  strict = not allow_incomplete_classes
  start = time.time()
  train_images, train_labels = _read_split(builder, 'train', image_size)
  test_images, test_labels = _read_split(builder, 'test', image_size)
  logging.info('Read %d + %d Omniglot images in %.1f s.', len(train_labels), len(test_labels),
               time.time() - start)
  _check_labels(train_labels, test_labels, strict)
  class_ids, class_images = class_images_from_examples(
      np.concatenate([train_images, test_images]), np.concatenate([train_labels, test_labels]),
      images_per_class, allow_incomplete_classes)
  out = {s: _select(class_ids, class_images, ids, s, strict) for s, ids in splits.items()}
  if strict and len(class_ids) != NUM_CLASSES:
    raise DataError(f'Expected {NUM_CLASSES} Omniglot classes, found {len(class_ids)}.')
  logging.info('Omniglot split: %s classes in %.1f s.', {s: len(v) for s, v in out.items()},
               time.time() - start)
  return out


def _save_cache(cache: str, out: dict[str, np.ndarray], what: str) -> None:
  """`_save_npz`, or where the cache folder cannot be written, a warning: the run goes on
  with the images in memory."""
  try:
    _save_npz(cache, out)
  except OSError as e:
    folder = os.path.dirname(cache)
    logging.warning(
        'Could not write the cache %s (%s: %s): going on with the images in memory; each run '
        'reads them again until it can be written. Make %s a folder you can write, or set '
        'data.data_dir to one where you can (with a copy of its omniglot folder).', cache,
        type(e).__name__, e.strerror or e, folder)
    return
  logging.info('%s cached to %s.', what, cache)


def _read_cache(cache: str, what: str) -> dict[str, np.ndarray] | None:
  """The splits of a cache file; None where it is missing or unreadable (then rebuilt)."""
  if not os.path.exists(cache):
    return None
  try:
    with np.load(cache) as f:
      out = {s: f[s] for s in SPLITS}
  except (OSError, EOFError, KeyError, ValueError, zipfile.BadZipFile) as e:
    logging.warning('Rebuilding the unreadable cache %s (%s: %s).', cache, type(e).__name__, e)
    return None
  logging.info('%s loaded from cache %s.', what, cache)
  return out


def _load_binarized(data_dir, manual_dir, split_scheme, split_seed, image_size,
                    images_per_class, allow_incomplete_classes, use_cache):
  """`load_omniglot(..., binarize=True)`: its own cache, else the grey images binarised."""
  cache = _cache_path(_data_dir_root(data_dir), split_scheme, split_seed, image_size, binarize=True)
  out = _read_cache(cache, 'Binarised Omniglot') if use_cache else None
  if out is not None:
    return out
  grey = load_omniglot(data_dir, manual_dir, split_scheme, split_seed, image_size,
                       images_per_class, allow_incomplete_classes)
  out = {s: binarize_images(grey[s]) for s in SPLITS}
  # Only beside a grey cache, which exists once the data passed every check.
  if use_cache and os.path.exists(_cache_path(
      _data_dir_root(data_dir), split_scheme, split_seed, image_size)):
    _save_cache(cache, out, 'Binarised Omniglot')
  return out
