"""Omniglot through the stock TFDS `omniglot` builder, with class splits.

Two entry points:

* `prepare_omniglot(data_dir, manual_dir)` makes sure the TFDS `omniglot`
  dataset (version 3.0.0) is prepared in `data_dir`, offline from the four
  archives when they are at hand (checked against TFDS's registered checksums
  or, for rebuilt archives, against a `SHA256SUMS` file beside them), else by
  the normal TFDS download.
* `load_omniglot(...)` returns uint8 arrays `[C, 20, H, W, 1]` per split
  ('train', 'validation', 'test'), cached as a compressed `.npz` under
  `<data_dir>/cht_jax_cache/`: the grey values of the resize, or with
  `binarize=True` (config.data.binarize) two values, 0 and 255, as the
  original HT's NumPy cache holds them (see `binarize_images`).

Class ids are TFDS's `label` feature, which is already a global id 0..1622:
TFDS takes it from the Omniglot file names (`XXXX_YY.png`, XXXX = 1-based
character number of the original release), so the 964 background characters
are 0..963 and the 659 evaluation characters 964..1622. Within a set the
numbering is the original release's, which is *not* the alphabetical order of
the alphabet folders (e.g. `Alphabet_of_the_Magi` is 708..727). The loader
checks this (background labels < 964 <= evaluation labels).

The first of the data loaders, this module also holds what all of them share
(multidomain.py, tiered_imagenet.py, pipeline.py): `DataError`, and
`download_and_prepare`, their one way to have TFDS prepare a dataset.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import tempfile
import time
import zipfile
from typing import Sequence

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
_TFDS_GCS_URL = 'https://storage.googleapis.com/tfds-data/'
_PROBE_TIMEOUT_S = 10


class DataError(RuntimeError):
  """The data is missing, corrupt, or not what the loader expects."""


# --------------------------------------------------------------------------
# Class splits.
# --------------------------------------------------------------------------


def class_split(
    split_scheme: str = 'ht', split_seed: int = 2022
) -> dict[str, np.ndarray]:
  """Returns the global class ids (TFDS `label`) of each split, in order.

  Args:
    split_scheme: 'ht': HyperTransformer's split. The ids 0..1622 in one list,
      shuffled with `random.Random(split_seed).shuffle` (the same permutation as
      `random.seed(split_seed); random.shuffle(ids)`); ids[0:1150] are train,
      ids[1150:1200] validation, ids[1200:1623] test. 'alphabet': the usual
      background/evaluation protocol. The 964 background classes (ids 0..963,
      30 alphabets) are train except the last 50 ids (914..963) which are
      validation; the 659 evaluation classes (ids 964..1622, 20 alphabets) are
      test. The 50 validation ids are the last in the original numbering, not
      whole alphabets; `split_seed` is unused.
    split_seed: seed of the 'ht' shuffle.

  Returns:
    {'train', 'validation', 'test'} -> int64 [C_split] class ids.
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
    raise ValueError(
        f'data.split_scheme must be one of {SPLIT_SCHEMES}, got '
        f'{split_scheme!r}.')
  return {name: np.asarray(p, np.int64) for name, p in zip(SPLITS, parts)}


# --------------------------------------------------------------------------
# Preparation.
# --------------------------------------------------------------------------


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
  sums = {}
  with open(path) as f:
    for line in f:
      parts = line.split()
      if len(parts) == 2:
        sums[parts[1].lstrip('*')] = parts[0].lower()
  return sums


def error_summary(error: Exception) -> str:
  """'TypeName: first line of the message' (at most 300 characters), for a DataError."""
  first_line = (str(error).strip().splitlines() or [''])[0][:300]
  return f'{type(error).__name__}: {first_line}'


def download_and_prepare(builder, failure: str, fix: str, **kwargs) -> None:
  """`builder.download_and_prepare(**kwargs)`, its failure a one-paragraph DataError.

  The data modules' one way to have TFDS prepare a dataset. TFDS fails with
  whatever its downloads, extraction or files raise, often pages long; the
  run instead stops on `failure`, the error's first line and `fix`. A
  DataError of our own builders already says what to do and passes as it is.

  Args:
    builder: the TFDS builder.
    failure: what could not be done, e.g. "Could not prepare the TFDS dataset
      'cars196' in /data".
    fix: what to do about it, one or more sentences.
    **kwargs: for `builder.download_and_prepare`.
  """
  try:
    builder.download_and_prepare(**kwargs)
  except DataError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise DataError(f'{failure} ({error_summary(e)}). {fix}') from None


