"""Datasets beyond Omniglot: augmentation, the 'domain' sampler, tieredImageNet,
the host pipeline and multi-domain loading, on generated files and mock data."""

import io
import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from cht_jax import config_validation
from cht_jax import evaluate
from cht_jax import train
from cht_jax.data import augment
from cht_jax.data import datasets
from cht_jax.data import episodes
from cht_jax.data import multidomain
from cht_jax.data import pipeline
from cht_jax.data import tiered_imagenet
from cht_jax.data.omniglot import DataError
from conftest import override

MAX_X = 255 / 128 - 1  # The largest normalized value.

# --------------------------------------------------------------------------
# Augmentation.
# --------------------------------------------------------------------------


def _images(shape=(6, 12, 12, 3), low=60, high=200, seed=0):
  """Normalized images away from 0 and 255 (no clipping by small changes)."""
  pixels = np.random.default_rng(seed).integers(low, high, shape, dtype=np.uint8)
  return episodes.normalize(jnp.asarray(pixels))


_augment = jax.jit(augment.augment, static_argnums=2)


def test_zero_strength_is_the_identity():
  x = _images()
  assert augment.AugmentSpec().is_identity
  assert augment.augment(jax.random.key(0), x, augment.AugmentSpec()) is x
  ep = {'support_images': x, 'query_images': x, 'support_labels': 1}
  assert augment.augment_episodes(jax.random.key(0), ep, augment.AugmentSpec()) is ep
  # A crop of the whole image resizes nothing.
  np.testing.assert_allclose(augment._crop(x[0], jnp.float32(1.0), jnp.zeros(2)), x[0],
                             atol=1e-6)


def test_all_augmentations_shapes_ranges_and_determinism():
  spec = augment.AugmentSpec(flip=True, hue=0.5, brightness=1.0, contrast=1.0,
                             crop_min_scale=0.3)
  x = _images((2, 3, 10, 10, 3), low=0, high=256)
  y = _augment(jax.random.key(1), x, spec)
  assert y.shape == x.shape and y.dtype == jnp.float32
  assert float(y.min()) >= -1.0 and float(y.max()) <= MAX_X + 1e-6
  np.testing.assert_array_equal(y, _augment(jax.random.key(1), x, spec))
  assert not np.array_equal(y, _augment(jax.random.key(2), x, spec))


def test_flip_is_a_mirror_image_or_nothing():
  x = _images((16, 8, 8, 1))
  y = np.asarray(_augment(jax.random.key(0), x, augment.AugmentSpec(flip=True)))
  flipped = [np.array_equal(b, np.asarray(a)[:, ::-1]) for a, b in zip(x, y)]
  kept = [np.array_equal(b, a) for a, b in zip(x, y)]
  assert all(f or k for f, k in zip(flipped, kept)) and any(flipped) and any(kept)


def test_brightness_shifts_each_image_uniformly_within_range():
  x = _images((16, 8, 8, 3))
  y = _augment(jax.random.key(0), x, augment.AugmentSpec(brightness=0.1))
  shift = np.asarray(y - x).reshape(16, -1)
  np.testing.assert_allclose(shift, shift[:, :1] * np.ones_like(shift), atol=1e-5)
  assert np.abs(shift).max() <= 0.2 + 1e-5  # 0.1 on [0, 1) is 0.2 normalized.
  assert np.abs(shift).max() > 0.02


def test_contrast_keeps_the_channel_means_and_scales_deviations():
  x = _images((8, 8, 8, 3), low=100, high=156)
  y = _augment(jax.random.key(0), x, augment.AugmentSpec(contrast=0.5))
  np.testing.assert_allclose(y.mean((1, 2)), x.mean((1, 2)), atol=1e-5)
  dx = x - x.mean((1, 2), keepdims=True)
  dy = y - y.mean((1, 2), keepdims=True)
  factor = np.asarray((dy * dx).sum((1, 2, 3)) / (dx * dx).sum((1, 2, 3)))
  assert np.all(factor >= 0.5 - 1e-4) and np.all(factor <= 1.5 + 1e-4)


