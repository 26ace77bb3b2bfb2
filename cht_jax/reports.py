r"""Every results file: of an evaluation, and the tables and figures of the launch scripts.

`write_results` writes what `evaluate.evaluate` returns (docs/evaluation.md), its set of files
whole or not at all (`_result_set`). Also `write_sweep` (launch/sweep.py), `write_fast_table1`
(launch/fast_table1.py), and the tables of the shell scripts:

  python -m cht_jax.reports runs_table --work=/tmp/figure3 --runs="t1 t2" --output=table.md
  python -m cht_jax.reports levers --root=workdirs/levers
"""

import argparse
import contextlib
import csv
import glob
import io
import json
import os
import shutil
import socket
import tempfile
from typing import Any, Iterator

import numpy as np

from cht_jax.runtime import workdir as workdir_lib

MATRICES = ('task_incremental', 'class_incremental', 'class_incremental_cumulative')


def task_names(num_tasks: int, cumulative: bool) -> list[str]:
  """'0', '1', ... or, for accuracies on tasks 0..k, '0', '0-1', '0-2', ..."""
  if cumulative:
    return ['0'] + [f'0-{k}' for k in range(1, num_tasks)]
  return [str(k) for k in range(num_tasks)]


def _jsonable(x):
  if isinstance(x, dict):
    return {k: _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, np.ndarray):
    return _jsonable(x.tolist())
  if isinstance(x, (float, np.floating)):
    return None if not np.isfinite(x) else float(x)
  if isinstance(x, np.integer):
    return int(x)
  return x


def _percent(mean, ci) -> str:
  if mean is None or not np.isfinite(mean):
    return ''
  if ci is None or not np.isfinite(ci):
    return f'{100 * mean:.1f}'
  return f'{100 * mean:.1f} ± {100 * ci:.1f}'


def markdown_table(columns: list[str], rows: list[list[Any]]) -> str:
  """The one Markdown table writer: a header line, '|---|...', a line per row (str of cells)."""
  lines = ['| ' + ' | '.join(columns) + ' |', '|' + '---|' * len(columns)]
  lines += ['| ' + ' | '.join(str(v) for v in row) + ' |' for row in rows]
  return '\n'.join(lines)


def format_markdown(results: dict[str, Any]) -> str:
  """The results as Markdown: Table 1 layout first, then matrices and summaries."""
  num_tasks, trained = results['num_tasks'], results['trained_tasks']
  mark = lambda t: '†' if t >= trained else ''
  protocol = results['protocol']
  columns = results['table']['columns']
  method = f'{results.get("method", "CHT")} (T={trained})'
  parts = [
      f'# Evaluation of {results.get("workdir", "?")}, step {results.get("step", "?")}',
      '',
      f'{protocol["split"]} split; trained with T={trained} tasks, evaluated on '
      f'T={num_tasks}; {protocol["num_episodes"]} episodes x '
      f'{protocol["num_query_draws"]} query draws of {protocol["queries_per_class"]} '
      f'queries per class; {results["episode"]["ways"]}-way {results["episode"]["shots"]}'
      f'-shot; episode seed {protocol["seed"]}; {protocol.get("sampler", "strict")} query '
      'sampler (docs/evaluation.md). Accuracy in %, mean ± half-width of the '
      '95% confidence interval over episodes. † marks theta_t with t >= T '
      '(extrapolation).',
      '',
  ]
  for name, title in (
      ('class_incremental', 'Class-incremental accuracy of theta_t on tasks 0..t (Table 1 layout)'),
      ('task_incremental', 'Task-incremental accuracy of theta_t, mean over tasks 0..t')):
    row = results['table'][name]
    cells = [_percent(m, c) + mark(t) for t, (m, c) in enumerate(zip(row['mean'], row['ci95']))]
    parts += [f'## {title}', '', markdown_table(['Method'] + columns, [[method] + cells]), '']
  titles = {
      'task_incremental': 'Task-incremental accuracy A_ti[theta_t, task tau]',
      'class_incremental': 'Class-incremental accuracy A_ci[theta_t, task tau] '
                           '(classes of tasks 0..t, queries of tau)',
      'class_incremental_cumulative': 'Class-incremental accuracy of theta_t on tasks 0..k '
                                      '(classes of tasks 0..t)',
  }
  for name in MATRICES:
    names = task_names(num_tasks, cumulative=name.endswith('cumulative'))
    mean, ci = results[name]['mean'], results[name]['ci95']
    rows = [[f'theta_{t}{mark(t)}'] + [_percent(mean[t][k], ci[t][k]) for k in range(num_tasks)]
            for t in range(num_tasks)]
    parts += [f'## {titles[name]}', '', markdown_table([''] + names, rows), '']
  parts += ['## Continual-learning summaries (of the mean matrices; see docs/evaluation.md)', '']
  header = ['Horizon', 'Setting', 'ACC', 'AIA', 'BWT', 'Forgetting']
  rows = []
  for horizon, values in results['summaries'].items():
    for name in ('task_incremental', 'class_incremental'):
      s = values[name]
      fmt = lambda v, sign='': '' if v is None or not np.isfinite(v) else f'{100 * v:{sign}.1f}'
      rows.append([f'{horizon} (T={values["num_tasks"]})', name.replace('_', '-'),
                   fmt(s['average_accuracy']), fmt(s['average_incremental_accuracy']),
                   fmt(s['backward_transfer'], '+'), fmt(s['forgetting'], '+')])
  parts += [markdown_table(header, rows), '']
  parts += specificity_markdown(results.get('task_specificity'))
  timing = results.get('timing')
  if timing:
    parts += [f'Evaluation time: {timing["seconds"]:.1f} s ({timing["episodes_per_second"]:.2f}'
              f' episodes/s after compilation) on {timing["device"]}.', '']
  return '\n'.join(parts)