def _fix_hint(folder: str) -> str:
  return (
      f'Put the four Omniglot archives ({", ".join(ARCHIVES)}) from '
      f'{_UPSTREAM_URL} (or a checked offline copy with its {SUMS_FILENAME}) '
      f'in {folder}, or point the config field `data.manual_dir` at a folder '
      'that has them.')


def _verified_url_infos(folder: str, registered: dict) -> dict:
  """Checks the archives in `folder`; returns TFDS url_infos matching them.

  Args:
    folder: folder with the four archives.
    registered: TFDS's registered url_infos of the stock builder.

  Returns:
    url -> `UrlInfo` of the file actually in `folder`, for each archive.

  Raises:
    DataError: an archive is missing, or its sha256 matches neither TFDS's
      registered checksum nor the one in `<folder>/SHA256SUMS`.
  """
  from tensorflow_datasets.core.download import checksums  # pylint: disable=g-import-not-at-top
  from tensorflow_datasets.core import utils as tfds_utils  # pylint: disable=g-import-not-at-top

  missing = [a for a in ARCHIVES if not os.path.isfile(os.path.join(folder, a))]
  if missing:
    raise DataError(
        f'Omniglot archive(s) {", ".join(missing)} missing from {folder} '
        f'(found only {sorted(set(ARCHIVES) - set(missing))}); all four are '
        f'needed to prepare the TFDS `omniglot` dataset offline. '
        + _fix_hint(folder))
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
          f'Omniglot archive {name} in {folder} has sha256 {sha} ({size} '
          f'bytes), expected {expected}. The file is corrupt, truncated or a '
          f'different version: replace it with a fresh copy. '
          + _fix_hint(folder))
    logging.info('Omniglot archive %s: sha256 ok (%s).', name, trusted[sha])
    url_infos[url] = checksums.UrlInfo(
        size=tfds_utils.Size(size), checksum=sha, filename=name)
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