def test_hue_keeps_luma_and_gray_images():
  x = _images((8, 8, 8, 3), low=100, high=156)
  y = _augment(jax.random.key(0), x, augment.AugmentSpec(hue=0.3))
  luma = lambda im: np.asarray(im) @ np.array([0.299, 0.587, 0.114])
  np.testing.assert_allclose(luma(y), luma(x), atol=1e-4)
  assert np.abs(np.asarray(y - x)).max() > 0.01
  gray = _images((4, 8, 8, 1))  # Hue does not apply to one channel.
  np.testing.assert_array_equal(
      _augment(jax.random.key(0), gray, augment.AugmentSpec(hue=0.3)), gray)


def test_crop_and_resize_keeps_flat_images_and_zooms():
  flat = jnp.full((4, 12, 12, 3), 0.25)
  y = _augment(jax.random.key(0), flat, augment.AugmentSpec(crop_min_scale=0.5))
  np.testing.assert_allclose(y, flat, atol=1e-6)
  ramp = jnp.broadcast_to(jnp.linspace(-1, 0.9, 12)[None, :, None, None], (1, 12, 12, 1))
  zoomed = augment._crop(ramp[0], jnp.float32(0.5), jnp.zeros(2))  # Top-left quarter.
  assert float(zoomed.max()) < 0.0 and float(zoomed.min()) == pytest.approx(-1.0)


# --------------------------------------------------------------------------
# The 'domain' sampler: class row c holds value c everywhere.
# --------------------------------------------------------------------------

DOMAIN_SIZES = (4, 6, 3, 5)


def _valued_class_images(num_classes, num_images=6, size=4):
  values = np.arange(num_classes, dtype=np.uint8)[:, None, None, None, None]
  return np.broadcast_to(values, (num_classes, num_images, size, size, 1)).copy()


def _domain_batch(num_tasks, seed, batch_size):
  """A batch of 3-way domain episodes over DOMAIN_SIZES, and each class's domain [B, T, K]."""
  spec = episodes.EpisodeSpec(num_tasks=num_tasks, ways=3, shots=1, queries_per_class=2,
                              task_classes='domain', domain_sizes=DOMAIN_SIZES)
  images = jnp.asarray(_valued_class_images(sum(DOMAIN_SIZES)))
  batch = jax.jit(episodes.sample_episodes, static_argnums=(2, 3, 4))(
      jax.random.key(seed), images, spec, batch_size, False)
  offsets = episodes.domain_offsets(DOMAIN_SIZES)
  domains = np.searchsorted(offsets, np.asarray(batch['class_ids']), side='right') - 1
  return batch, domains


def test_domain_sampler_one_distinct_domain_per_task():
  batch, domains = _domain_batch(num_tasks=3, seed=0, batch_size=16)
  assert batch['support_images'].shape == (16, 3, 3, 4, 4, 1)
  assert batch['query_images'].shape == (16, 3, 6, 4, 4, 1)
  assert (domains == domains[..., :1]).all()  # One domain per task.
  for ep in domains[..., 0]:
    assert len(set(ep)) == 3  # Distinct domains in an episode.


def test_domain_sampler_classes_and_images_match():
  batch, domains = _domain_batch(num_tasks=2, seed=3, batch_size=32)
  class_ids = np.asarray(batch['class_ids'])
  assert set(domains.ravel()) == {0, 1, 2, 3}  # Every domain is drawn.
  for ep in class_ids.reshape(-1, 3):
    assert len(set(ep)) == 3
  support = np.round((np.asarray(batch['support_images'])[..., 0, 0, 0] + 1) * 128)
  np.testing.assert_array_equal(support, class_ids)  # [B, T, K*1] == [B, T, K].


