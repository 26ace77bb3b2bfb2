r"""Benchmark: training and evaluation speed, compile time, generation latency, memory.

  python -m cht_jax.tools.bench --config=configs/omniglot_t5.py --tasks=1,5 \
      --batch_sizes=1,8,32 --output=bench.json

Times training's jit-compiled `train.make_train_step` on random images of the config's
shape, the on-device episode sampler alone, the forward pass (evaluation) and the
latency of generating theta for one new task. Speeds are also a fraction of an fp32
matmul rate measured in the same run (FLOPs from XLA's cost analysis), so machines
compare. Prints a table and writes it as JSON.
"""

import functools
import gzip
import json
import math
import os
import platform
import resource
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import config_flags

from cht_jax import api
from cht_jax import continual
from cht_jax import methods
from cht_jax import models
from cht_jax import optim
from cht_jax import train
from cht_jax.data import datasets
from cht_jax.data import episodes as episodes_lib
from cht_jax.runtime import devices
from cht_jax.tools import profiling

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file('config', None, 'A config file (see configs/).')
flags.DEFINE_list('tasks', None, 'Numbers of tasks T to time (default: the config\'s).')
flags.DEFINE_list('batch_sizes', ['1', '8', '32'], 'Episodes per step to time.')
flags.DEFINE_integer('min_seconds', 10, 'Time each setting for at least this long.')
flags.DEFINE_integer('num_classes', 1150, 'Classes in the fake training split.')
flags.DEFINE_string('output', None, 'Where to write the table as JSON.')
flags.DEFINE_bool('cpu_cores_as_devices', True, 'On CPU, one JAX device per core, as '
                  'training runs (cht_jax/runtime/devices.py); False: one CPU device.')
flags.DEFINE_bool('extras', True, 'Also time the sampler alone, the forward pass '
                  '(evaluation) and generation latency; False: the training step only.')
flags.DEFINE_bool('count_flops', True, "Count an episode's FLOPs with XLA's cost analysis "
                  '(one more compile per T) to give the share of the matmul rate.')
flags.DEFINE_integer('profile_steps', 0, 'Trace this many training steps per setting with '
                     'the JAX profiler and print where their device time goes.')
flags.DEFINE_string('trace_dir', None, 'Where the profiler traces go (default: a temp dir).')
flags.mark_flag_as_required('config')


def _time(fn, min_seconds: float, blocking: bool = False) -> float:
  """Seconds per call of compiled `fn` over at least `min_seconds`: back to back as in training,
  the fastest of three rounds; with `blocking`, the mean of calls that each wait."""
  if blocking:
    return float(np.mean(_latencies([fn], min_seconds)[0]))
  start = time.perf_counter()
  jax.block_until_ready(fn())
  calls = max(3, math.ceil(min_seconds / 3 / max(time.perf_counter() - start, 1e-6)))
  rounds = []
  for _ in range(3):  # The fastest of three rounds: other work on the machine only slows.
    start = time.perf_counter()
    for _ in range(calls):
      out = fn()
    jax.block_until_ready(out)
    rounds.append((time.perf_counter() - start) / calls)
  return min(rounds)


def _latencies(fns, min_seconds: float, batch: int = 20) -> list[np.ndarray]:
  """Seconds of each blocking call of each of `fns`: at least 3 each and `min_seconds` in
  all, taking turns in batches of `batch` so that a drifting machine affects all alike."""
  seconds, start = [[] for _ in fns], time.perf_counter()
  while len(seconds[0]) < 3 or time.perf_counter() - start < min_seconds:
    for fn, fn_seconds in zip(fns, seconds):
      for _ in range(batch):
        call_start = time.perf_counter()
        jax.block_until_ready(fn())
        fn_seconds.append(time.perf_counter() - call_start)
  return [np.array(s) for s in seconds]


def matmul_gflops(min_seconds: float = 2.0) -> float:
  """fp32 matrix-product GFLOP/s of this machine (all its devices at once)."""
  mesh = devices.data_mesh()
  n = mesh.shape['data']
  a = jax.device_put(jnp.ones((n, 1024, 1024), jnp.float32),
                     jax.NamedSharding(mesh, jax.P('data')))
  matmul = jax.jit(lambda x: x @ x)
  jax.block_until_ready(matmul(a))
  return n * 2 * 1024 ** 3 / _time(lambda: matmul(a), min_seconds, blocking=True) / 1e9