def prepare_omniglot(data_dir: str | None, manual_dir: str | None) -> None:
  """Makes sure the TFDS `omniglot` dataset is prepared in `data_dir`.

  Nothing happens if it already is. Otherwise the four archives are looked for
  in `manual_dir` (when given), then in `<data_dir>/downloads/manual/`. In the
  first of these folders that has any of them, all four must be, each matching
  TFDS's registered sha256 or the one listed in a `SHA256SUMS` file beside it
  (a rebuilt archive); the dataset is then prepared offline (no GCS, no
  network) by a subclass of the stock builder whose `url_infos` are those of
  the checked files, and the stock builder reads the result. If no folder has
  any archive, the normal TFDS download is tried, unless neither the upstream
  server nor TFDS's GCS bucket answers a HEAD request within seconds: then
  this fails at once (TFDS itself would retry for minutes).

  Args:
    data_dir: TFDS data dir; None for TFDS's default (~/tensorflow_datasets or
      $TFDS_DATA_DIR).
    manual_dir: folder with the four archives, or None.

  Raises:
    DataError: an archive is missing or has a wrong checksum, or the download
      failed.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  builder = tfds.builder('omniglot', data_dir=data_dir)
  if builder.is_prepared():
    logging.info('Omniglot already prepared in %s.', builder.data_dir)
    return
  root = os.fspath(builder.data_dir_root)
  folders = [os.path.join(root, 'downloads', 'manual')]
  if manual_dir:
    folders.insert(0, os.path.expanduser(manual_dir))
  found = [f for f in folders
           if any(os.path.isfile(os.path.join(f, a)) for a in ARCHIVES)]
  folder = found[0] if found else folders[0]
  start = time.time()
  if found:
    logging.info('Preparing Omniglot offline from %s into %s.', folder, root)
    url_infos = _verified_url_infos(folder, type(builder).url_infos or {})
    offline = _offline_builder(data_dir, url_infos)
    # Extract into a fresh scratch folder, removed afterwards (32k PNGs).
    os.makedirs(os.path.join(root, 'downloads'), exist_ok=True)
    extract_dir = tempfile.mkdtemp(
        prefix='cht_jax_extract_', dir=os.path.join(root, 'downloads'))
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
    # Under tfds.testing.mock_data, download_and_prepare is a no-op from
    # TFDS's testing module: nothing will be downloaded, so nothing to check.
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
  logging.info('Omniglot prepared in %s in %.1f s.', builder.data_dir,
               time.time() - start)


# --------------------------------------------------------------------------
# Loading.
# --------------------------------------------------------------------------


def class_images_from_examples(
    images: np.ndarray,
    labels: np.ndarray,
    images_per_class: int = IMAGES_PER_CLASS,
    allow_incomplete_classes: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
  """Groups examples by class.

  Args:
    images: [E, ...] examples.
    labels: [E] integer class ids.
    images_per_class: M, images kept per class (the first M in example order).
    allow_incomplete_classes: if False, every class must have exactly M
      examples; if True, classes with fewer than M are dropped and classes
      with more are cut to their first M (for mock data in tests).

  Returns:
    (class_ids int64 [C] sorted ascending, class_images [C, M, ...]).

  Raises:
    DataError: a class has a number of examples other than M (strict mode).
  """
  images, labels = np.asarray(images), np.asarray(labels).astype(np.int64)
  if images.shape[0] != labels.shape[0]:
    raise ValueError(f'{images.shape[0]} images but {labels.shape[0]} labels.')
  order = np.argsort(labels, kind='stable')
  class_ids, starts, counts = np.unique(
      labels[order], return_index=True, return_counts=True)
  if not allow_incomplete_classes:
    bad = np.flatnonzero(counts != images_per_class)
    if bad.size:
      raise DataError(
          f'{bad.size} class(es) do not have exactly {images_per_class} '
          f'images, e.g. class {class_ids[bad[0]]} has {counts[bad[0]]}. The '
          'prepared dataset is incomplete or not Omniglot 3.0.0: delete its '
          'folder and prepare it again.')
  keep = counts >= images_per_class
  if not keep.all():
    logging.warning('Dropping %d of %d classes with fewer than %d images.',
                    (~keep).sum(), keep.size, images_per_class)
  index = order[starts[keep, None] + np.arange(images_per_class)]
  return class_ids[keep], images[index]


def _read_split(builder, split: str, image_size: int):
  """Reads one TFDS split: uint8 [E, S, S, 1] images and int64 [E] labels."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  def resize(images, labels):
    images = tf.image.resize(
        tf.cast(images[..., :1], tf.float32), (image_size, image_size),
        method='bilinear')
    images = tf.cast(tf.clip_by_value(tf.round(images), 0, 255), tf.uint8)
    return images, labels

  ds = builder.as_dataset(split=split, shuffle_files=False)
  ds = ds.map(lambda ex: (ex['image'], ex['label']),
              num_parallel_calls=tf.data.AUTOTUNE)
  ds = ds.batch(1024).map(resize, num_parallel_calls=tf.data.AUTOTUNE)
  try:
    batches = list(tfds.as_numpy(ds.prefetch(tf.data.AUTOTUNE)))
  except tf.errors.OpError as e:
    # TF wraps the reason: '{{function_node ...}} corrupted record at 42 [Op:...]'.
    reason = re.sub(r'\{\{.*?\}\}|\[Op:.*', '', e.message or '').split('\n')[0]
    raise DataError(
        f'The prepared TFDS omniglot in {builder.data_dir} cannot be read '
        f'(split {split!r}: {type(e).__name__}: {reason.strip()[:200]}). Delete that '
        'folder and run again to prepare it afresh from the archives.') from None
  if not batches:
    return (np.zeros((0, image_size, image_size, 1), np.uint8),
            np.zeros((0,), np.int64))
  return (np.concatenate([b[0] for b in batches]),
          np.concatenate([b[1] for b in batches]).astype(np.int64))


