"""Multi-domain episodes: six TFDS datasets, one image size, per-domain class splits.

The paper's "Learning from tasks across multiple domains": each task comes from
its own domain. Every domain's TFDS splits are pooled, images resized
bilinearly to S x S (ignoring the aspect ratio, as Meta-Dataset does) with D
channels, and its classes split by fractions with a permutation from
`default_rng([split_seed, d])`, d its position in `DOMAINS`. Each class keeps
its first M images; classes with fewer are dropped.

Per split: uint8 [C, M, S, S, D], domain by domain, and the class count of
each domain, for `episodes.EpisodeSpec(task_classes='domain', domain_sizes=...)`.
"""

from __future__ import annotations

from typing import Sequence

from absl import logging
import numpy as np

from cht_jax.data import omniglot

DOMAINS = ('omniglot', 'caltech101', 'caltech_birds2011', 'cars196', 'oxford_flowers102',
           'stanford_dogs')
NUM_CLASSES = {'omniglot': 1623, 'caltech101': 102, 'caltech_birds2011': 200,
               'cars196': 196, 'oxford_flowers102': 102, 'stanford_dogs': 120}
# The TFDS splits holding each image once (omniglot's small1/small2 repeat background images).
TFDS_SPLITS = {'omniglot': ('train', 'test'), 'oxford_flowers102': ('train', 'validation', 'test')}
SPLITS = ('train', 'validation', 'test')


def split_sizes(num_classes: int, fractions: Sequence[float]) -> tuple[int, int, int]:
  """Classes of (train, validation, test): rounded fractions, test the rest."""
  n_train = int(round(fractions[0] * num_classes))
  n_val = int(round(fractions[1] * num_classes))
  return n_train, n_val, num_classes - n_train - n_val


def class_split(class_ids: Sequence[int], fractions: Sequence[float],
                split_seed: int, domain: int) -> dict[str, np.ndarray]:
  """Splits one domain's class ids by fractions, with its own seeded shuffle."""
  ids = np.random.default_rng([split_seed, domain]).permutation(np.asarray(class_ids, np.int64))
  n_train, n_val, _ = split_sizes(len(ids), fractions)
  return {'train': ids[:n_train], 'validation': ids[n_train:n_train + n_val],
          'test': ids[n_train + n_val:]}


def _prepare(name: str, data_dir: str | None, manual_dir: str | None):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  if name == 'omniglot':
    omniglot.prepare_omniglot(data_dir, manual_dir)
    return tfds.builder(name, data_dir=data_dir)
  builder = tfds.builder(name, data_dir=data_dir)
  if not builder.is_prepared():
    omniglot.download_and_prepare(
        builder, f'Could not prepare the TFDS dataset {name!r} in {builder.data_dir_root}',
        'Prepare it once on a machine with internet access (python -c "import '
        f'tensorflow_datasets as tfds; tfds.builder({name!r}).download_and_prepare()") '
        'and copy its folder into that data_dir, or leave it out of data.domains.')
  return builder


def read_domain(builder, image_size: int, channels: int,
                splits: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
  """All images of `splits`: uint8 [E, S, S, D] and int64 [E] labels."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def convert(example):
    image = example['image']
    if image.shape[-1] != channels:
      image = (tf.image.grayscale_to_rgb(image[..., :1]) if channels == 3
               else tf.image.rgb_to_grayscale(image[..., :3]))
    image = tf.image.resize(tf.cast(image, tf.float32), (image_size, image_size),
                            method='bilinear', antialias=True)
    image = tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)
    return image, example['label']

  images, labels = [], []
  for split in splits:
    ds = builder.as_dataset(split=split, shuffle_files=False)
    ds = ds.map(convert, num_parallel_calls=tf.data.AUTOTUNE).batch(512)
    for batch_images, batch_labels in ds.prefetch(tf.data.AUTOTUNE).as_numpy_iterator():
      images.append(batch_images)
      labels.append(batch_labels)
  if not images:
    return np.zeros((0, image_size, image_size, channels), np.uint8), np.zeros((0,), np.int64)
  return np.concatenate(images), np.concatenate(labels).astype(np.int64)


def load_multidomain(
    data_dir: str | None, manual_dir: str | None = None, domains: Sequence[str] = DOMAINS,
    fractions: Sequence[float] = (0.7, 0.15, 0.15), split_seed: int = 2022,
    image_size: int = 84, channels: int = 3, images_per_class: int = 20,
) -> tuple[dict[str, np.ndarray], dict[str, tuple[int, ...]]]:
  """({split: uint8 [C_split, M, S, S, D]}, {split: domain_sizes}) of `domains` (in this order),
  prepared with TFDS in `data_dir` if needed (Omniglot's archives: `manual_dir`), each domain's
  classes split by `fractions`; D 3 repeats gray, 1 makes RGB gray. A domain with no class in a
  split is left out of its domain_sizes. Raises DataError where a dataset cannot be read."""
  unknown = [d for d in domains if d not in DOMAINS]
  if unknown:
    raise ValueError(f'Unknown domains {unknown}; expected some of {DOMAINS}.')
  arrays, sizes = {s: [] for s in SPLITS}, {s: [] for s in SPLITS}
  for name in domains:
    builder = _prepare(name, data_dir, manual_dir)
    images, labels = read_domain(builder, image_size, channels,
                                 TFDS_SPLITS.get(name, ('train', 'test')))
    class_ids, class_images = omniglot.class_images_from_examples(
        images, labels, images_per_class, allow_incomplete_classes=True)
    rows = {int(c): i for i, c in enumerate(class_ids)}
    split = class_split(class_ids, fractions, split_seed, DOMAINS.index(name))
    for s in SPLITS:
      arrays[s].append(class_images[[rows[int(c)] for c in split[s]]])
      sizes[s].append(len(split[s]))
    logging.info('Domain %s: %d images, %d classes with >= %d images, split %s.', name,
                 len(labels), len(class_ids), images_per_class, [len(split[s]) for s in SPLITS])
  empty = (0, images_per_class, image_size, image_size, channels)
  out = {s: np.concatenate(arrays[s]) if arrays[s] else np.zeros(empty, np.uint8)
         for s in SPLITS}
  return out, {s: tuple(n for n in sizes[s] if n) for s in SPLITS}
