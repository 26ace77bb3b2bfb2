r"""Runs a sweep of experiments (train, then evaluate), and collects their results into one table.

  python launch/sweep.py --sweep=baselines --num_tasks=2 --variant=smoke --root=workdirs/baselines \
      --override=--config.data.manual_dir=../shared/data/omniglot --eval_flag=--eval_episodes=64
  python launch/sweep.py --sweep=omniglot_channels --launcher=slurm --root=/shared/sweeps/channels
  python launch/sweep.py --sweep=omniglot_tasks --launcher=print   # or --collect_only

Sweeps: `_sweeps` (merged_ht: the paper's Figure 4 stars; minibatch, tiered_minibatch: section
5.1's five arms); docs/baselines.md. Each run is `python -m cht_jax.main --config=FILE:ARGS
[,variant] --workdir=<root>/<run> [--override ...]`, then `--mode=eval [--eval_flag ...]`,
locally, or with --launcher=slurm as <root>/submit_<sweep>.sh (evaluations queued afterok;
--submit runs it). `reports.write_sweep` collects each run's latest evaluation into
`<root>/sweep_<name>.{md,csv,json}` and a figure per dataset.
"""

import argparse
import glob
import json
import os
import re
import shlex
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MINIBATCH_ARMS = ('all_at_once', 'two_plus_two', 'one_at_a_time', 'ht_one', 'ht_two')


# name -> [(run name, config file, config arguments before the variant)].
def _sweeps(num_tasks: int) -> dict[str, list[tuple[str, str, list[str]]]]:
  t = str(num_tasks)
  return {
      'omniglot_tasks': [(f't{k}', f'configs/omniglot_t{k}.py', []) for k in range(1, 6)],
      'omniglot_channels': [(f'c{c}_t{k}', 'configs/omniglot_channels.py', [str(c), str(k)])
                            for c in (4, 6, 8, 16, 32) for k in range(2, 6)],
      'baselines': [
          ('cht', f'configs/omniglot_t{t}.py', []),  # T in 1..5.
          ('constpn', 'configs/omniglot_constpn.py', [t]),
          ('merged_ht', 'configs/omniglot_merged_ht.py', [t]),
          ('ht_ce', 'configs/omniglot_ht_ce.py', [t]),
          ('cht_task_incremental', 'configs/omniglot_task_incremental.py', [t]),
      ],
      # Table 1: CHT against the baselines trained by gradient descent.
      'table1': [('cht', f'configs/omniglot_t{t}.py', [])] + [
          (method, 'configs/baselines_table1.py', [method, t])
          for method in ('finetune', 'ewc', 'maml')],
      'merged_ht': [(f'merged_ht_t{k}', 'configs/omniglot_merged_ht.py', [str(k)])
                    for k in range(2, 6)],
      'minibatch': [(arm, 'configs/omniglot_minibatch.py', [arm]) for arm in MINIBATCH_ARMS],
      # The paper's setting: tieredImageNet 5-way.
      'tiered_minibatch': [(arm, 'configs/tiered_imagenet_minibatch.py', [arm])
                           for arm in MINIBATCH_ARMS],
      # Beyond the paper: M unlabeled images per class in every support set.
      'semisupervised': [(f'm{m}_t{k}', 'configs/omniglot_semisupervised.py', [str(m), str(k)])
                         for k in (1, 2, 5) for m in (0, 2, 4)],
  }


SWEEPS = tuple(_sweeps(2))


def config_spec(path: str, args: list[str], variant: str) -> str:
  """'configs/omniglot_constpn.py' + ['2'] + 'smoke' -> 'configs/omniglot_constpn.py:2,smoke'."""
  args = args + ([variant] if variant else [])
  return f'{path}:{",".join(args)}' if args else path


def run_commands(spec: str, workdir: str, overrides: list[str],
                 eval_flags: list[str]) -> tuple[list[str], list[str]]:
  """The training and the evaluation command lines of one run."""
  base = [sys.executable, '-m', 'cht_jax.main', f'--config={spec}', f'--workdir={workdir}']
  return base + overrides, base + ['--mode=eval'] + overrides + eval_flags