def _check_labels(train_labels, test_labels, strict: bool) -> None:
  """Checks TFDS labels are global ids, background (train) first."""
  problems = []
  if train_labels.size and (train_labels.min() < 0 or
                            train_labels.max() >= NUM_BACKGROUND_CLASSES):
    problems.append(f"split 'train' has labels {train_labels.min()}.."
                    f'{train_labels.max()}, expected 0..'
                    f'{NUM_BACKGROUND_CLASSES - 1}')
  if test_labels.size and (test_labels.min() < NUM_BACKGROUND_CLASSES or
                           test_labels.max() >= NUM_CLASSES):
    problems.append(f"split 'test' has labels {test_labels.min()}.."
                    f'{test_labels.max()}, expected {NUM_BACKGROUND_CLASSES}'
                    f'..{NUM_CLASSES - 1}')
  if not problems:
    return
  msg = ('TFDS omniglot labels are not global ids with the background set '
         'first: ' + '; '.join(problems) + '.')
  if strict:
    raise DataError(msg + ' The prepared dataset is not Omniglot 3.0.0.')
  logging.warning('%s (allowed: allow_incomplete_classes=True)', msg)


def _data_dir_root(data_dir: str | None) -> str:
  """TFDS's data dir for `data_dir` (None or '': $TFDS_DATA_DIR, else ~/tensorflow_datasets)."""
  root = data_dir or os.environ.get('TFDS_DATA_DIR') or '~/tensorflow_datasets'
  return os.path.expanduser(os.fspath(root))


def _cache_path(root: str, split_scheme: str, split_seed: int,
                image_size: int, binarize: bool = False) -> str:
  """The cache file; binarised images have their own (grey ones keep the old name)."""
  suffix = '_binary' if binarize else ''
  return os.path.join(root, _CACHE_DIRNAME,
                      f'omniglot_{split_scheme}_{split_seed}_{image_size}{suffix}.npz')


# Grey levels from here up become background (255), the others stroke (0).
BINARIZE_THRESHOLD = 128