def _peak_memory_bytes() -> int:
  """Peak device memory where the backend reports it, else the process's peak RSS."""
  stats = jax.devices()[0].memory_stats() or {}
  if 'peak_bytes_in_use' in stats:
    return int(stats['peak_bytes_in_use'])
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _sample_episode(key, class_images, spec) -> dict:
  """One episode without augmentation, as one compiled program (not one per operation)."""
  return jax.jit(lambda k, images: episodes_lib.sample_episode(k, images, spec, rotate=False))(
      key, class_images)


def episode_flops(config, ht, params, episode) -> float:
  """XLA-counted FLOPs of one episode's loss and gradient, vmapped and unrolled (cost analysis
  counts a loop body once), without remat: the step's own work, whatever it recomputes."""
  loss = lambda p: continual.episode_loss(ht, p, episode, config.loss, remat=False,
                                          vectorize=True, unroll=True)[0]
  compiled = jax.jit(jax.grad(loss)).lower(params).compile()
  return compiled.cost_analysis().get('flops', float('nan'))


def bench_config(config, batch_size: int, class_images, min_seconds: float,
                 matmul_rate: float, flops_cache: dict | None = None, extras: bool = True,
                 profile_steps: int = 0, trace_dir: str | None = None,
                 count_flops: bool = True) -> dict:
  """Times one (T, episodes per step) setting; `flops_cache`: T -> an episode's FLOPs, filled
  on first use; without `extras` the step only; `profile_steps` traced into row['profile']."""
  config = config.copy_and_resolve_references()
  config.train.episodes_per_step = batch_size
  method = methods.build(config)
  optimizer = optim.make_optimizer(config.optim)
  mesh = devices.data_mesh(batch_size)
  state = train.make_init(method, optimizer, mesh)(jax.random.key(0))
  step = train.make_train_step(method, optimizer, mesh)
  key = jax.random.key(1)

  start = time.perf_counter()
  compiled = step.lower(state, class_images, key).compile()
  compile_seconds = time.perf_counter() - start
  spec = datasets.episode_spec(config)
  episode = _sample_episode(key, class_images, spec)
  flops_cache = {} if flops_cache is None else flops_cache
  num_tasks = config.episode.num_tasks
  if num_tasks not in flops_cache:
    flops_cache[num_tasks] = (episode_flops(config, method.ht, state.params, episode)
                              if count_flops else float('nan'))
  step_flops = batch_size * flops_cache[num_tasks]

  holder = [state]
  def one_step():
    holder[0], metrics = compiled(holder[0], class_images, key)
    return metrics['loss']
  step_seconds = _time(one_step, min_seconds)
  params = holder[0].params
  row = {
      'num_tasks': num_tasks, 'episodes_per_step': batch_size,
      'num_devices': devices.num_data_devices(batch_size), 'compile_s': compile_seconds,
      'steps_per_s': 1 / step_seconds, 'episodes_per_s': batch_size / step_seconds,
      'step_gflops': step_flops / 1e9,
      'fraction_of_matmul_rate': step_flops / step_seconds / 1e9 / matmul_rate,
      **dict.fromkeys(('forward_episodes_per_s', 'sampling_episodes_per_s',
                       'sampling_share_of_step'), float('nan')),
  }
  if profile_steps:
    hlo_text = compiled.as_text()
    row['profile'] = profiling.profile_calls(one_step, profile_steps, trace_dir, hlo_text)
    # The optimised HLO beside the trace: maps the profile's fusion names to their code.
    with gzip.open(os.path.join(row['profile']['trace_dir'], 'step.hlo.txt.gz'), 'wt') as f:
      f.write(hlo_text)
  if not extras:
    return {**row, 'peak_memory_bytes': _peak_memory_bytes()}

  sample = jax.jit(lambda k: episodes_lib.sample_episodes(
      k, class_images, spec, batch_size, rotate=config.data.rotate))
  jax.block_until_ready(sample(key))
  sample_seconds = _time(lambda: sample(key), min_seconds / 4)

  forward = train.make_eval_step(method, batch_size)
  jax.block_until_ready(forward(params, class_images, key))
  forward_seconds = _time(lambda: forward(params, class_images, key), min_seconds / 2)
  row.update(forward_episodes_per_s=batch_size / forward_seconds,
             sampling_episodes_per_s=batch_size / sample_seconds,
             sampling_share_of_step=sample_seconds / step_seconds,
             peak_memory_bytes=_peak_memory_bytes())
  return row


