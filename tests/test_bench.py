"""The benchmark runs and reports sane numbers (speed itself is not asserted here)."""

import jax.numpy as jnp
import numpy as np

from cht_jax.tools import bench
from cht_jax.tools import profiling
from conftest import tiny_config, training_classes


def test_bench_config_reports_every_field():
  # The tiny config's own batch on test_methods' training classes, placed as the trainer
  # places them: the training step test_methods[cht] compiles, a persistent-cache hit.
  config = tiny_config()
  batch = config.train.episodes_per_step
  images = training_classes()
  row = bench.bench_config(config, batch, images, min_seconds=0.0, matmul_rate=100.0)
  assert row['num_tasks'] == 2 and row['episodes_per_step'] == batch
  for field in ('compile_s', 'steps_per_s', 'step_gflops', 'forward_episodes_per_s',
                'sampling_episodes_per_s', 'peak_memory_bytes'):
    assert row[field] > 0, field
  np.testing.assert_allclose(row['episodes_per_s'], batch * row['steps_per_s'])
  latency = bench.generation_latency(config, images, min_seconds=0.0)
  assert latency['calls'] >= 3
  assert 0 < latency['median'] <= latency['p90'] and latency['mean'] > 0
  assert latency['params_as_arguments_median'] > 0
  assert 0 < latency['best_round_median'] <= latency['p90']


def test_bench_profile_names_kernels_and_the_model_code_behind_them(tmp_path):
  """--profile_steps: per-kernel device times of the step, the trace and the HLO kept."""
  config = tiny_config()
  row = bench.bench_config(config, config.train.episodes_per_step, training_classes(),
                           min_seconds=0.0, matmul_rate=100.0, extras=False,
                           count_flops=False, profile_steps=2, trace_dir=str(tmp_path / 'trace'))
  assert np.isnan(row['forward_episodes_per_s']) and row['steps_per_s'] > 0
  profile = row['profile']
  assert profile['device_ms_per_call'] > 0 and profile['ops_per_call'] > 10
  names = [name for name, _, _, _ in profile['top_ops']]
  assert len(set(names)) == len(names) and profile['top_ops'][0][1] >= profile['top_ops'][-1][1]
  assert (tmp_path / 'trace' / 'step.hlo.txt.gz').exists()
  assert 'ms/call' in profiling.format_table(profile)


def test_hlo_sources_map_fusions_to_model_code():
  import jax  # pylint: disable=g-import-not-at-top
  def model(x):
    with jax.named_scope('my_block'):
      return jnp.tanh(x @ x.T).sum()
  hlo = jax.jit(model).lower(jnp.ones((4, 3))).compile().as_text()
  sources = profiling.hlo_sources(hlo)
  assert sources and any('my_block' in s for s in sources.values())
  assert all('.' not in name for name in sources)  # Kernel names: '.' written '_'.