def specificity_markdown(specificity: dict[str, Any] | None) -> list[str]:
  """The task-specificity section of `format_markdown` (evaluate.summarize_specificity)."""
  if not specificity:
    return []
  s = specificity
  parts = [
      '## Task specificity: is the CNN written for its task?', '',
      f'Task-incremental accuracy of task A over {s["num_pairs"]} pairs (A, B) of disjoint '
      "tasks, with the CNN written from A's support set (own) and from B's (swapped; "
      f'swapped: {s["swap"]}), prototypes of A. About 0 where the CNN is the same for every '
      'task (docs/evaluation.md).', '',
      markdown_table(['own', 'swapped', 'own - swapped'], [[
          _percent(s['own'], s['own_ci95']), f'{100 * s["swapped"]:.1f}',
          f'{100 * s["difference"]:+.2f} ± {100 * s["ci95"]:.2f}']]), '',
      'Spread of each array of theta across tasks (std over tasks / rms; 0: not written):', '',
      markdown_table(['array', 'spread'], [[name, f'{value:.4f}']
                                           for name, value in s['spread'].items()]), '']
  return parts


def csv_rows(results: dict[str, Any]) -> list[list[Any]]:
  """Long-format rows: matrix, theta, task, task_name, mean, ci95, extrapolated."""
  rows = [['matrix', 'theta', 'task', 'task_name', 'mean', 'ci95', 'extrapolated']]
  num_tasks, trained = results['num_tasks'], results['trained_tasks']
  for name in MATRICES:
    names = task_names(num_tasks, cumulative=name.endswith('cumulative'))
    for t in range(num_tasks):
      for k in range(t + 1):
        mean, ci = results[name]['mean'][t][k], results[name]['ci95'][t][k]
        rows.append([name, t, k, names[k], '' if mean is None else f'{mean:.6f}',
                     '' if ci is None else f'{ci:.6f}', int(t >= trained)])
  return rows


# An evaluation's files (`write_results`): replaced together, never mixed with an earlier set.
RESULT_EXTENSIONS = ('.json', '.csv', '.md', '.png')


