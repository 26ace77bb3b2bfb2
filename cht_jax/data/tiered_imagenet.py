"""tieredImageNet as a TFDS dataset built from the user's own download.

tieredImageNet (Ren et al., ICLR 2018): 351 training, 97 validation and 160 test ImageNet
classes, 84x84 RGB. ImageNet's licence forbids re-hosting, so the builder `tiered_imagenet_cht`
(unregistered) prepares it from a manual folder: (a) the pickled release of Ren et al.,
`{train,val,test}_images_png.pkl` (PNG bytes or uint8 arrays) and `{train,val,test}_labels.pkl`
('label_specific', optionally 'label_specific_str'; Python 2 pickles read as latin1), or (b)
`{train,val,test}/<class name>/*.{jpg,jpeg,png}`, resized bilinearly. Features: 'image' uint8
[84, 84, 3] (PNG), 'label' int64 (by release id or folder name), 'class_name'; ArrayRecord.
"""

from __future__ import annotations

import functools
import glob
import io
import os
import pickle
from typing import Iterator

from absl import logging
import numpy as np

from cht_jax.data import omniglot
from cht_jax.data.omniglot import DataError

NAME = 'tiered_imagenet_cht'
IMAGE_SIZE = 84
SPLIT_CLASSES = {'train': 351, 'validation': 97, 'test': 160}
# Split name in the files of the release / folder layout.
FILE_SPLITS = {'train': 'train', 'validation': 'val', 'test': 'test'}
IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png')

MANUAL_DOWNLOAD_INSTRUCTIONS = """\
tieredImageNet cannot be downloaded automatically (ImageNet licence). Put ONE
of these in the manual folder, {folder}:
(a) the pickled release of Ren et al. 2018 ("tiered-imagenet.tar", linked from
    the README of github.com/renmengye/few-shot-ssl-public), unpacked so that
    the folder holds train_images_png.pkl, train_labels.pkl, val_images_png.pkl,
    val_labels.pkl, test_images_png.pkl and test_labels.pkl;
(b) or, from your ImageNet (ILSVRC-2012) copy and the tieredImageNet class lists
    (tiered_split/{train,val,test}.csv of the same repository), the folders
    train/<class>/*.JPEG, val/<class>/*.JPEG and test/<class>/*.JPEG
    (351, 97 and 160 class folders).
Or point the config field `data.manual_dir` at a folder laid out like that."""


def _fix_hint(folder: str) -> str:
  return MANUAL_DOWNLOAD_INSTRUCTIONS.replace('{folder}', folder).replace('\n', ' ')


def _pickle_files(folder: str, split: str) -> tuple[str, str]:
  name = FILE_SPLITS[split]
  return (os.path.join(folder, f'{name}_images_png.pkl'),
          os.path.join(folder, f'{name}_labels.pkl'))


def detect_layout(folder: str) -> str:
  """'pickle' or 'folders', whichever `folder` holds completely; else DataError."""
  pickles = [p for s in SPLIT_CLASSES for p in _pickle_files(folder, s)]
  if all(os.path.isfile(p) for p in pickles):
    return 'pickle'
  dirs = [os.path.join(folder, FILE_SPLITS[s]) for s in SPLIT_CLASSES]
  if all(os.path.isdir(d) for d in dirs):
    return 'folders'
  if not os.path.isdir(folder):
    found = f'the folder {folder} does not exist'
  else:
    missing = [os.path.basename(p) for p in pickles if not os.path.isfile(p)]
    found = (f'{folder} has neither all six pickles (missing: {", ".join(missing)}) nor the '
             'folders train/, val/ and test/')
  raise DataError(f'tieredImageNet not found: {found}. ' + _fix_hint(folder))


def _load_pickle(path: str):
  with open(path, 'rb') as f:
    try:
      return pickle.load(f)
    except UnicodeDecodeError:  # A Python 2 pickle.
      f.seek(0)
      return pickle.load(f, encoding='latin1')


def _pickle_labels(folder: str, split: str) -> tuple[np.ndarray, list[str]]:
  """(label int64 [E] remapped to 0..C-1, class names [C]) of the release."""
  path = _pickle_files(folder, split)[1]
  try:
    data = _load_pickle(path)
    raw = np.asarray(data['label_specific']).astype(np.int64)
  except (OSError, pickle.UnpicklingError, EOFError, KeyError, TypeError) as e:
    raise DataError(f'Cannot read the tieredImageNet labels {path} ({type(e).__name__}: {e}); '
                    "expected a pickled dict with 'label_specific'. " + _fix_hint(folder)) from None
  ids, labels = np.unique(raw, return_inverse=True)
  names = data.get('label_specific_str')
  if names is not None and len(names) > int(ids.max()):
    names = [_text(names[i]) for i in ids]
  else:
    names = [str(i) for i in ids]
  return labels.astype(np.int64), names


def _text(value) -> str:
  return value.decode('latin1') if isinstance(value, bytes) else str(value)


def _folder_classes(folder: str, split: str) -> list[str]:
  root = os.path.join(folder, FILE_SPLITS[split])
  return sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))


