"""The benchmark runs and reports sane numbers (speed itself is not asserted here)."""

import jax.numpy as jnp
import numpy as np

from cht_jax import bench
from conftest import tiny_config


def test_bench_config_reports_every_field():
  config = tiny_config()
  images = jnp.asarray(np.random.default_rng(0).integers(0, 256, (12, 20, 16, 16, 1), np.uint8))
  row = bench.bench_config(config, 2, images, min_seconds=0.0, matmul_rate=100.0)
  assert row['num_tasks'] == 2 and row['episodes_per_step'] == 2
  for field in ('compile_s', 'steps_per_s', 'step_gflops', 'forward_episodes_per_s',
                'sampling_episodes_per_s', 'peak_memory_bytes'):
    assert row[field] > 0, field
  np.testing.assert_allclose(row['episodes_per_s'], 2 * row['steps_per_s'])
  latency = bench.generation_latency(config, images, min_seconds=0.0)
  assert latency['calls'] >= 3
  assert 0 < latency['median'] <= latency['p90'] and latency['mean'] > 0
  assert latency['params_as_arguments_median'] > 0
  assert 0 < latency['best_round_median'] <= latency['p90']