@pytest.mark.parametrize('sizes, tasks, ways, match', [
    ((), 2, 2, 'needs domain_sizes'),
    ((4, 6), 3, 2, 'only 2 domains'),
    ((8, 2), 2, 3, 'domain 1 has only 2'),
    ((4, 5), 2, 2, 'add up to 9'),
])
def test_domain_spec_validation(sizes, tasks, ways, match):
  spec = episodes.EpisodeSpec(tasks, ways, 1, 1, 'domain', sizes)
  with pytest.raises(ValueError, match=match):
    episodes.validate_spec(spec, (10, 6, 4, 4, 1))


# --------------------------------------------------------------------------
# tieredImageNet from generated files. Class c of split s, image m: R = 20 c +
# 10, G = 10 m, B = 50 * split number.
# --------------------------------------------------------------------------

TINY_CLASSES = {'train': 4, 'validation': 3, 'test': 3}
TINY_IMAGES = 6
SPLIT_NUMBER = {'train': 0, 'validation': 1, 'test': 2}


def _pixel(split, c, m):
  return (20 * c + 10, 10 * m, 50 * SPLIT_NUMBER[split])


def _png(rgb, size=84):
  buf = io.BytesIO()
  Image.fromarray(np.full((size, size, 3), rgb, np.uint8)).save(buf, format='PNG')
  return buf.getvalue()


def write_pickled_release(folder, classes=TINY_CLASSES, images=TINY_IMAGES, raw_ids=True):
  """The layout of Ren et al.'s release: uint8 arrays of PNG bytes, latin1-era pickles."""
  os.makedirs(folder, exist_ok=True)
  for split, count in classes.items():
    name = tiered_imagenet.FILE_SPLITS[split]
    pngs, labels = [], []
    for m in range(images):  # Image-major, as a shuffled release would not be class-sorted.
      for c in range(count):
        pngs.append(np.frombuffer(_png(_pixel(split, c, m)), np.uint8))
        labels.append(100 + 7 * c if raw_ids else c)
    with open(os.path.join(folder, f'{name}_images_png.pkl'), 'wb') as f:
      pickle.dump(pngs, f, protocol=2)
    with open(os.path.join(folder, f'{name}_labels.pkl'), 'wb') as f:
      pickle.dump({'label_specific': np.asarray(labels),
                   'label_specific_str': [f'n{i:08d}' for i in range(200)],
                   'label_general': np.zeros(len(labels), np.int64)}, f, protocol=2)
  return folder


def write_folder_layout(folder, classes=TINY_CLASSES, images=TINY_IMAGES):
  for split, count in classes.items():
    for c in range(count):
      path = os.path.join(folder, tiered_imagenet.FILE_SPLITS[split], f'n{c:08d}')
      os.makedirs(path)
      for m in range(images):  # Non-84x84 JPEG-like sources: PNG keeps values exact.
        with open(os.path.join(path, f'img_{m}.png'), 'wb') as f:
          f.write(_png(_pixel(split, c, m), size=42))
  return folder


@pytest.fixture(scope='module')
def tiered_builder(tmp_path_factory):
  root = tmp_path_factory.mktemp('tiered')
  manual = write_pickled_release(str(root / 'manual'))
  return tiered_imagenet.prepare(str(root / 'tfds'), manual, expected_classes=TINY_CLASSES)


def _class_of(image):
  """(class, image index) of a decoded uint8 [84, 84, 3] image."""
  r, g, _ = (int(v) for v in image[0, 0])
  return (r - 10) // 20, g // 10


def test_builder_from_the_pickled_release(tiered_builder):
  info = tiered_builder.info
  assert {s: info.splits[s].num_examples for s in TINY_CLASSES} == {
      s: c * TINY_IMAGES for s, c in TINY_CLASSES.items()}
  source = tiered_builder.as_data_source(split='validation')
  seen = set()
  for example in source:
    assert example['image'].shape == (84, 84, 3)
    c, m = _class_of(example['image'])
    assert example['label'] == c and example['class_name'] == f'n{100 + 7 * c:08d}'.encode()
    assert example['image'][0, 0, 2] == 50
    seen.add((c, m))
  assert len(seen) == 3 * TINY_IMAGES


