"""Does the host pipeline keep up with the training step at 84x84?

  python -m cht_jax.tools.bench_pipeline [--mode=both|pipeline|step]
      [--config=configs/tiered_imagenet_t2.py] [--num_steps=20]

pipeline: times `pipeline.episode_batches` alone (uint8 images) on a fake
tieredImageNet-shaped release (smooth random 84x84 RGB PNGs plus noise, about the real
ones' size) prepared with the TFDS builder. step: times the config's jitted
`train.make_train_step` (host=True) on a fixed batch on device; needs no TensorFlow.
The pipeline keeps up when its episodes/s exceed the step's.
"""

import io
import os
import pickle
import tempfile
import time

from absl import app
from absl import flags
from absl import logging
import numpy as np
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    'config', os.path.join(os.path.dirname(__file__), '..', '..', 'configs',
                           'tiered_imagenet_t2.py'), 'Training config.')
_MODE = flags.DEFINE_enum('mode', 'both', ['both', 'pipeline', 'step'], 'What to time.')
_NUM_STEPS = flags.DEFINE_integer('num_steps', 20, 'Timed batches / steps.')
_CLASSES = flags.DEFINE_integer('num_classes', 20, 'Fake training classes.')
_IMAGES = flags.DEFINE_integer('images_per_class', 40, 'Fake images per class.')


