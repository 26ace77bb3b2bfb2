r"""Trains and evaluates several runs in one process, without TFDS, TensorFlow or CLU.

For machines whose image has JAX but not TensorFlow (e.g. a bare GPU box):
images come from the `.npz` cache that `cht_jax.data.omniglot.load_omniglot`
writes (`<data_dir>/cht_jax_cache/omniglot_ht_2022_28.npz`), training is
`train.make_train_step` in a plain loop (no checkpoints, no metric writers),
evaluation is `evaluate.evaluate` (the paper's protocol), and the results are
written and tabulated exactly as `launch/sweep.py` does. Prefer
`launch/sweep.py` (checkpoints, resume, logs) wherever TensorFlow is installed.

  python launch/inprocess.py --npz=~/tensorflow_datasets/cht_jax_cache/omniglot_ht_2022_28.npz \
      --root=/tmp/evidence --steps=2000 --episodes_per_step=8 --eval_episodes=1024 \
      --run=cht=configs/omniglot_t2.py:smoke --run=constpn=configs/omniglot_constpn.py:2,smoke \
      --run=merged_ht=configs/omniglot_merged_ht.py:2,smoke
"""

import argparse
import importlib.util
import json
import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, 'launch'))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from cht_jax import config_validation  # pylint: disable=g-import-not-at-top,wrong-import-position
from cht_jax import devices  # pylint: disable=g-import-not-at-top,wrong-import-position
from cht_jax import evaluate  # pylint: disable=g-import-not-at-top,wrong-import-position
from cht_jax import methods  # pylint: disable=g-import-not-at-top,wrong-import-position
from cht_jax import reports  # pylint: disable=g-import-not-at-top,wrong-import-position
from cht_jax import train  # pylint: disable=g-import-not-at-top,wrong-import-position
import sweep  # pylint: disable=g-import-not-at-top,wrong-import-position


def load_config(spec: str):
  """'configs/omniglot_constpn.py:2,smoke' -> its get_config('2,smoke')."""
  path, _, arg = spec.partition(':')
  module_spec = importlib.util.spec_from_file_location('run_config', os.path.join(REPO_ROOT, path))
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def run(name, spec, data, args):
  config = load_config(spec)
  with config.unlocked():
    config.train.num_steps = args.steps
    config.train.episodes_per_step = args.episodes_per_step
  config_validation.validate(config)
  method = methods.build(config)
  optimizer = train.method_optimizer(method)
  key = jax.random.key(config.seed)
  init_key, train_key = jax.random.split(key)
  mesh = devices.data_mesh(config.train.episodes_per_step)
  replicated = jax.NamedSharding(mesh, jax.P())  # As train.py: one compiled step.
  state = jax.jit(lambda k: train.init_state(method, optimizer, k),
                  out_shardings=replicated)(init_key)
  step_fn = train.make_train_step(method, optimizer, mesh)
  images = jax.device_put(data['train'], replicated)
  start, log, step = time.perf_counter(), [], 0
  for step in range(1, args.steps + 1):
    state, metrics = step_fn(state, images, jax.random.fold_in(train_key, step))
    if step % args.log_every == 0 or step == args.steps:
      metrics = jax.device_get(metrics)
      elapsed = time.perf_counter() - start
      log.append({'step': step, 'seconds': elapsed, **{k: float(v) for k, v in metrics.items()}})
      print(f'[{name}] step {step}: loss {metrics["loss"]:.4g} accuracy '
            f'{metrics["accuracy"]:.3f} ({elapsed:.0f} s)', flush=True)
      if elapsed > args.max_train_seconds:
        print(f'[{name}] stopping at step {step}: over --max_train_seconds', flush=True)
        break
  train_seconds = time.perf_counter() - start
  protocol = evaluate.default_protocol(
      config, num_episodes=args.eval_episodes, num_query_draws=args.eval_query_draws,
      batch_size=args.eval_batch_size)
  results = evaluate.evaluate(config, state.params, protocol, class_images=data['test'])
  workdir = os.path.join(args.root, name)
  results.update(workdir=workdir, step=step,
                 config=json.loads(config.to_json_best_effort()),
                 training={'steps': step, 'seconds': train_seconds,
                           'episodes_per_step': args.episodes_per_step, 'log': log})
  reports.write_results(results, reports.result_prefix(workdir, protocol, step), plot=False)
  print(f'[{name}] trained {step} steps in {train_seconds:.0f} s; class-incremental '
        f'{results["table"]["class_incremental"]["mean"]}', flush=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--npz', required=True)
  parser.add_argument('--root', required=True)
  parser.add_argument('--run', action='append', required=True, help='NAME=CONFIG_SPEC')
  parser.add_argument('--steps', type=int, default=500)
  parser.add_argument('--episodes_per_step', type=int, default=1)
  parser.add_argument('--log_every', type=int, default=100)
  parser.add_argument('--max_train_seconds', type=float, default=float('inf'))
  parser.add_argument('--eval_episodes', type=int, default=1024)
  parser.add_argument('--eval_query_draws', type=int, default=16)
  parser.add_argument('--eval_batch_size', type=int, default=8)
  parser.add_argument('--table', default='inprocess')
  args = parser.parse_args(argv)
  devices.use_cpu_cores()  # As main.py: on a CPU host, each core takes its own episodes.
  with np.load(os.path.expanduser(args.npz)) as f:
    data = {k: f[k] for k in f.files}
  print(f'JAX {jax.__version__} on {jax.devices()}', flush=True)
  names = []
  for item in args.run:
    name, spec = item.split('=', 1)
    run(name, spec, data, args)
    names.append(name)
  records = sweep.collect([(n, os.path.join(args.root, n)) for n in names])
  prefix = os.path.join(args.root, args.table)
  paths = sweep.write_table(records, prefix) + sweep.write_figures(records, prefix)
  print('Wrote ' + ', '.join(paths))
  print(open(paths[0]).read())
  return 0


if __name__ == '__main__':
  sys.exit(main())