def write_results(results: dict[str, Any], path_prefix: str, plot: bool = True) -> list[str]:
  """Writes `<path_prefix>.json` (all; null where undefined), `.csv` (the matrices, long
  format), `.md` (Table 1 layout, matrices, summaries) and `.png`; returns the paths. They
  replace an earlier set of that prefix together, or (on an error) none of it is changed."""
  folder = os.path.dirname(os.path.abspath(path_prefix))
  created = [] if os.path.isdir(folder) else [folder]
  results = _jsonable(results)
  texts = {'.json': json.dumps(results, indent=1),
           '.csv': '\n'.join(','.join(str(v) for v in row) for row in csv_rows(results)) + '\n',
           '.md': format_markdown(results)}
  try:
    os.makedirs(folder, exist_ok=True)
    with _result_set(path_prefix) as staged:
      for ext, text in texts.items():
        workdir_lib.write_atomically(staged + ext, text)
      if plot:
        from cht_jax import plots  # Matplotlib only when a figure is wanted.
        plots.plot_results([results], staged + '.png')
  except OSError as e:
    raise ReportError(
        f'Writing the evaluation results in {folder} failed ({_reason(e)}). None of '
        f'{os.path.basename(path_prefix)}.* was written or changed: the results of earlier '
        'evaluations there are kept whole. Free disk space or fix the permissions of that '
        'folder, then rerun the same command.') from None
  finally:  # A folder this call made stays only with the files in it.
    workdir_lib.remove_if_empty(created)
  return [path_prefix + ext for ext in texts] + ([path_prefix + '.png'] if plot else [])


@contextlib.contextmanager
def _result_set(path_prefix: str) -> Iterator[str]:
  """A prefix in a temporary folder beside `path_prefix` to write a set of result files to,
  moved in over the earlier set (`_move_in`) when the block ends; removed if it raises."""
  folder, name = os.path.split(os.path.abspath(path_prefix))
  staging = tempfile.mkdtemp(dir=folder, prefix=f'.{name}.', suffix='.tmp')
  try:
    yield os.path.join(staging, name)
    _move_in(os.path.join(staging, name), path_prefix)
  finally:
    shutil.rmtree(staging, ignore_errors=True)


def _move_in(staged: str, path_prefix: str) -> None:
  """Replaces the files of `path_prefix` by those of `staged` (one of RESULT_EXTENSIONS that
  `staged` lacks is removed); if a rename fails, the renames done are undone."""
  aside = staged + '.earlier'  # The earlier set, in the staging folder until the end.
  done = []
  try:
    for ext in RESULT_EXTENSIONS:
      if os.path.exists(path_prefix + ext):
        os.replace(path_prefix + ext, aside + ext)
        done.append((path_prefix + ext, aside + ext))
    for ext in RESULT_EXTENSIONS:
      if os.path.exists(staged + ext):
        os.replace(staged + ext, path_prefix + ext)
        done.append((staged + ext, path_prefix + ext))
  except OSError:
    for source, target in reversed(done):
      with contextlib.suppress(OSError):
        os.replace(target, source)
    raise


class ReportError(workdir_lib.WorkdirError):
  """The result files of an evaluation cannot be written (`main` prints the message alone)."""


def check_writable(workdir: str) -> str:
  """Creates `<workdir>/eval`, checks it is writable (before evaluating) and returns it."""
  folder = os.path.join(os.path.abspath(workdir), 'eval')
  try:
    os.makedirs(folder, exist_ok=True)
    # A name of this process's own: the processes of a job may share the folder.
    probe = os.path.join(folder, f'.write_test.{socket.gethostname()}.{os.getpid()}')
    workdir_lib.write_atomically(probe, 'ok\n')
    os.remove(probe)
  except OSError as e:
    raise ReportError(
        f'Cannot write the evaluation results to {folder} ({_reason(e)}). Free disk space '
        'or make that folder writable, then rerun the same command; nothing was '
        'evaluated.') from None
  return folder


def _reason(error: OSError) -> str:
  """'No space left on device (errno 28)'."""
  return f'{error.strerror} (errno {error.errno})' if error.errno else str(error)


def result_prefix(workdir: str, protocol, step: int) -> str:
  """`<workdir>/eval/<split>_T<T_eval>_step<step>`, `_original` added for that sampler."""
  suffix = '' if getattr(protocol, 'sampler', 'strict') == 'strict' else f'_{protocol.sampler}'
  return os.path.join(workdir, 'eval',
                      f'{protocol.split}_T{protocol.num_tasks}_step{step}{suffix}')


SWEEP_NOTE = ('CI: class-incremental accuracy (%) of theta_t on tasks 0..t; TI: task-incremental, '
              'mean over tasks 0..t; mean ± 95% CI over episodes. Merged HT: only CI at 0..T-1 is '
              'its baseline number. Columns past a run\'s trained T extrapolate.')


