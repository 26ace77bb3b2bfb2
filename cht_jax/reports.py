"""Result files of an evaluation: JSON, CSV, Markdown and the figure.

`write_results(results, <workdir>/eval/<split>_T<T_eval>_step<step>)` writes
what `evaluate.evaluate` returns (docs/evaluation.md describes each file). Each
file is written whole or not at all (`workdir.atomic_path`): a full disk leaves
the complete results of an earlier evaluation, never a truncated one.
"""

import json
import os
import socket
from typing import Any

import numpy as np

from cht_jax import workdir as workdir_lib

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


def _markdown_table(header: list[str], rows: list[list[str]]) -> str:
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  lines += ['| ' + ' | '.join(row) + ' |' for row in rows]
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
      '## Class-incremental accuracy of theta_t on tasks 0..t (Table 1 layout)',
      '',
  ]
  for name, title in (('class_incremental', None),
                      ('task_incremental', '## Task-incremental accuracy of theta_t, '
                       'mean over tasks 0..t')):
    if title:
      parts += [title, '']
    row = results['table'][name]
    cells = [_percent(m, c) + mark(t) for t, (m, c) in enumerate(zip(row['mean'], row['ci95']))]
    parts += [_markdown_table(['Method'] + columns, [[method] + cells]), '']
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
    parts += [f'## {titles[name]}', '', _markdown_table([''] + names, rows), '']
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
  parts += [_markdown_table(header, rows), '']
  timing = results.get('timing')
  if timing:
    parts += [f'Evaluation time: {timing["seconds"]:.1f} s ({timing["episodes_per_second"]:.2f}'
              f' episodes/s after compilation) on {timing["device"]}.', '']
  return '\n'.join(parts)


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


def write_results(results: dict[str, Any], path_prefix: str, plot: bool = True) -> list[str]:
  """Writes `<path_prefix>.json`, `.csv`, `.md` (and `.png`); returns the paths.

  The JSON holds everything (matrices as nested lists, null above the
  diagonal and for undefined values); the CSV the three matrices in long
  format; the Markdown the Table 1 layout, the matrices and the summaries; the
  PNG the task- and class-incremental panels (`plots.plot_results`).
  """
  folder = os.path.dirname(os.path.abspath(path_prefix))
  results = _jsonable(results)
  texts = {'.json': json.dumps(results, indent=1),
           '.csv': '\n'.join(','.join(str(v) for v in row) for row in csv_rows(results)) + '\n',
           '.md': format_markdown(results)}
  paths = [path_prefix + ext for ext in texts]
  try:
    os.makedirs(folder, exist_ok=True)
    for path, text in zip(paths, texts.values()):
      workdir_lib.write_atomically(path, text)
    if plot:
      from cht_jax import plots  # Matplotlib only when a figure is wanted.
      paths.append(path_prefix + '.png')
      with workdir_lib.atomic_path(paths[-1]) as partial:
        plots.plot_results([results], partial)
  except OSError as e:
    raise ReportError(
        f'Writing the evaluation results in {folder} failed ({_reason(e)}). No partial '
        'file is left under a result name, and the results of earlier evaluations there '
        'are kept. Free disk space or fix the permissions of that folder, then rerun the '
        'same command.') from None
  return paths


class ReportError(workdir_lib.WorkdirError):
  """The result files of an evaluation cannot be written (a WorkdirError: `main` prints
  its message alone)."""


def check_writable(workdir: str) -> str:
  """Creates `<workdir>/eval` (where `result_prefix` puts the results) and checks a file
  can be written there: before evaluating, not after.

  Returns:
    The folder.

  Raises:
    ReportError: naming the folder, the reason and what to do.
  """
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
