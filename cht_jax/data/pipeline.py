"""A host input pipeline of episode batches for datasets too large for memory.

The images stay encoded on disk (TFDS's ArrayRecord data source). `episode_indices` draws
step s's records with NumPy from `default_rng([seed, s, process])` (a resumed run sees the same
data) by the device sampler's rules, not its random numbers; tf.data fetches, decodes and
assembles them in a deterministic order. `episode_batches` yields `episodes.sample_episodes`'s
dict, with uint8 images (4x smaller copies) that `device_episodes` normalizes on device.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, NamedTuple, Sequence

from absl import logging
import numpy as np

from cht_jax.data import episodes as episodes_lib
from cht_jax.data.omniglot import DataError

_CACHE_DIRNAME = 'cht_jax_cache'


class ClassIndex(NamedTuple):
  """Where each class's images are: class_ids int64 [C] (labels), records: C index arrays."""
  class_ids: np.ndarray
  records: list[np.ndarray]

  @property
  def min_images(self) -> int:
    return min(len(r) for r in self.records) if self.records else 0


def class_index(labels: np.ndarray, classes: Sequence[int] | None = None,
                min_images: int = 1) -> ClassIndex:
  """Record indices grouped by label [E], of `classes` in this order (default: all, ascending),
  without those of fewer than `min_images` records."""
  labels = np.asarray(labels, np.int64)
  order = np.argsort(labels, kind='stable')
  ids, starts, counts = np.unique(labels[order], return_index=True, return_counts=True)
  by_id = {int(i): order[s:s + c] for i, s, c in zip(ids, starts, counts)}
  wanted = ids if classes is None else np.asarray(classes, np.int64)
  kept = [int(c) for c in wanted if len(by_id.get(int(c), ())) >= min_images]
  if len(kept) < len(wanted):
    logging.warning('Dropping %d of %d classes with fewer than %d images.',
                    len(wanted) - len(kept), len(wanted), min_images)
  return ClassIndex(np.asarray(kept, np.int64), [by_id[c] for c in kept])


class EncodedSource:
  """Random access to encoded images by record index: a sequence of image bytes, of dicts with
  them under 'image', or with `example_key` of serialized `tf.train.Example`s."""

  def __init__(self, records: Sequence[Any], example_key: str | None = None):
    self._records = records
    self.example_key = example_key

  def __len__(self) -> int:
    return len(self._records)

  def get(self, indices: np.ndarray) -> list[bytes]:
    indices = [int(i) for i in np.ravel(indices)]
    getitems = getattr(self._records, '__getitems__', None)
    items = getitems(indices) if getitems else [self._records[i] for i in indices]
    return [item['image'] if isinstance(item, dict) else item for item in items]

  def parse(self, records):
    """tf.string [E] records -> tf.string [E] encoded images (in a tf graph)."""
    if self.example_key is None:
      return records
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return tf.io.parse_example(
        records, {self.example_key: tf.io.FixedLenFeature([], tf.string)}
    )[self.example_key]


