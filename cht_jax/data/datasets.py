"""The config's dataset: its loader, image shape, augmentation and pipeline.

'omniglot' (1 channel) and 'multidomain' (3, plus 'domain_sizes') keep every split in memory;
'tiered_imagenet' (3) too with data.pipeline='device' (the jitted step samples the episodes),
with 'host' its training split is read by a tf.data pipeline from disk (`pipeline.py`).
"""

from __future__ import annotations

from typing import Any, Iterator

import ml_collections
import numpy as np

from cht_jax.data import augment as augment_lib
from cht_jax.data import episodes as episodes_lib
from cht_jax.data import omniglot

DATASETS = ('omniglot', 'tiered_imagenet', 'multidomain')
PIPELINES = ('device', 'host')
CHANNELS = {'omniglot': 1, 'tiered_imagenet': 3, 'multidomain': 3}
HOST_PIPELINE_DATASETS = ('tiered_imagenet',)


def image_shape(config: ml_collections.ConfigDict) -> tuple[int, int, int]:
  size = config.data.image_size
  return (size, size, CHANNELS[config.data.dataset])


def augment_spec(config: ml_collections.ConfigDict) -> augment_lib.AugmentSpec:
  a = config.data.augment
  return augment_lib.AugmentSpec(flip=a.flip, hue=a.hue, brightness=a.brightness,
                                 contrast=a.contrast, crop_min_scale=a.crop_min_scale)


def episode_spec(config: ml_collections.ConfigDict,
                 domain_sizes: tuple[int, ...] = ()) -> episodes_lib.EpisodeSpec:
  ep = config.episode
  return episodes_lib.EpisodeSpec(
      num_tasks=ep.num_tasks, ways=ep.ways, shots=ep.shots,
      queries_per_class=ep.queries_per_class, task_classes=ep.task_classes,
      domain_sizes=tuple(domain_sizes),
      # .get: absent from the config.json of older runs.
      unlabeled_per_class=ep.get('unlabeled_per_class', 0),
      independent_draws=ep.get('independent_draws', False))


def _tiered_builder(config):
  from cht_jax.data import tiered_imagenet  # pylint: disable=g-import-not-at-top
  data = config.data
  return tiered_imagenet.prepare(data.data_dir or None, data.manual_dir or None,
                                 tiered_imagenet.SPLIT_CLASSES if data.check_class_counts else None)


def load_dataset(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """{split: uint8 [C, M, S, S, D]} for the splits kept in memory (no 'train' with
  data.pipeline='host'); 'multidomain' adds 'domain_sizes': split -> its domains' classes."""
  data = config.data
  if data.dataset == 'omniglot':
    return omniglot.load_omniglot(
        data_dir=data.data_dir or None, manual_dir=data.manual_dir or None,
        split_scheme=data.split_scheme, split_seed=data.split_seed,
        image_size=data.image_size, binarize=data.get('binarize', False))
  if data.dataset == 'multidomain':
    from cht_jax.data import multidomain  # pylint: disable=g-import-not-at-top
    arrays, sizes = multidomain.load_multidomain(
        data.data_dir or None, data.manual_dir or None, tuple(data.domains),
        tuple(data.domain_split), data.split_seed, data.image_size,
        CHANNELS['multidomain'], data.images_per_class)
    return {**arrays, 'domain_sizes': sizes}
  from cht_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  builder = _tiered_builder(config)
  splits = ('validation', 'test') if data.pipeline == 'host' else ('train', 'validation', 'test')
  out = {}
  for split in splits:
    source, labels = pipeline.tfds_source(builder, split)
    index = pipeline.class_index(labels, min_images=data.images_per_class)
    out[split] = pipeline.class_images(source, index, data.images_per_class,
                                       data.image_size, CHANNELS['tiered_imagenet'])
  return out


def host_batches(config: ml_collections.ConfigDict,
                 first_step: int) -> Iterator[dict[str, np.ndarray]]:
  """Training batches of steps first_step, first_step + 1, ...: `episodes.sample_episodes`'s
  dict (uint8 images) of this process's share of the step, a function of (seed, step, process)."""
  import jax  # pylint: disable=g-import-not-at-top
  from cht_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  if config.data.dataset not in HOST_PIPELINE_DATASETS:
    raise ValueError(
        f'data.pipeline=host supports {HOST_PIPELINE_DATASETS}, not {config.data.dataset!r}.')
  spec = episode_spec(config)
  source, labels = pipeline.tfds_source(_tiered_builder(config), 'train')
  index = pipeline.class_index(labels, min_images=episodes_lib.images_per_task(spec))
  return pipeline.episode_batches(
      source, index, spec, config.train.episodes_per_step // jax.process_count(), config.seed,
      first_step, config.data.image_size, CHANNELS[config.data.dataset], normalize=False,
      process=jax.process_index())