def binarize_images(images: np.ndarray) -> np.ndarray:
  """uint8 images of the resize -> uint8 with only 0 (stroke) and 255 (background).

  The original HT reads Omniglot from a NumPy cache of boolean pixels and
  turns True into 255, False into 0 (hypertransformer/tf/core/train_lib.py,
  `_load_cache` and `_convert_bool`) before its x / 128 - 1. How that cache
  was made is not in the original code (it is a download); Omniglot's 1-bit
  PNGs are 1 on the white background, so a boolean read of them is True
  there, the polarity kept here (255 = background, as in the grey images).
  The threshold is the midpoint: each resized pixel goes to the nearer of the
  two values. Applied at the stored resolution (`image_size`): the original
  resizes after reading its cache (`train_lib._resize`, bilinear), which
  leaves two values only where the cache already has the model's size.
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
  found = (class_ids[pos] == wanted) if len(class_ids) else np.zeros(
      len(wanted), bool)
  if not found.all():
    if strict:
      raise DataError(f"{(~found).sum()} classes of split '{split}' are "
                      f'missing, e.g. {np.asarray(wanted)[~found][0]}.')
    pos = pos[found]
  return class_images[pos]


def load_omniglot(
    data_dir: str | None,
    manual_dir: str | None,
    split_scheme: str = 'ht',
    split_seed: int = 2022,
    image_size: int = 28,
    images_per_class: int = IMAGES_PER_CLASS,
    allow_incomplete_classes: bool = False,
    binarize: bool = False,
) -> dict[str, np.ndarray]:
  """Loads Omniglot class images per split, preparing the data if needed.

  Images are TFDS's 105x105 PNGs (first channel), resized bilinearly
  (`tf.image.resize`, no antialiasing) to `image_size`, rounded to uint8
  (0 = stroke, 255 = background). Classes are ordered as in `class_split`.
  The result is cached in `<data_dir>/cht_jax_cache/` (only for a prepared
  dataset that passed every check, with the full 20 images per class), so a
  second call reads one .npz.

  Args:
    data_dir: TFDS data dir (None: TFDS default).
    manual_dir: folder with the Omniglot archives for offline preparation
      (None: `<data_dir>/downloads/manual`). See `prepare_omniglot`.
    split_scheme: 'ht' or 'alphabet', see `class_split`.
    split_seed: seed of the 'ht' class shuffle.
    image_size: S, output height and width.
    images_per_class: M, images per class (20 in Omniglot).
    allow_incomplete_classes: for mock data in tests: drop classes with fewer
      than M images (keep the first M otherwise) and only warn about labels
      that are not Omniglot's global ids, instead of raising DataError.
    binarize: the resized images binarised (`binarize_images`), cached in a
      file of their own beside the grey one, made from it.

  Returns:
    {'train', 'validation', 'test'} -> uint8 [C_split, M, S, S, 1]; with the
    real data C is 1150/50/423 ('ht') or 914/50/659 ('alphabet').

  Raises:
    DataError: missing or corrupt data (see `prepare_omniglot`), or classes
      without exactly M images.
  """
  splits = class_split(split_scheme, split_seed)  # Validates the scheme.
  # Mock data (tests) never reads or writes the cache of the real dataset.
  use_cache = images_per_class == IMAGES_PER_CLASS and not allow_incomplete_classes
  if binarize:
    return _load_binarized(data_dir, manual_dir, split_scheme, split_seed, image_size,
                           images_per_class, allow_incomplete_classes, use_cache)
  if use_cache:
    # Read before TFDS is imported: training and evaluation from a prepared
    # cache need neither TensorFlow nor TFDS (GPU images often lack them).
    cache = _cache_path(_data_dir_root(data_dir), split_scheme, split_seed, image_size)
    out = _read_cache(cache, 'Omniglot')
    if out is not None:
      return out

  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  builder = tfds.builder('omniglot', data_dir=data_dir)
  cache = _cache_path(os.fspath(builder.data_dir_root), split_scheme, split_seed, image_size)
  start = time.time()
  prepare_omniglot(data_dir, manual_dir)
  builder = tfds.builder('omniglot', data_dir=data_dir)
  strict = not allow_incomplete_classes
  train_images, train_labels = _read_split(builder, 'train', image_size)
  test_images, test_labels = _read_split(builder, 'test', image_size)
  logging.info('Read %d + %d Omniglot images in %.1f s.', len(train_labels),
               len(test_labels), time.time() - start)
  _check_labels(train_labels, test_labels, strict)
  class_ids, class_images = class_images_from_examples(
      np.concatenate([train_images, test_images]),
      np.concatenate([train_labels, test_labels]),
      images_per_class, allow_incomplete_classes)
  out = {s: _select(class_ids, class_images, ids, s, strict)
         for s, ids in splits.items()}
  complete = (len(class_ids) == NUM_CLASSES and
              all(len(out[s]) == len(splits[s]) for s in SPLITS))
  if strict and not complete:
    raise DataError(f'Expected {NUM_CLASSES} Omniglot classes, found '
                    f'{len(class_ids)}.')
  if use_cache and complete and builder.is_prepared():
    _save_npz(cache, out)
    logging.info('Omniglot cached to %s.', cache)
  logging.info('Omniglot %s split: %s classes in %.1f s.', split_scheme,
               {s: len(v) for s, v in out.items()}, time.time() - start)
  return out


def _read_cache(cache: str, what: str) -> dict[str, np.ndarray] | None:
  """The splits of a cache file; None where it is missing or unreadable (then rebuilt)."""
  if not os.path.exists(cache):
    return None
  try:
    with np.load(cache) as f:
      out = {s: f[s] for s in SPLITS}
  except (OSError, EOFError, KeyError, ValueError, zipfile.BadZipFile) as e:
    logging.warning('Rebuilding the unreadable cache %s (%s: %s).', cache,
                    type(e).__name__, e)
    return None
  logging.info('%s loaded from cache %s.', what, cache)
  return out


def _load_binarized(data_dir, manual_dir, split_scheme, split_seed, image_size,
                    images_per_class, allow_incomplete_classes, use_cache):
  """`load_omniglot(..., binarize=True)`: its own cache, else the grey images binarised."""
  cache = _cache_path(_data_dir_root(data_dir), split_scheme, split_seed, image_size,
                      binarize=True)
  out = _read_cache(cache, 'Binarised Omniglot') if use_cache else None
  if out is not None:
    return out
  grey = load_omniglot(data_dir, manual_dir, split_scheme, split_seed, image_size,
                       images_per_class, allow_incomplete_classes)
  out = {s: binarize_images(grey[s]) for s in SPLITS}
  # Only beside a grey cache, which exists once the data passed every check.
  if use_cache and os.path.exists(_cache_path(
      _data_dir_root(data_dir), split_scheme, split_seed, image_size)):
    _save_npz(cache, out)
    logging.info('Binarised Omniglot cached to %s.', cache)
  return out