def tfds_source(builder, split: str) -> tuple[EncodedSource, np.ndarray]:
  """(source, labels int64 [E]) of a split prepared as ArrayRecord; the labels are cached in
  `<data_dir>/cht_jax_cache/<name>_<version>_<split>_labels.npy`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  try:
    records = builder.as_data_source(
        split=split, deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES)
  except NotImplementedError as e:
    raise DataError(
        f'{builder.name} in {builder.data_dir} is not stored as ArrayRecord, '
        'which the host pipeline (data.pipeline=host) needs for random '
        'access. Prepare it again into an empty data_dir, or use '
        f'data.pipeline=device. ({str(e).splitlines()[0]})') from None
  cache = os.path.join(os.fspath(builder.data_dir_root), _CACHE_DIRNAME,
                       f'{builder.name}_{builder.version}_{split}_labels.npy')
  labels = None
  if os.path.exists(cache):
    labels = np.load(cache)
    if len(labels) != len(records):
      labels = None
  if labels is None:  # One pass over the records, images left encoded.
    chunk, parts = 4096, [np.zeros((0,), np.int64)]
    for start in range(0, len(records), chunk):
      raw = records.__getitems__(list(range(start, min(start + chunk, len(records)))))
      parts.append(tf.io.parse_example(
          tf.constant(np.asarray(raw, object)),
          {'label': tf.io.FixedLenFeature([], tf.int64)})['label'].numpy())
    labels = np.concatenate(parts).astype(np.int64)
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    np.save(cache, labels)
  return EncodedSource(records, example_key='image'), labels


def _draw_classes(rng: np.random.Generator, num_classes: int,
                  spec: episodes_lib.EpisodeSpec) -> np.ndarray:
  """Class rows int64 [T, K] of one episode."""
  t, k = spec.num_tasks, spec.ways
  if spec.task_classes == 'disjoint':
    return rng.choice(num_classes, t * k, replace=False).reshape(t, k)
  if spec.task_classes == 'same':
    return np.tile(rng.choice(num_classes, k, replace=False)[None], (t, 1))
  offsets = episodes_lib.domain_offsets(spec.domain_sizes)
  domains = rng.choice(len(spec.domain_sizes), t, replace=False)
  return np.stack([offsets[d] + rng.choice(spec.domain_sizes[d], k, replace=False)
                   for d in domains])


def episode_indices(seed: int, step: int, index: ClassIndex,
                    spec: episodes_lib.EpisodeSpec, num_episodes: int,
                    process: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """(records int64 [B, T, K, N+Q+U]: support, queries, unlabeled, drawn as
  `episodes._draw_images`; class rows int32 [B, T, K]) of a step, from (seed, step, process)."""
  rng = np.random.default_rng([seed, step, process])
  per_class = episodes_lib.images_per_task(spec)
  classes = np.stack([_draw_classes(rng, len(index.records), spec) for _ in range(num_episodes)])
  records = np.empty(classes.shape + (per_class,), np.int64)
  if spec.independent_draws:  # The original HT's draws: one choice per batch.
    n, q = spec.shots, spec.queries_per_class
    for pos in np.ndindex(classes.shape):
      pool = index.records[classes[pos]]
      support = rng.choice(len(pool), n + spec.unlabeled_per_class, replace=False)
      queries = rng.choice(len(pool), q, replace=False)
      records[pos] = pool[np.concatenate([support[:n], queries, support[n:]])]
    return records, classes.astype(np.int32)
  if spec.task_classes == 'same':  # No image in two tasks (episodes.images_per_class_needed).
    for b, k in np.ndindex(num_episodes, spec.ways):
      pool = index.records[classes[b, 0, k]]
      chosen = rng.choice(len(pool), spec.num_tasks * per_class, replace=False)
      records[b, :, k] = pool[chosen].reshape(spec.num_tasks, per_class)
    return records, classes.astype(np.int32)
  for pos in np.ndindex(classes.shape):
    pool = index.records[classes[pos]]
    records[pos] = pool[rng.choice(len(pool), per_class, replace=False)]
  return records, classes.astype(np.int32)


def check_spec(spec: episodes_lib.EpisodeSpec, index: ClassIndex) -> None:
  """Raises ValueError if `spec` cannot be drawn from `index` (the device sampler's checks)."""
  episodes_lib.validate_spec(spec, (len(index.records), index.min_images, 1, 1, 1))


def _labels(spec: episodes_lib.EpisodeSpec, per_class: int, num_episodes: int) -> np.ndarray:
  labels = np.repeat(np.arange(spec.ways, dtype=np.int32), per_class)
  return np.tile(labels, (num_episodes, spec.num_tasks, 1))


def episode_dataset(source: EncodedSource, index: ClassIndex, spec: episodes_lib.EpisodeSpec,
                    num_episodes: int, seed: int, first_step: int, image_size: int,
                    channels: int, normalize: bool = True, num_steps: int | None = None,
                    process: int = 0):
  """A tf.data.Dataset of `episodes.sample_episodes` batches of B = `num_episodes`, element i
  for step first_step + i (`num_steps` None: endless); images resized (bilinear) to
  `image_size`, uint8 unless `normalize`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  check_spec(spec, index)
  b, t, k = num_episodes, spec.num_tasks, spec.ways
  n, q, u = spec.shots, spec.queries_per_class, spec.unlabeled_per_class
  shape = (image_size, image_size, channels)

  def fetch(step):
    records, classes = episode_indices(seed, int(step), index, spec, b, process)
    return np.asarray(source.get(records), dtype=object), classes

  def decode_one(encoded):
    image = tf.io.decode_image(encoded, channels=channels, expand_animations=False)
    if image_size:
      resized = tf.image.resize(tf.cast(image, tf.float32),
                                (image_size, image_size), method='bilinear')
      resized = tf.cast(tf.clip_by_value(tf.round(resized), 0, 255), tf.uint8)
      same = tf.reduce_all(tf.shape(image)[:2] == image_size)
      image = tf.cond(same, lambda: image, lambda: resized)
    return tf.ensure_shape(image, shape)

  def assemble(encoded, classes):
    encoded = source.parse(encoded)
    images = tf.map_fn(decode_one, encoded, parallel_iterations=16,
                       fn_output_signature=tf.TensorSpec(shape, tf.uint8))
    images = tf.reshape(images, (b, t, k, n + q + u) + shape)
    if normalize:
      images = tf.cast(images, tf.float32) / 128.0 - 1.0
    episode = {
        'support_images': tf.reshape(images[:, :, :, :n], (b, t, k * n) + shape),
        'support_labels': tf.constant(_labels(spec, n, b)),
        'query_images': tf.reshape(images[:, :, :, n:n + q], (b, t, k * q) + shape),
        'query_labels': tf.constant(_labels(spec, q, b)),
        'class_ids': tf.ensure_shape(classes, (b, t, k)),
    }
    if u:
      episode['unlabeled_images'] = tf.reshape(images[:, :, :, n + q:], (b, t, k * u) + shape)
    return episode

  end = first_step + num_steps if num_steps is not None else np.iinfo(np.int64).max
  ds = tf.data.Dataset.range(first_step, end)
  ds = ds.map(lambda s: tf.numpy_function(fetch, [s], (tf.string, tf.int32),
                                          stateful=False),
              num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  ds = ds.map(assemble, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  options = tf.data.Options()
  options.deterministic = True
  options.autotune.enabled = True
  return ds.with_options(options).prefetch(tf.data.AUTOTUNE)


def episode_batches(*args, **kwargs) -> Iterator[dict[str, np.ndarray]]:
  """`episode_dataset(...)` as an iterator of NumPy dicts."""
  return episode_dataset(*args, **kwargs).as_numpy_iterator()


def device_episodes(batch: dict[str, Any]) -> dict[str, Any]:
  """Inside the step: a uint8 host batch as `sample_episodes` returns it."""
  out = dict(batch)
  for name in ('support_images', 'query_images', 'unlabeled_images'):
    if name in out and out[name].dtype == np.uint8:
      out[name] = episodes_lib.normalize(out[name])
  return out


def class_images(source: EncodedSource, index: ClassIndex, images_per_class: int,
                 image_size: int, channels: int) -> np.ndarray:
  """uint8 [C, M, S, S, D]: the first M images of each class of `index` (for the device path)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  if index.min_images < images_per_class:
    raise ValueError(f'A class has only {index.min_images} images, fewer '
                     f'than images_per_class={images_per_class}.')
  records = np.stack([r[:images_per_class] for r in index.records])
  shape = (image_size, image_size, channels)
  out = np.empty(records.shape + shape, np.uint8)
  if not records.size:
    return out
  flat = records.reshape(-1)

  def decode(encoded):
    image = tf.io.decode_image(encoded, channels=channels, expand_animations=False)
    image = tf.image.resize(tf.cast(image, tf.float32), shape[:2])
    return tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)

  chunk = 2048
  ds = tf.data.Dataset.range(0, len(flat), chunk).map(
      lambda start: tf.numpy_function(
          lambda s: np.asarray(source.get(flat[s:s + chunk]), object),
          [start], tf.string, stateful=False),
      num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  ds = ds.map(source.parse).unbatch().map(
      decode, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).batch(chunk)
  view = out.reshape((-1,) + shape)
  start = 0
  for batch in ds.as_numpy_iterator():
    view[start:start + len(batch)] = batch
    start += len(batch)
  return out