def check_class_counts(folder: str, layout: str, expected: dict[str, int] | None) -> dict[str, int]:
  """Class count of each split; DataError if one differs from `expected`."""
  counts = {}
  for split in SPLIT_CLASSES:
    if layout == 'pickle':
      counts[split] = len(_pickle_labels(folder, split)[1])
    else:
      counts[split] = len(_folder_classes(folder, split))
  if expected is not None and counts != dict(expected):
    raise DataError(
        f'tieredImageNet in {folder} ({layout} layout) has {counts} classes per split, expected '
        f'{dict(expected)}: the download is incomplete or another dataset. ' + _fix_hint(folder))
  return counts


def _as_84x84_png(encoded: bytes) -> bytes | np.ndarray:
  """The PNG bytes as they are when 84x84 RGB PNG, else a resized array."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  image = Image.open(io.BytesIO(encoded))
  if image.format == 'PNG' and image.mode == 'RGB' and image.size == (IMAGE_SIZE, IMAGE_SIZE):
    return encoded
  return _resized(image)


def _resized(image) -> np.ndarray:
  from PIL import Image  # pylint: disable=g-import-not-at-top
  image = image.convert('RGB')
  if image.size != (IMAGE_SIZE, IMAGE_SIZE):
    image = image.resize((IMAGE_SIZE, IMAGE_SIZE), Image.BILINEAR)
  return np.asarray(image, np.uint8)


def generate_examples(folder: str, layout: str, split: str) -> Iterator[tuple[str, dict]]:
  """(key, example) pairs of one split, as TFDS's `_generate_examples`."""
  if layout == 'pickle':
    labels, names = _pickle_labels(folder, split)
    images = _load_pickle(_pickle_files(folder, split)[0])
    if len(images) != len(labels):
      raise DataError(f'{_pickle_files(folder, split)[0]} has {len(images)} images but its labels '
                      f'file {len(labels)} labels. ' + _fix_hint(folder))
    for index, (encoded, label) in enumerate(zip(images, labels)):
      if not isinstance(encoded, bytes):  # uint8 array of the PNG's bytes.
        encoded = np.asarray(encoded, np.uint8).tobytes()
      yield f'{split}_{index}', {'image': _as_84x84_png(encoded), 'label': int(label),
                                 'class_name': names[label]}
    return
  from PIL import Image  # pylint: disable=g-import-not-at-top
  root = os.path.join(folder, FILE_SPLITS[split])
  for label, name in enumerate(_folder_classes(folder, split)):
    paths = sorted(p for p in glob.glob(os.path.join(root, name, '*'))
                   if p.lower().endswith(IMAGE_EXTENSIONS))
    for path in paths:
      with Image.open(path) as image:
        array = _resized(image)
      yield f'{split}_{name}_{os.path.basename(path)}', {
          'image': array, 'label': label, 'class_name': name}


@functools.cache
def builder_class():
  """The TFDS builder class (defined on first use: TFDS imports are slow)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  class TieredImagenetCht(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """tieredImageNet from a manual download (pickled release or folders)."""

    VERSION = tfds.core.Version('1.0.0')
    RELEASE_NOTES = {'1.0.0': 'First version.'}
    MANUAL_DOWNLOAD_INSTRUCTIONS = MANUAL_DOWNLOAD_INSTRUCTIONS.replace(
        '{folder}', '<data_dir>/downloads/manual/tiered_imagenet')
    # Classes per split; None accepts any counts (small custom datasets).
    expected_classes: dict[str, int] | None = SPLIT_CLASSES

    def _info(self):
      return self.dataset_info_from_configs(
          features=tfds.features.FeaturesDict({
              'image': tfds.features.Image(shape=(IMAGE_SIZE, IMAGE_SIZE, 3),
                                           encoding_format='png'),
              'label': tfds.features.Scalar(np.int64),
              'class_name': tfds.features.Text(),
          }),
          supervised_keys=('image', 'label'),
          homepage='https://github.com/renmengye/few-shot-ssl-public',
      )

    def _split_generators(self, dl_manager):
      folder = os.fspath(dl_manager.manual_dir)
      layout = detect_layout(folder)
      counts = check_class_counts(folder, layout, self.expected_classes)
      logging.info('tieredImageNet from %s (%s layout): %s classes.', folder, layout, counts)
      return {split: self._generate_examples(folder, layout, split) for split in SPLIT_CLASSES}

    def _generate_examples(self, folder, layout, split):
      yield from generate_examples(folder, layout, split)

  TieredImagenetCht.name = NAME
  return TieredImagenetCht


def prepare(data_dir: str | None, manual_dir: str | None,
            expected_classes: dict[str, int] | None = SPLIT_CLASSES):
  """The TFDS builder of tieredImageNet, prepared in `data_dir` from `manual_dir` (None:
  `<data_dir>/downloads/manual/tiered_imagenet`) if not yet; DataError if files are missing or
  the class counts per split are not `expected_classes` (None: any)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  builder = builder_class()(data_dir=data_dir, file_format='array_record')
  builder.expected_classes = expected_classes
  if builder.is_prepared():
    return builder
  folder = os.path.expanduser(manual_dir) if manual_dir else os.path.join(
      os.fspath(builder.data_dir_root), 'downloads', 'manual', 'tiered_imagenet')
  layout = detect_layout(folder)  # Clear message before TFDS starts.
  check_class_counts(folder, layout, expected_classes)
  omniglot.download_and_prepare(
      builder, f'Could not prepare tieredImageNet from {folder} into {builder.data_dir_root}',
      'A file there may be corrupt or unreadable. ' + _fix_hint(folder),
      download_config=tfds.download.DownloadConfig(manual_dir=folder, try_download_gcs=False))
  return builder