def test_builder_from_a_folder_layout(tmp_path):
  manual = write_folder_layout(str(tmp_path / 'manual'))
  builder = tiered_imagenet.prepare(str(tmp_path / 'tfds'), manual, expected_classes=None)
  source = builder.as_data_source(split='train')
  assert len(source) == 4 * TINY_IMAGES
  for example in source:
    assert example['image'].shape == (84, 84, 3)  # Resized from 42x42.
    c, _ = _class_of(example['image'])
    assert example['label'] == c and example['class_name'] == f'n{c:08d}'.encode()


def test_missing_files_say_what_to_download_and_where(tmp_path):
  manual = tmp_path / 'nothing_here'
  manual.mkdir()
  with pytest.raises(DataError) as error:
    tiered_imagenet.prepare(str(tmp_path / 'tfds'), str(manual))
  message = str(error.value)
  for needed in ('train_images_png.pkl', 'val_labels.pkl', 'test_images_png.pkl',
                 str(manual), 'tiered-imagenet.tar', 'data.manual_dir', 'ImageNet'):
    assert needed in message, needed
  with pytest.raises(DataError, match='tfds/downloads/manual/tiered_imagenet does not exist'):
    tiered_imagenet.prepare(str(tmp_path / 'tfds'), None)


def test_wrong_class_counts_are_named(tmp_path):
  manual = write_pickled_release(str(tmp_path / 'manual'))
  with pytest.raises(DataError) as error:
    tiered_imagenet.prepare(str(tmp_path / 'tfds'), manual)  # Standard counts expected.
  message = str(error.value)
  assert "'train': 4" in message and "'train': 351" in message and "'test': 160" in message


def test_split_sizes_constant():
  assert tiered_imagenet.SPLIT_CLASSES == {'train': 351, 'validation': 97, 'test': 160}
  assert sum(tiered_imagenet.SPLIT_CLASSES.values()) == 608


# --------------------------------------------------------------------------
# The host pipeline.
# --------------------------------------------------------------------------

SPEC = episodes.EpisodeSpec(num_tasks=2, ways=2, shots=2, queries_per_class=3)


@pytest.fixture(scope='module')
def train_source(tiered_builder):
  source, labels = pipeline.tfds_source(tiered_builder, 'train')
  return source, pipeline.class_index(labels)


def _decode(batch):
  """uint8 pixels back from normalized images."""
  return np.round((batch + 1.0) * 128).astype(np.int64)


def _batches(train_source, seed=0, first_step=1, num_steps=3, **kwargs):
  source, index = train_source
  return list(pipeline.episode_batches(source, index, SPEC, 3, seed, first_step, 84, 3,
                                       num_steps=num_steps, **kwargs))