def generation_latency(config, class_images, min_seconds: float) -> dict[str, float]:
  """Seconds to generate theta_t for one new task: `api.compile_generator`'s (parameters as
  constants) median, mean, p90, calls and fastest-round median, and the median with the
  parameters as arguments (as in training)."""
  ht = models.build_hypertransformer(config)
  spec = datasets.episode_spec(config)
  episode = _sample_episode(jax.random.key(0), class_images, spec)
  support_images = episode['support_images'][0]
  support_labels = episode['support_labels'][0]
  theta = models.hypertransformer.zeros_theta(ht.cnn, support_images.shape[1:])
  params = jax.jit(ht.init)(jax.random.key(0), support_images, support_labels, theta)['params']
  compiled_in = api.compile_generator(ht, params)
  as_arguments = jax.jit(functools.partial(continual.generate_task, ht))
  theta, _ = compiled_in(support_images, support_labels, theta)
  seconds, seconds_as_arguments = _latencies(
      [lambda: compiled_in(support_images, support_labels, theta),
       lambda: as_arguments(params, support_images, support_labels, theta)], min_seconds)
  return {'median': float(np.median(seconds)), 'mean': float(np.mean(seconds)),
          'p90': float(np.percentile(seconds, 90)), 'calls': len(seconds),
          'best_round_median': min(float(np.median(r)) for r in np.array_split(seconds, 3)),
          'params_as_arguments_median': float(np.median(seconds_as_arguments))}


def main(argv):
  del argv
  if FLAGS.cpu_cores_as_devices:
    devices.use_cpu_cores()
  config = FLAGS.config
  size = config.data.image_size
  class_images = jnp.asarray(np.random.default_rng(0).integers(
      0, 256, (FLAGS.num_classes, 20, size, size, 1), dtype=np.uint8))
  gflops = matmul_gflops()
  header = {'device': str(jax.devices()[0].device_kind), 'platform': jax.default_backend(),
            'num_devices': jax.device_count(), 'jax': jax.__version__,
            'machine': platform.machine(), 'matmul_gflops': gflops}
  print(f"device {header['device']} x{header['num_devices']} ({header['platform']}), "
        f"JAX {header['jax']}, fp32 matmul {gflops:.0f} GFLOP/s")
  print(f"{'T':>2} {'B':>3} {'dev':>3} {'compile s':>9} {'steps/s':>8} {'episodes/s':>10} "
        f"{'of matmul':>9} {'eval ep/s':>9} {'sampling ep/s':>13} {'peak MB':>8}", flush=True)
  rows, flops_cache = [], {}

  def write_output():  # After each row too: a run killed later keeps what it measured.
    if FLAGS.output:
      with open(FLAGS.output, 'w') as f:
        json.dump({**header, 'rows': rows}, f, indent=2)

  for num_tasks in FLAGS.tasks or [config.episode.num_tasks]:
    config.episode.num_tasks = int(num_tasks)
    for batch_size in FLAGS.batch_sizes:
      trace_dir = FLAGS.trace_dir and f'{FLAGS.trace_dir}/T{num_tasks}_B{batch_size}'
      r = bench_config(config, int(batch_size), class_images, FLAGS.min_seconds, gflops,
                       flops_cache, extras=FLAGS.extras, count_flops=FLAGS.count_flops,
                       profile_steps=FLAGS.profile_steps, trace_dir=trace_dir)
      rows.append(r)
      print(f"{r['num_tasks']:>2} {r['episodes_per_step']:>3} {r['num_devices']:>3} "
            f"{r['compile_s']:>9.1f} {r['steps_per_s']:>8.2f} {r['episodes_per_s']:>10.1f} "
            f"{r['fraction_of_matmul_rate']:>9.1%} {r['forward_episodes_per_s']:>9.1f} "
            f"{r['sampling_episodes_per_s']:>13.0f} {r['peak_memory_bytes'] / 2**20:>8.0f}",
            flush=True)
      if 'profile' in r:
        print(profiling.format_table(r['profile']), flush=True)
      write_output()
  if not FLAGS.extras:
    return
  latency = generation_latency(config, class_images, FLAGS.min_seconds / 2)
  for name, key in (('', 'median'), ('_mean', 'mean'), ('_p90', 'p90'),
                    ('_best_round', 'best_round_median'),
                    ('_params_as_arguments', 'params_as_arguments_median')):
    header[f'generation_latency{name}_ms'] = latency[key] * 1e3
  print(f"generating theta for one new task: {header['generation_latency_ms']:.2f} ms median "
        f"(mean {header['generation_latency_mean_ms']:.2f}, 90th percentile "
        f"{header['generation_latency_p90_ms']:.2f}, {latency['calls']} calls; fastest of "
        f"three rounds {header['generation_latency_best_round_ms']:.2f}); "
        f"{header['generation_latency_params_as_arguments_ms']:.2f} ms median with the "
        'parameters as arguments')
  write_output()


if __name__ == '__main__':
  app.run(main)
