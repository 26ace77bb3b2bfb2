"""Times jit-compiled `sample_episodes` on random Omniglot-shaped data.

  python -m cht_jax.tools.bench_episodes [--num_iters=50]

T=5, 20-way 1-shot, 3 queries per class, rotations, class images uint8 [1150, 20, 28, 28, 1].
"""

import functools
import time

from absl import app
from absl import flags
import jax
import numpy as np

from cht_jax.data import episodes

_NUM_ITERS = flags.DEFINE_integer('num_iters', 50, 'Timed calls per B.')
_BATCH_SIZES = flags.DEFINE_list('batch_sizes', ['1', '8', '32'], 'Episodes per call.')


def main(argv):
  del argv
  spec = episodes.EpisodeSpec(num_tasks=5, ways=20, shots=1, queries_per_class=3)
  rng = np.random.default_rng(0)
  class_images = jax.device_put(rng.integers(0, 256, (1150, 20, 28, 28, 1), dtype=np.uint8))

  @functools.partial(jax.jit, static_argnums=(3,))
  def sample(key, step, images, batch):
    # As in a train step: the per-step key is derived inside the jit.
    return episodes.sample_episodes(jax.random.fold_in(key, step), images, spec, batch, True)

  print(f'device: {jax.devices()[0]}; spec: {spec}')
  key = jax.random.key(0)
  for batch in map(int, _BATCH_SIZES.value):
    start = time.perf_counter()
    jax.block_until_ready(sample(key, 0, class_images, batch))
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    for step in range(_NUM_ITERS.value):
      out = sample(key, step, class_images, batch)
    jax.block_until_ready(out)
    per_call = (time.perf_counter() - start) / _NUM_ITERS.value
    print(f'B={batch:3d}: {batch / per_call:9.1f} episodes/s '
          f'({per_call * 1e3:.2f} ms/call, first call {compile_s:.2f} s)')


if __name__ == '__main__':
  app.run(main)