def run_local(name: str, commands: list[list[str]], workdir: str) -> bool:
  """Runs the commands of one run in order, logging to <workdir>/{train,eval}.log."""
  os.makedirs(workdir, exist_ok=True)
  for command, log_name in zip(commands, ('train.log', 'eval.log')):
    print(f'[{name}] {shlex.join(command)}', flush=True)
    start = time.time()
    with open(os.path.join(workdir, log_name), 'w') as log:
      code = subprocess.call(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    print(f'[{name}] exit {code} after {time.time() - start:.0f} s '
          f'(log: {os.path.join(workdir, log_name)})', flush=True)
    if code:
      return False
  return True


def slurm_script(runs: list[tuple[str, list[str], list[str]]], sbatch_args: list[str]) -> str:
  """A bash script that submits every run's training and, after it, its evaluation."""
  lines = ['#!/bin/bash', '# Written by launch/sweep.py: one training job per run, its',
           '# evaluation queued after it (afterok).', 'set -euo pipefail',
           f'cd {shlex.quote(REPO_ROOT)}']
  extra = ' '.join(shlex.quote(a) for a in sbatch_args)
  for name, train, evaluate in runs:
    # launch/slurm.sbatch CONFIG WORKDIR [flags]: drop 'python -m cht_jax.main'.
    config, workdir = train[3].split('=', 1)[1], train[4].split('=', 1)[1]
    train_flags = ' '.join(shlex.quote(a) for a in train[5:])
    eval_flags = ' '.join(shlex.quote(a) for a in evaluate[5:])
    var = 'job_' + re.sub(r'\W', '_', name)
    lines.append(f'{var}=$(sbatch --parsable --job-name={shlex.quote(name)} {extra} '
                 f'launch/slurm.sbatch {shlex.quote(config)} {shlex.quote(workdir)} '
                 f'{train_flags})')
    lines.append(f'sbatch --dependency=afterok:${{{var}}} --job-name={shlex.quote(name + "_eval")}'
                 f' {extra} launch/slurm.sbatch {shlex.quote(config)} {shlex.quote(workdir)} '
                 f'{eval_flags}')
  return '\n'.join(lines) + '\n'


def latest_result(workdir: str) -> str | None:
  """The evaluation JSON of the latest step (then largest T_eval) in <workdir>/eval."""
  found = []
  for path in glob.glob(os.path.join(workdir, 'eval', '*_T*_step*.json')):
    match = re.search(r'_T(\d+)_step(\d+)\.json$', path)
    if match:
      found.append((int(match.group(2)), int(match.group(1)), path))
  return max(found)[2] if found else None


def collect(names_and_workdirs: list[tuple[str, str]]) -> list[dict]:
  """One record per run that has an evaluation result (with its full result)."""
  records = []
  for name, workdir in names_and_workdirs:
    path = latest_result(workdir)
    if path is None:
      print(f'[{name}] no evaluation result in {workdir}/eval', flush=True)
      continue
    with open(path) as f:
      result = json.load(f)
    config = result.get('config', {})
    final = result['task_incremental']['mean'][-1]
    records.append({
        'run': name, 'path': path, 'result': result, 'method': result.get('method', 'CHT'),
        'dataset': config.get('data', {}).get('dataset', 'unknown'),
        'loss': config.get('loss', ''), 'channels': config.get('model', {}).get('channels'),
        'trained_tasks': result['trained_tasks'], 'num_tasks': result['num_tasks'],
        'ways': result['episode']['ways'], 'shots': result['episode']['shots'],
        'step': result.get('step'), 'episodes': result['protocol']['num_episodes'],
        **{k: result['table'][k] for k in ('columns', 'class_incremental', 'task_incremental')},
        # theta_{T-1} on the queries of its own task (the mini-batch number).
        'final_theta_last_task': final[len(final) - 1],
    })
  return records


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--sweep', required=True, choices=SWEEPS)
  parser.add_argument('--root', default='workdirs/sweep', help='One workdir per run under it.')
  parser.add_argument('--variant', default='', choices=('', 'smoke', 'tiny'))
  parser.add_argument('--num_tasks', type=int, default=2, help='T of the baselines sweep.')
  parser.add_argument('--only', default='', help='Comma-separated run names to keep.')
  parser.add_argument('--override', action='append', default=[],
                      help='A flag for every run, e.g. --override=--config.train.num_steps=500.')
  parser.add_argument('--eval_flag', action='append', default=[],
                      help='A flag for every evaluation, e.g. --eval_flag=--eval_episodes=64.')
  parser.add_argument('--launcher', default='local', choices=('local', 'print', 'slurm'))
  parser.add_argument('--sbatch_arg', action='append', default=[],
                      help='Passed to every sbatch, e.g. --sbatch_arg=--gpus-per-node=1.')
  parser.add_argument('--submit', action='store_true', help='slurm: run the submit script.')
  parser.add_argument('--collect_only', action='store_true')
  parser.add_argument('--no_figures', action='store_true')
  args = parser.parse_args(argv)

  if args.sweep in ('baselines', 'table1') and not 1 <= args.num_tasks <= 5:
    parser.error(f'--num_tasks must be in 1..5 (configs/omniglot_t1..5.py), got {args.num_tasks}.')
  runs = _sweeps(args.num_tasks)[args.sweep]
  if args.only:
    keep = set(args.only.split(','))
    unknown = keep - {name for name, _, _ in runs}
    if unknown:
      parser.error(f'--only names no run of {args.sweep}: {sorted(unknown)}; runs are '
                   f'{[name for name, _, _ in runs]}.')
    runs = [r for r in runs if r[0] in keep]
  root = os.path.abspath(args.root)
  planned = [(name, *run_commands(config_spec(path, config_args, args.variant),
                                  os.path.join(root, name), args.override, args.eval_flag))
             for name, path, config_args in runs]

  failed = []
  if not args.collect_only:
    if args.launcher == 'print':
      for _, train, evaluate in planned:
        print(shlex.join(train), shlex.join(evaluate), sep='\n')
      return 0
    if args.launcher == 'slurm':
      os.makedirs(root, exist_ok=True)
      script = os.path.join(root, f'submit_{args.sweep}.sh')
      with open(script, 'w') as f:
        f.write(slurm_script(planned, args.sbatch_arg))
      print(f'Wrote {script}; collect afterwards with --collect_only.')
      return subprocess.call(['bash', script]) if args.submit else 0
    for name, train, evaluate in planned:
      if not run_local(name, [train, evaluate], os.path.join(root, name)):
        failed.append(name)

  records = collect([(name, os.path.join(root, name)) for name, _, _ in planned])
  if records:
    sys.path.insert(0, REPO_ROOT)
    from cht_jax import reports  # pylint: disable=g-import-not-at-top
    paths = reports.write_sweep(records, os.path.join(root, f'sweep_{args.sweep}'),
                                figures=not args.no_figures)
    print('Wrote ' + ', '.join(paths))
    with open(paths[0]) as f:
      print(f.read())
  if failed:
    print(f'Runs that failed: {", ".join(failed)} (see their train.log / eval.log).')
  return 1 if failed or not records else 0


if __name__ == '__main__':
  sys.exit(main())