def test_host_pipeline_matches_the_device_sampler_structure(train_source):
  source, index = train_source
  host = _batches(train_source, num_steps=1)[0]
  memory = pipeline.class_images(source, index, TINY_IMAGES, 84, 3)
  device = episodes.sample_episodes(jax.random.key(0), jnp.asarray(memory), SPEC, 3, False)
  assert set(host) == set(device)
  for name in device:
    assert host[name].shape == device[name].shape, name
    assert host[name].dtype == device[name].dtype, name
  for name in ('support_labels', 'query_labels'):
    np.testing.assert_array_equal(host[name], device[name])
  # Every image is of its class, N + Q distinct images per class, classes disjoint.
  pixels = {n: _decode(host[f'{n}_images'])[..., 0, 0, :] for n in ('support', 'query')}
  class_ids = host['class_ids']
  for b in range(3):
    assert len(set(class_ids[b].ravel())) == SPEC.num_tasks * SPEC.ways
    for t in range(SPEC.num_tasks):
      for k in range(SPEC.ways):
        rows = np.concatenate([pixels['support'][b, t, k * 2:(k + 1) * 2],
                               pixels['query'][b, t, k * 3:(k + 1) * 3]])
        assert set((rows[:, 0] - 10) // 20) == {index.class_ids[class_ids[b, t, k]]}
        assert len(set(rows[:, 1])) == 5
  # Images in memory: class row c holds the first M images of label c.
  assert [_class_of(memory[c, 0])[0] for c in range(4)] == list(index.class_ids)


def test_host_pipeline_is_a_function_of_seed_and_step(train_source):
  first = _batches(train_source, seed=0, first_step=1, num_steps=3)
  again = _batches(train_source, seed=0, first_step=1, num_steps=3)
  resumed = _batches(train_source, seed=0, first_step=2, num_steps=2)  # Steps 2, 3.
  other = _batches(train_source, seed=1, first_step=1, num_steps=3)
  for a, b in zip(first, again):
    for name in a:
      np.testing.assert_array_equal(a[name], b[name])
  for a, b in zip(first[1:], resumed):
    np.testing.assert_array_equal(a['query_images'], b['query_images'])
  assert not np.array_equal(first[0]['class_ids'], first[1]['class_ids'])
  assert any(not np.array_equal(a['support_images'], b['support_images'])
             for a, b in zip(first, other))


def test_host_pipeline_uint8_resize_and_same_classes(train_source):
  source, index = train_source
  spec = SPEC._replace(task_classes='same', queries_per_class=1)  # 2 * (2 + 1) = 6 images.
  records, _ = pipeline.episode_indices(0, 5, index, spec, 2)  # [B, T, K, N+Q]
  for b in range(2):
    for k in range(spec.ways):  # No image in two tasks, as on the device path.
      assert len(set(records[b, :, k].ravel())) == spec.num_tasks * 3
  batch = next(pipeline.episode_batches(source, index, spec, 2, 0, 5, 16, 3,
                                        normalize=False))
  assert batch['support_images'].dtype == np.uint8
  assert batch['support_images'].shape == (2, 2, 4, 16, 16, 3)
  np.testing.assert_array_equal(batch['class_ids'][:, 0], batch['class_ids'][:, 1])
  c = index.class_ids[batch['class_ids'][0, 0, 0]]
  assert batch['support_images'][0, 0, 0, 5, 5, 0] == 20 * c + 10
  normalized = pipeline.device_episodes(batch)
  np.testing.assert_allclose(normalized['support_images'],
                             episodes.normalize(batch['support_images']))


def test_host_pipeline_domain_indices():
  index = pipeline.class_index(np.repeat(np.arange(sum(DOMAIN_SIZES)), 5))
  spec = episodes.EpisodeSpec(3, 3, 1, 1, 'domain', DOMAIN_SIZES)
  records, classes = pipeline.episode_indices(0, 7, index, spec, 16)
  assert records.shape == (16, 3, 3, 2) and classes.shape == (16, 3, 3)
  domains = np.searchsorted(episodes.domain_offsets(DOMAIN_SIZES), classes, side='right') - 1
  assert (domains == domains[..., :1]).all()
  assert all(len(set(d)) == 3 for d in domains[..., 0])
  assert (records // 5 == classes[..., None]).all()  # Records of the class.


def test_host_pipeline_rejects_impossible_specs(train_source):
  source, index = train_source
  with pytest.raises(ValueError, match='6 distinct classes per episode'):
    pipeline.episode_dataset(source, index, SPEC._replace(ways=3), 1, 0, 1, 84, 3)
  with pytest.raises(ValueError, match='= 7 images per class, but'):
    pipeline.episode_dataset(source, index, SPEC._replace(queries_per_class=5), 1, 0, 1, 84, 3)


# --------------------------------------------------------------------------
# Multi-domain under tfds.testing.mock_data: each dataset gets MOCK_CLASSES
# classes of MOCK_IMAGES images per TFDS split, pixel value 10 * label + domain.
# --------------------------------------------------------------------------

MOCK_CLASSES, MOCK_IMAGES = 12, 3


def _fake_as_dataset(self, split, **kwargs):
  del kwargs
  domain = multidomain.DOMAINS.index(self.name)
  labels = np.repeat(np.arange(MOCK_CLASSES), MOCK_IMAGES).astype(np.int64)
  # Non-square images of a size per domain, as the real datasets have.
  shape = (30, 20 + 5 * domain, 3)
  images = (10 * labels + domain).astype(np.uint8)[:, None, None, None] * np.ones(shape, np.uint8)
  return tf.data.Dataset.from_tensor_slices({'image': images, 'label': labels})


def test_multidomain_under_mock_data(tmp_path):
  domains = ('caltech101', 'cars196', 'omniglot')
  with tfds.testing.mock_data(as_dataset_fn=_fake_as_dataset, data_dir=str(tmp_path)):
    arrays, sizes = multidomain.load_multidomain(
        str(tmp_path), None, domains, (0.5, 0.25, 0.25), 7, image_size=8, channels=3,
        images_per_class=4)
  # Omniglot reads 2 TFDS splits (train, test), the others 2 too: 6 images per class.
  assert sizes == {'train': (6, 6, 6), 'validation': (3, 3, 3), 'test': (3, 3, 3)}
  for split, n in (('train', 18), ('validation', 9), ('test', 9)):
    assert arrays[split].shape == (n, 4, 8, 8, 3) and arrays[split].dtype == np.uint8
  # Rows are grouped by domain; each domain's classes split with its own seed, disjointly.
  seen = {}
  for split in multidomain.SPLITS:
    values = arrays[split][:, :, 4, 4, 0].astype(int)
    assert (values == values[:, :1]).all()
    offsets = episodes.domain_offsets(sizes[split])
    for d, name in enumerate(domains):
      rows = values[offsets[d]:offsets[d + 1], 0]
      assert set(rows % 10) == {multidomain.DOMAINS.index(name)}
      seen.setdefault(name, []).extend(rows // 10)
  for name in domains:
    assert sorted(seen[name]) == list(range(MOCK_CLASSES))
  expected = multidomain.class_split(np.arange(MOCK_CLASSES), (0.5, 0.25, 0.25), 7,
                                     multidomain.DOMAINS.index('cars196'))
  assert list(arrays['train'][6:12, 0, 0, 0, 0] // 10) == list(expected['train'])
  assert not np.array_equal(expected['train'], multidomain.class_split(
      np.arange(MOCK_CLASSES), (0.5, 0.25, 0.25), 7, 1)['train'])


def test_multidomain_split_sizes_of_the_real_datasets():
  total = {s: 0 for s in multidomain.SPLITS}
  for name in multidomain.DOMAINS:
    counts = multidomain.split_sizes(multidomain.NUM_CLASSES[name], (0.7, 0.15, 0.15))
    assert sum(counts) == multidomain.NUM_CLASSES[name]
    for s, n in zip(multidomain.SPLITS, counts):
      total[s] += n
  assert sum(total.values()) == 2343


# --------------------------------------------------------------------------
# Configs and training through the new paths.
# --------------------------------------------------------------------------


@pytest.mark.parametrize('module', ['tiered_imagenet_t2', 'tiered_imagenet_t3',
                                    'tiered_imagenet_t4', 'tiered_imagenet_t5',
                                    'multidomain_t2'])
@pytest.mark.parametrize('variant', ['', 'tiny'])
def test_shipped_configs_are_valid(module, variant):
  import importlib  # pylint: disable=g-import-not-at-top
  config = importlib.import_module(f'configs.{module}').get_config(variant)
  assert config_validation.validate(config, num_devices=1) is config
  assert datasets.image_shape(config)[-1] == 3


@pytest.mark.parametrize('arm', ['all_at_once', 'two_plus_two', 'one_at_a_time', 'ht_one',
                                 'ht_two'])
def test_tiered_minibatch_arms_are_valid(arm):
  from configs import tiered_imagenet_minibatch  # pylint: disable=g-import-not-at-top
  config = config_validation.validate(tiered_imagenet_minibatch.get_config(arm), num_devices=1)
  assert (config.episode.ways, config.data.image_size, config.loss) == (5, 84, 'cross_entropy')
  assert config.episode.task_classes == 'same'
  assert config.episode.num_tasks * config.episode.shots in (1, 2, 4)  # One to four batches.


def test_tiered_paper_settings():
  from configs import tiered_imagenet_t5  # pylint: disable=g-import-not-at-top
  c = tiered_imagenet_t5.get_config()
  assert (c.episode.ways, c.episode.shots, c.episode.queries_per_class) == (5, 5, 20)
  assert (c.data.image_size, c.model.channels, c.model.cnn_embedding_dim) == (84, 64, 40)
  assert (c.model.image_features, c.model.num_layers, c.model.num_heads) == (16, 1, 8)
  assert c.optim.learning_rate == 5e-6 and c.data.pipeline == 'host'
  assert not datasets.augment_spec(c).is_identity


def test_training_steps_through_the_host_pipeline(tmp_path):
  from configs import tiered_imagenet_t2  # pylint: disable=g-import-not-at-top
  config = tiered_imagenet_t2.get_config('tiny')
  config.data.data_dir = str(tmp_path / 'tfds')
  config.data.manual_dir = write_pickled_release(str(tmp_path / 'manual'))
  config.train.eval_every_steps = 0  # The evaluation step is the device path's (tested there).
  config.model.num_blocks = 2  # The pipeline, not the depth, is tested: a faster compile.
  metrics = train.train_and_evaluate(config, str(tmp_path / 'workdir'))
  assert np.isfinite(metrics['loss']) and metrics['skipped_steps'] == 0
  assert sorted(os.listdir(tmp_path / 'workdir' / 'checkpoints')) == ['3']


def test_multidomain_config_to_domain_episodes_under_mock_data(tmp_path):
  """datasets.load_dataset -> datasets.episode_spec with the domain sizes -> episodes.

  (A full training step is the same compiled step as for any spec; one runs
  in the host-pipeline test above.)"""
  from configs import multidomain_t2  # pylint: disable=g-import-not-at-top
  config = multidomain_t2.get_config('tiny')
  config.data.domains = ('caltech101', 'cars196', 'stanford_dogs')
  config.data.data_dir = str(tmp_path)
  with tfds.testing.mock_data(as_dataset_fn=_fake_as_dataset, data_dir=str(tmp_path)):
    dataset = datasets.load_dataset(config)
  sizes = dataset['domain_sizes']['train']
  assert sizes == (6, 6, 6) and dataset['train'].shape == (18, 4, 16, 16, 3)
  spec = datasets.episode_spec(config, sizes)
  batch = episodes.sample_episodes(jax.random.key(0), jnp.asarray(dataset['train']), spec, 4,
                                   False)
  assert batch['support_images'].shape == (4, 2, 2, 16, 16, 3)
  domain_of_row = np.repeat(np.arange(3), 6)
  task_domains = domain_of_row[np.asarray(batch['class_ids'])]  # [B, T, K]
  assert (task_domains == task_domains[..., :1]).all()
  assert (task_domains[:, 0, 0] != task_domains[:, 1, 0]).all()


@pytest.mark.parametrize('method', ['cht', 'constpn'])
def test_multidomain_checkpoint_evaluates_as_mode_eval_does(tmp_path, method):
  """Section 5.3 end to end on mock data: train ConstPN or CHT on domain tasks, then
  `evaluate_checkpoint` (what `--mode=eval` runs) scores the checkpoint on test domains,
  and for CHT `evaluate.evaluate` loads the test split itself.

  Only the loading runs under `mock_data` (it also redirects file paths, which Orbax's
  checkpoints must not see); the loaded dataset, domain sizes included, goes to both.
  """
  from configs import multidomain_t2  # pylint: disable=g-import-not-at-top
  config = multidomain_t2.get_config('tiny')
  config.method = method
  config.model.num_blocks = 2  # The protocol, not the depth, is tested: a faster compile.
  config.data.domains = ('caltech101', 'cars196', 'stanford_dogs')
  config.data.data_dir = str(tmp_path / 'tfds')
  with tfds.testing.mock_data(as_dataset_fn=_fake_as_dataset, data_dir=config.data.data_dir):
    dataset = datasets.load_dataset(config)
  workdir = str(tmp_path / 'run')
  if method == 'constpn':
    # 2 x 5 = 10-way training tasks from one domain: the mock domains have 6 classes,
    # which the config check (nominal counts) cannot know; training says so first.
    with pytest.raises(config_validation.ConfigError, match='ConstPN cannot draw its '
                       'training episodes: episode.ways = 10 classes per task'):
      train.train_and_evaluate(config, str(tmp_path / 'too_many_ways'), dataset)
    config.constpn_ways_multiplier = 3
  train.train_and_evaluate(config, workdir, dataset)
  protocol_overrides = dict(num_episodes=4, num_query_draws=1, queries_per_class=1,
                            batch_size=2)
  results, paths = evaluate.evaluate_checkpoint(config, workdir, plot=False, dataset=dataset,
                                                **protocol_overrides)
  assert results['step'] == config.train.num_steps
  assert tuple(results['episode']['domain_sizes']) == tuple(dataset['domain_sizes']['test'])
  assert len(results['episode']['domain_sizes']) == 3  # The test split's three domains.
  accuracy = results['table']['class_incremental']['mean']
  assert len(accuracy) == 2 and all(0 <= a <= 1 for a in accuracy)
  assert os.path.basename(paths[0]) == f'test_T2_step{config.train.num_steps}.json'
  if method == 'cht':
    # The protocol without a dataset loads the split, and its domain sizes, itself
    # (task_classes='domain'); the same protocol, so the same compiled evaluation.
    params, _ = evaluate.restore_params(workdir, config)
    protocol = evaluate.default_protocol(config, **protocol_overrides)
    with tfds.testing.mock_data(as_dataset_fn=_fake_as_dataset, data_dir=config.data.data_dir):
      loaded = evaluate.evaluate(config, params, protocol)
    assert loaded['episode']['domain_sizes'] == results['episode']['domain_sizes']
    accuracy = loaded['table']['class_incremental']['mean']
    assert len(accuracy) == 2 and all(0 <= a <= 1 for a in accuracy)


@pytest.mark.parametrize('module, overrides, message', [
    ('omniglot_t2', {'data.pipeline': 'host'}, "data.pipeline = 'host' is implemented for"),
    ('omniglot_t2', {'episode.task_classes': 'domain'}, "needs data.dataset = 'multidomain'"),
    ('multidomain_t2', {'data.domains': ('omniglot', 'imagenet')}, 'data.domains = '),
    ('multidomain_t2', {'data.domain_split': (0.5, 0.5, 0.5)}, 'adding up to 1'),
    ('multidomain_t2', {'data.domains': ('omniglot',)}, 'needs episode.num_tasks = 2 domains'),
    # The sampler may draw any domain, so each needs episode.ways classes.
    ('multidomain_t2', {'data.domain_split': (0.9, 0.04, 0.06)},
     "domain 1 has only 4 classes in the 'validation' split of data.domains="),
    ('tiered_imagenet_t2', {'data.augment.crop_min_scale': 0.0}, 'must be a number in (0, 1]'),
    ('tiered_imagenet_t2', {'data.augment.hue': 0.6}, 'must be a number in [0, 0.5]'),
    ('tiered_imagenet_t2', {'data.images_per_class': 19}, 'max(episode.shots, '
     'episode.queries_per_class) = 20 distinct images per class (episode.independent_draws: '
     'support and queries each drawn without replacement), but data.images_per_class = 19'),
    ('tiered_imagenet_t2', {'data.images_per_class': 20, 'episode.independent_draws': False},
     '5 + 20 = 25 images per class, but data.images_per_class = 20'),
    ('tiered_imagenet_t5', {'episode.ways': 100}, "the 'validation' split of"),
])
def test_new_config_mistakes_are_named(module, overrides, message):
  import importlib  # pylint: disable=g-import-not-at-top
  config = override(importlib.import_module(f'configs.{module}').get_config(), overrides)
  with pytest.raises(config_validation.ConfigError) as error:
    config_validation.validate(config, num_devices=1)
  assert message in str(error.value), str(error.value)
