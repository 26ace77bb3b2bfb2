r"""Trains a ':fast' config, evaluates it with the full protocol, and gathers the results.

  # Table 1's CHT row at T=5 on one GPU (docs/results.md, section 1):
  python launch/fast_table1.py --workdir=results/fast_t5 -- \
      --config=configs/omniglot_t5.py:fast --config.data.data_dir=$HOME/tensorflow_datasets

  # The CPU version of the T=2 check (issue 16; docs/results.md, sections 5, 12, 13):
  python launch/fast_table1.py --workdir=results/fast_t2_cpu --train_seconds=600 -- \
      --config=configs/omniglot_t2.py:fast --config.train.episodes_per_step=8 \
      --config.optim.learning_rate=0.0028 --config.train.num_steps=6000
  # Its 16-channel version (the paper's appendix width): docs/recipe.md, Commands.

Everything after `--` goes to `python -m cht_jax.main` for training (resumed from the
workdir; `--train_seconds` stops it with SIGTERM, checkpointed) and evaluation. Writes in
`--workdir` (reports.write_fast_table1) results.json (the Table 1 row with 95% CIs, device,
JAX, commit, command, wall clocks), results.md, curve.png, and eval/... (reports.write_results).
"""

import argparse
import glob
import json
import os
import shlex
import signal
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(command: list[str], timeout: float | None) -> tuple[int, float]:
  """Runs `command`; SIGTERM after `timeout` seconds (it checkpoints and exits)."""
  print('+', shlex.join(command), flush=True)
  start = time.time()
  process = subprocess.Popen(command, cwd=REPO_ROOT)
  try:
    returncode = process.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    print(f'Training budget of {timeout:.0f} s spent: stopping it with SIGTERM.', flush=True)
    process.send_signal(signal.SIGTERM)
    returncode = process.wait()
  except KeyboardInterrupt:
    process.send_signal(signal.SIGINT)
    returncode = process.wait()
    raise
  return returncode, time.time() - start


def _commit() -> str:
  """The checkout's commit; $CHT_COMMIT where the tree was copied without its history."""
  if os.environ.get('CHT_COMMIT'):
    return os.environ['CHT_COMMIT']
  try:
    out = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=REPO_ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()
    dirty = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no'],
                           cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    return out + ('+changes' if dirty else '')
  except (OSError, subprocess.CalledProcessError):
    return 'unknown'


def training_curve(metrics_path: str) -> dict[str, list[float]]:
  """Validation accuracy against step, episodes and training wall clock (rebuilt from
  train/steps_per_sec: training steps only, not validation or startup)."""
  rows = [json.loads(line) for line in open(metrics_path) if line.strip()]
  elapsed, last_step, at_step = 0.0, 0, {0: 0.0}
  episodes_per_step = None
  for row in rows:
    if row.get('split') == 'train' and row.get('train/steps_per_sec'):
      elapsed += (row['step'] - last_step) / row['train/steps_per_sec']
      last_step = row['step']
      at_step[row['step']] = elapsed
      if row.get('train/episodes_per_sec'):
        episodes_per_step = row['train/episodes_per_sec'] / row['train/steps_per_sec']
  curve = {'step': [], 'episodes': [], 'seconds': [], 'accuracy': []}
  for row in rows:
    if row.get('split') == 'validation' and 'validation/accuracy' in row:
      step = row['step']
      logged = [s for s in at_step if s <= step]
      curve['step'].append(step)
      curve['episodes'].append(step * round(episodes_per_step or 1))
      curve['seconds'].append(at_step[max(logged)] if logged else 0.0)
      curve['accuracy'].append(row['validation/accuracy'])
  return curve


def _table1_row(results: dict) -> dict:
  """{'columns': ['0', '0-1', ...], name: {'mean': [%], 'ci95': [%]}} of an evaluation."""
  table = results['table']
  row = {'columns': table['columns']}
  for key in ('class_incremental', 'task_incremental'):
    row[key] = {k: [100 * v for v in table[key][k]] for k in ('mean', 'ci95')}
  return row


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--train_seconds', type=float, default=None,
                      help='Stop training (SIGTERM, checkpointed) after this many seconds.')
  parser.add_argument('--skip_training', action='store_true',
                      help='Only evaluate the latest checkpoint and gather the results.')
  parser.add_argument('main_args', nargs='*', help='After --: flags of cht_jax.main.')
  args = parser.parse_args()
  if not any(a.startswith('--config=') for a in args.main_args):
    parser.error('Give the config after --, e.g. -- --config=configs/omniglot_t5.py:fast')
  workdir = os.path.abspath(args.workdir)
  # The code that trains is the checkout's now: a commit landing during a long training must
  # not be recorded as the one that ran.
  commit = _commit()
  main_command = [sys.executable, '-m', 'cht_jax.main', f'--workdir={workdir}', *args.main_args]
  train_seconds = None
  if not args.skip_training:
    code, train_seconds = _run(main_command, args.train_seconds)
    if code not in (0, 143):  # 143: stopped by SIGTERM after a checkpoint.
      sys.exit(f'Training failed (exit status {code}); see its log above.')
  code, eval_seconds = _run(main_command + ['--mode=eval'], None)
  if code:
    sys.exit(f'Evaluation failed (exit status {code}); see its log above.')

  evals = sorted(glob.glob(os.path.join(workdir, 'eval', 'test_T*_step*.json')),
                 key=os.path.getmtime)
  results = json.load(open(evals[-1]))
  import jax  # pylint: disable=g-import-not-at-top
  from cht_jax import reports  # pylint: disable=g-import-not-at-top
  summary = {
      'config': next(a.split('=', 1)[1] for a in args.main_args if a.startswith('--config=')),
      'command': shlex.join(sys.argv), 'commit': commit,
      'device': results.get('timing', {}).get('device') or jax.devices()[0].device_kind,
      'jax': jax.__version__, 'train_wall_seconds': train_seconds,
      'eval_wall_seconds': eval_seconds, 'evaluation': os.path.relpath(evals[-1], workdir),
      'step': results.get('step'), 'table1': _table1_row(results),
      'task_specificity': results.get('task_specificity'),
  }
  metrics = os.path.join(workdir, 'metrics.jsonl')
  if os.path.exists(metrics):
    summary['validation_curve'] = training_curve(metrics)
  reports.write_fast_table1(workdir, summary)
  print(reports.fast_table1_markdown(summary), end='')


if __name__ == '__main__':
  main()