def sweep_table(records: list[dict]) -> tuple[str, list[list[Any]]]:
  """The Markdown table and the CSV rows of launch/sweep.py's records, one row per run."""
  columns = max((r['columns'] for r in records), key=len, default=[])
  head = ['run', 'method', 'loss', 'channels', 'T', 'N', 'step', 'episodes']
  md_rows = []
  rows = [head + [f'{setting}_{c}{ci}' for setting in ('class_incremental', 'task_incremental')
                  for ci in ('', '_ci95') for c in columns] + ['final_theta_last_task']]
  fmt = lambda v: '' if v is None else f'{v:.6f}'
  for r in records:
    meta = [r['run'], r['method'], r['loss'], r['channels'], r['trained_tasks'], r['shots'],
            r['step'], r['episodes']]
    pad = lambda values: values + [None] * (len(columns) - len(values))
    ci, ti = ((pad(r[s]['mean']), pad(r[s]['ci95']))
              for s in ('class_incremental', 'task_incremental'))
    md_rows.append(meta + [_percent(m, c) for m, c in zip(*ci)]
                   + [_percent(m, c) for m, c in zip(*ti)]
                   + [_percent(r['final_theta_last_task'], None)])
    rows.append(meta + [fmt(v) for v in ci[0] + ci[1] + ti[0] + ti[1]]
                + [fmt(r['final_theta_last_task'])])
  header = (head + [f'CI {c}' for c in columns] + [f'TI {c}' for c in columns]
            + ['last θ, last task'])
  return markdown_table(header, md_rows), rows


def as_baseline(result: dict) -> dict:
  """Merged HT is one point (a star): class-incremental accuracy on tasks 0..T-1 only."""
  if result.get('method') != 'Merged HT':
    return result
  row = result['table']['class_incremental']
  last = len(row['mean']) - 1
  return {**result, 'table': {
      'columns': result['table']['columns'],
      'class_incremental': {'mean': [None] * last + row['mean'][last:],
                            'ci95': [None] * last + row['ci95'][last:]}}}


def write_sweep(records: list[dict], prefix: str, figures: bool = True) -> list[str]:
  """`<prefix>.md`, `.csv`, `.json` (a row per run) and `<prefix>_<dataset>.png` figures."""
  markdown, rows = sweep_table(records)
  table = io.StringIO(newline='')
  csv.writer(table).writerows(rows)
  texts = {'.md': markdown + '\n\n' + SWEEP_NOTE + '\n', '.csv': table.getvalue(),
           '.json': json.dumps([{k: v for k, v in r.items() if k != 'result'} for r in records],
                               indent=1)}
  paths = []
  for ext, text in texts.items():
    paths.append(prefix + ext)
    workdir_lib.write_atomically(paths[-1], text)
  if figures:
    from cht_jax import plots  # Matplotlib only when a figure is wanted.
    for dataset in sorted({r['dataset'] for r in records}):
      group = [r for r in records if r['dataset'] == dataset]
      columns = ([r['result'] for r in group if r['method'] == 'CHT']
                 or [r['result'] for r in group])
      baselines = [as_baseline(r['result']) for r in group if r['method'] != 'CHT']
      paths.append(plots.plot_results(columns, f'{prefix}_{dataset}.png', baselines=baselines))
  return paths


def fast_table1_markdown(summary: dict) -> str:
  """results.md of launch/fast_table1.py: its Table 1 row (in %) and the wall clocks."""
  row = summary['table1']
  rows = [[key.replace('_', '-')] + [f'{m:.1f} ± {c:.1f}'
                                     for m, c in zip(row[key]['mean'], row[key]['ci95'])]
          for key in ('class_incremental', 'task_incremental')]
  lines = [f"{summary['config']}, step {summary['step']}, {summary['device']}, "
           f"JAX {summary['jax']}, commit {summary['commit']}", '',
           markdown_table(['accuracy (%)'] + row['columns'], rows), '',
           f"training {summary['train_wall_seconds'] or 0:.0f} s, evaluation "
           f"{summary['eval_wall_seconds']:.0f} s (wall clock, compilation and data loading "
           'included)']
  specificity = summary.get('task_specificity')
  if specificity:
    lines += ['', f"Task specificity ({specificity['num_pairs']} pairs of test tasks): own "
              f"{100 * specificity['own']:.1f}, swapped {100 * specificity['swapped']:.1f}, "
              f"own - swapped {100 * specificity['difference']:+.2f} ± "
              f"{100 * specificity['ci95']:.2f} points"]
  return '\n'.join(lines) + '\n'