def fake_release(folder: str, num_classes: int, images_per_class: int, seed: int = 0) -> float:
  """Writes a pickled release (2 val / 2 test classes); returns mean PNG bytes."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  sizes = []
  for split, count in (('train', num_classes), ('val', 2), ('test', 2)):
    pngs, labels = [], []
    for c in range(count):
      for _ in range(images_per_class if split == 'train' else 2):
        grid = rng.integers(0, 256, (12, 12, 3)).astype(np.uint8)
        smooth = np.asarray(Image.fromarray(grid).resize((84, 84), Image.BICUBIC), np.int16)
        noisy = np.clip(smooth + rng.normal(0, 6, smooth.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(noisy).save(buf, format='PNG')
        pngs.append(np.frombuffer(buf.getvalue(), np.uint8))
        labels.append(c)
        sizes.append(len(buf.getvalue()))
    with open(os.path.join(folder, f'{split}_images_png.pkl'), 'wb') as f:
      pickle.dump(pngs, f)
    with open(os.path.join(folder, f'{split}_labels.pkl'), 'wb') as f:
      pickle.dump({'label_specific': np.asarray(labels)}, f)
  return float(np.mean(sizes))


def bench_pipeline(config, num_steps: int) -> dict:
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from cht_jax.data import datasets  # pylint: disable=g-import-not-at-top
  from cht_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  from cht_jax.data import tiered_imagenet  # pylint: disable=g-import-not-at-top
  tfds.disable_progress_bar()
  root = tempfile.mkdtemp(prefix='bench_pipeline_')
  manual = os.path.join(root, 'manual')
  os.makedirs(manual)
  start = time.perf_counter()
  png_bytes = fake_release(manual, _CLASSES.value, _IMAGES.value)
  builder = tiered_imagenet.prepare(os.path.join(root, 'tfds'), manual, None)
  source, labels = pipeline.tfds_source(builder, 'train')
  logging.info('Fake release prepared in %.1f s.', time.perf_counter() - start)
  spec = datasets.episode_spec(config)
  index = pipeline.class_index(labels)
  batch = config.train.episodes_per_step
  it = pipeline.episode_batches(source, index, spec, batch, config.seed, 1,
                                config.data.image_size, 3, normalize=False)
  for _ in range(3):  # Warm-up: tf.data autotuning, thread start.
    next(it)
  start, cpu = time.perf_counter(), time.process_time()
  for _ in range(num_steps):
    out = next(it)
  seconds = (time.perf_counter() - start) / num_steps
  cpu = (time.process_time() - cpu) / num_steps
  images = out['support_images'].shape[2] + out['query_images'].shape[2]
  return {'episodes_per_s': batch / seconds, 'images_per_s': batch * spec.num_tasks *
          images / seconds, 'png_bytes': png_bytes, 'cpus': os.cpu_count(),
          'cpu_s_per_episode': cpu / batch}


def bench_step(config, num_steps: int) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  from cht_jax import methods  # pylint: disable=g-import-not-at-top
  from cht_jax import optim  # pylint: disable=g-import-not-at-top
  from cht_jax import train  # pylint: disable=g-import-not-at-top
  from cht_jax.data import datasets  # pylint: disable=g-import-not-at-top
  from cht_jax.runtime import devices  # pylint: disable=g-import-not-at-top
  method = methods.build(config)
  optimizer = optim.make_optimizer(config.optim)
  mesh = devices.data_mesh(config.train.episodes_per_step)
  shape = datasets.image_shape(config)
  spec = datasets.episode_spec(config)
  b, t, k = config.train.episodes_per_step, spec.num_tasks, spec.ways
  rng = np.random.default_rng(0)
  labels = lambda n: np.tile(np.repeat(np.arange(k, dtype=np.int32), n), (b, t, 1))
  batch = {
      'support_images': rng.integers(0, 256, (b, t, k * spec.shots, *shape), np.uint8),
      'support_labels': labels(spec.shots),
      'query_images': rng.integers(0, 256, (b, t, k * spec.queries_per_class, *shape),
                                   np.uint8),
      'query_labels': labels(spec.queries_per_class),
      'class_ids': np.zeros((b, t, k), np.int32),
  }
  sharding = jax.NamedSharding(mesh, jax.P('data'))
  batch = jax.device_put(batch, sharding)
  state = train.make_init(method, optimizer, mesh)(jax.random.key(0))
  start = time.perf_counter()
  step = train.make_train_step(method, optimizer, mesh, host=True).lower(
      state, batch, jax.random.key(1)).compile()
  compile_s = time.perf_counter() - start
  costs = step.cost_analysis()
  costs = costs[0] if isinstance(costs, (list, tuple)) else costs
  flops = float((costs or {}).get('flops', float('nan')))
  state, metrics = step(state, batch, jax.random.key(1))
  jax.block_until_ready(metrics)
  start, cpu = time.perf_counter(), time.process_time()
  for i in range(num_steps):
    state, metrics = step(state, batch, jax.random.key(i))
  jax.block_until_ready(metrics)
  seconds = (time.perf_counter() - start) / num_steps
  cpu = (time.process_time() - cpu) / num_steps
  return {'steps_per_s': 1 / seconds, 'episodes_per_s': b / seconds, 'compile_s': compile_s,
          'cpu_s_per_episode': cpu / b, 'gflops_per_episode': flops / b / 1e9,
          'device': jax.devices()[0].device_kind, 'loss': float(metrics['loss'])}


def main(argv):
  del argv
  config = _CONFIG.value
  ep = config.episode
  print(f'config: {config.data.dataset}, T={ep.num_tasks}, {ep.ways}-way {ep.shots}-shot, '
        f'{ep.queries_per_class} queries/class, {config.data.image_size}x'
        f'{config.data.image_size}, {config.model.channels} channels, '
        f'B={config.train.episodes_per_step}')
  if _MODE.value in ('both', 'pipeline'):
    r = bench_pipeline(config, _NUM_STEPS.value)
    print(f"pipeline alone: {r['episodes_per_s']:.3g} episodes/s ({r['images_per_s']:.0f} "
          f"images/s, {r['cpu_s_per_episode'] * 1e3:.3g} CPU ms per episode, PNGs of "
          f"{r['png_bytes'] / 1024:.1f} KiB, {r['cpus']} CPUs)")
  if _MODE.value in ('both', 'step'):
    r = bench_step(config, _NUM_STEPS.value)
    print(f"training step on {r['device']}: {r['episodes_per_s']:.3g} episodes/s "
          f"({r['steps_per_s']:.3g} steps/s, {r['cpu_s_per_episode']:.3g} CPU s per episode, "
          f"{r['gflops_per_episode']:.3g} GFLOP per episode (XLA count), "
          f"compile {r['compile_s']:.1f} s, loss {r['loss']:.3g})")


if __name__ == '__main__':
  app.run(main)