def write_fast_table1(workdir: str, summary: dict) -> list[str]:
  """`<workdir>/results.json`, `results.md` and, with a validation curve, `curve.png`."""
  paths = [os.path.join(workdir, name) for name in ('results.json', 'results.md')]
  workdir_lib.write_atomically(paths[0], json.dumps(summary, indent=1))
  workdir_lib.write_atomically(paths[1], fast_table1_markdown(summary))
  if 'validation_curve' in summary:
    from cht_jax import plots  # Matplotlib only when a figure is wanted.
    paths.append(plots.plot_curve(
        summary['validation_curve'], f"{summary['config']} on {summary['device']}, commit "
        f"{summary['commit']}", os.path.join(workdir, 'curve.png')))
  return paths


def runs_table(work: str, runs: list[str]) -> str:
  """launch/gpu_figure3.sh's table: a row per run from <work>/<run>/results.json."""
  rows = []
  for run in runs:
    path = os.path.join(work, run, 'results.json')
    if not os.path.exists(path):
      rows.append([run, '(no results)', '', '', ''])
      continue
    with open(path) as f:
      r = json.load(f)
    rows.append([r['config'], r['step'], f"{r['train_wall_seconds'] or 0:.0f}",
                 f"{r['eval_wall_seconds']:.0f}",
                 ' / '.join(f'{m:.1f}' for m in r['table1']['class_incremental']['mean'])])
  return markdown_table(['run', 'steps', 'training s', 'evaluation s',
                         'class-incremental on 0 / 0-1 / ...'], rows)


def read_levers(root: str) -> dict[str, tuple[float, list[tuple[int, float]]]]:
  """{run: (first training loss, [(step, validation accuracy)])} of the runs under `root`."""
  levers = {}
  for path in sorted(glob.glob(os.path.join(root, '*', 'metrics.jsonl'))):
    with open(path) as f:
      rows = [json.loads(line) for line in f if line.strip()]
    validation = [(r['step'], r['validation/accuracy']) for r in rows
                  if r.get('split') == 'validation']
    if validation:
      first = next((r['train/loss'] for r in rows if r.get('split') == 'train'), float('nan'))
      levers[os.path.basename(os.path.dirname(path))] = (first, validation)
  return levers


def levers_table(levers: dict[str, tuple[float, list[tuple[int, float]]]]) -> str:
  rows = [[name, f'{first:.1f}', f'{val[len(val) // 2][1]:.3f}',
           f'{val[-1][1]:.3f} ({val[-1][0]})'] for name, (first, val) in levers.items()]
  return markdown_table(['run', 'first logged loss', 'validation accuracy half way',
                         'at the end (step)'], rows)


def write_levers(root: str) -> list[str]:
  """`<root>/levers.png` (every run's validation curve) and `<root>/levers.md`."""
  from cht_jax import plots  # Matplotlib only when a figure is wanted.
  levers = read_levers(root)
  paths = [plots.plot_levers({name: val for name, (_, val) in levers.items()},
                             os.path.join(root, 'levers.png')), os.path.join(root, 'levers.md')]
  workdir_lib.write_atomically(paths[1], levers_table(levers) + '\n')
  return paths


def main(argv=None) -> None:
  """Writes the table a shell script asks for, then prints it."""
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  commands = parser.add_subparsers(dest='table', required=True)
  runs = commands.add_parser('runs_table', help='launch/gpu_figure3.sh: results.json of runs.')
  runs.add_argument('--work', required=True, help='The folder of the runs.')
  runs.add_argument('--runs', required=True, help='Run names, separated by spaces.')
  runs.add_argument('--output', required=True, help='The Markdown file to write.')
  levers = commands.add_parser('levers', help='launch/recipe_levers.sh: levers.{png,md}.')
  levers.add_argument('--root', required=True, help='The folder of the runs.')
  args = parser.parse_args(argv)
  if args.table == 'runs_table':
    workdir_lib.write_atomically(args.output, runs_table(args.work, args.runs.split()) + '\n')
    path = args.output
  else:
    path = write_levers(args.root)[1]
  with open(path) as f:
    print(f.read(), end='')


if __name__ == '__main__':
  main()
