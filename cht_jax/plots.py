r"""Figures of evaluation results, like the paper's Figures 3 and 4.

  python -m cht_jax.plots --results=t2.json,t3.json,t4.json,t5.json --output=fig.png \
      [--baselines=constpn.json,merged_ht.json]

A column per result file (sorted by trained T), a row per setting: task-incremental (Figure 3:
theta_t on each task tau <= t) and class-incremental (Figure 4: on tasks 0..k, k <= t); open
diamonds mark extrapolated theta_t, error bars 95% CIs. A baseline file needs only 'method' and
'table' ({setting: {'mean': [...]}}, a value per column "0", "0-1", ...).
"""

import json
from typing import Any, Sequence

from absl import app
from absl import flags
from matplotlib import figure as figure_lib
from matplotlib import lines as lines_lib
import numpy as np

from cht_jax.runtime import workdir

FLAGS = flags.FLAGS
SETTINGS = ('task_incremental', 'class_incremental')
PROJECTORS = ('umap', 'pca')
_TITLES = {'task_incremental': 'Task-incremental', 'class_incremental': 'Class-incremental'}
_BASELINE_STYLES = {
    'ConstPN': dict(color='black', linestyle='--', marker=None),
    'Merged HT': dict(color='tab:blue', linestyle='none', marker='*', markersize=11),
}
_OTHER_BASELINE = dict(color='grey', linestyle=':', marker=None)


def _save(fig: figure_lib.Figure, output: str, dpi: int) -> str:
  """Writes `fig` to `output` whole or not at all (`workdir.atomic_path`)."""
  with workdir.atomic_path(output) as tmp:
    fig.savefig(tmp, dpi=dpi)
  return output


def load_results(paths: Sequence[str]) -> list[dict[str, Any]]:
  results = []
  for path in paths:
    with open(path) as f:
      results.append(json.load(f))
  return results


def _values(matrix: dict, t: int, count: int):
  """Row t of a {'mean', 'ci95'} matrix, first `count` entries, in %."""
  mean = np.array([np.nan if v is None else v for v in matrix['mean'][t][:count]], float)
  ci = np.array([np.nan if v is None else v for v in matrix['ci95'][t][:count]], float)
  return 100 * mean, 100 * np.nan_to_num(ci)


def plot_panel(ax, result: dict[str, Any], setting: str,
               baselines: Sequence[dict[str, Any]] = ()) -> None:
  """One panel on Axes `ax`: the curves of every theta_t of one result, and baselines; x is
  task tau for 'task_incremental', tasks 0..k for 'class_incremental'."""
  if setting not in SETTINGS:
    raise ValueError(f'setting must be one of {SETTINGS}, got {setting!r}.')
  num_tasks, trained = result['num_tasks'], result['trained_tasks']
  matrix = result['task_incremental' if setting == 'task_incremental'
                  else 'class_incremental_cumulative']
  for t in range(num_tasks):
    mean, ci = _values(matrix, t, t + 1)
    extrapolated = t >= trained
    dodge = 0.06 * (t - (num_tasks - 1) / 2)  # Keeps overlapping error bars apart.
    ax.errorbar(np.arange(t + 1) + dodge, mean, yerr=ci, color=f'C{t % 10}', capsize=2,
                marker='D' if extrapolated else 'o', markersize=5,
                markerfacecolor='white' if extrapolated else f'C{t % 10}',
                linestyle='--' if extrapolated else '-', linewidth=1.2)
  for baseline in baselines:
    row = baseline['table'].get(setting)
    if row is None:
      continue
    values = 100 * np.array([np.nan if v is None else v for v in row['mean']], float)[:num_tasks]
    style = _BASELINE_STYLES.get(baseline.get('method'), _OTHER_BASELINE)
    ax.plot(np.arange(len(values)), values, **style)
  cumulative = setting == 'class_incremental'
  ax.set_xticks(np.arange(num_tasks))
  ax.set_xticklabels([f'0-{k}' if cumulative and k else str(k) for k in range(num_tasks)])
  ax.set_xlim(-0.4, num_tasks - 0.6)
  ax.grid(alpha=0.3)


def _legend_handles(max_tasks: int, baselines: Sequence[dict[str, Any]]):
  handles = [lines_lib.Line2D([], [], color=f'C{t % 10}', marker='o', label=f'θ_{t}')
             for t in range(max_tasks)]
  handles += [
      lines_lib.Line2D([], [], color='grey', marker='o', linestyle='-', label='trained (t < T)'),
      lines_lib.Line2D([], [], color='grey', marker='D', markerfacecolor='white',
                       linestyle='--', label='extrapolated (t ≥ T)')]
  for method in dict.fromkeys(baseline.get('method', 'baseline') for baseline in baselines):
    handles.append(lines_lib.Line2D(
        [], [], label=method, **_BASELINE_STYLES.get(method, _OTHER_BASELINE)))
  return handles


def plot_results(results: Sequence[dict[str, Any]], output: str,
                 baselines: Sequence[dict[str, Any]] = (),
                 settings: Sequence[str] = SETTINGS) -> str:
  """Writes the figure of `results` (a column each; `settings`: the rows; `baselines` in every
  panel) to `output` (PNG, PDF, SVG...); returns it."""
  if not results:
    raise ValueError('plot_results needs at least one result.')
  results = sorted(results, key=lambda r: (r['trained_tasks'], r['num_tasks']))
  rows, cols = len(settings), len(results)
  fig = figure_lib.Figure(figsize=(3.2 * cols + 0.6, 2.8 * rows + 0.9))
  axes = np.asarray(fig.subplots(rows, cols, squeeze=False, sharey='row'))
  for i, setting in enumerate(settings):
    for j, result in enumerate(results):
      ax = axes[i, j]
      plot_panel(ax, result, setting, baselines)
      if i == 0:
        ax.set_title(f'T={result["trained_tasks"]} tasks')
      if j == 0:
        ax.set_ylabel(f'{_TITLES[setting]}\naccuracy (%)')
      if i == rows - 1:
        ax.set_xlabel('Task name')
  max_tasks = max(r['num_tasks'] for r in results)
  handles = _legend_handles(max_tasks, baselines)
  ncol = min(len(handles), max(2, 3 * cols))
  legend_rows = -(-len(handles) // ncol)
  fig.legend(handles=handles, loc='lower center', ncol=ncol, fontsize='small', frameon=False)
  fig.tight_layout(rect=(0, min(0.4, 0.3 * legend_rows / fig.get_figheight()), 1, 1))
  return _save(fig, output, dpi=120)


def plot_curve(curve: dict[str, list[float]], title: str, output: str) -> str:
  """Validation accuracy against training episodes and wall clock (launch/fast_table1.py)."""
  fig = figure_lib.Figure(figsize=(10, 3.8))
  axes = fig.subplots(1, 2, sharey=True)
  for ax, x, label in ((axes[0], curve['episodes'], 'training episodes'),
                       (axes[1], curve['seconds'],
                        'training wall clock, compilation included (s)')):
    ax.plot(x, curve['accuracy'], marker='o')
    ax.set_xlabel(label)
    ax.grid(alpha=0.3)
  axes[0].set_ylabel('validation accuracy')
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  return _save(fig, output, dpi=110)


def plot_levers(curves: dict[str, list[tuple[int, float]]], output: str) -> str:
  """One validation curve per run, {run: [(step, accuracy)]} (launch/recipe_levers.sh)."""
  fig = figure_lib.Figure(figsize=(7, 4.2))
  ax = fig.subplots()
  for name, points in curves.items():
    ax.plot(*zip(*points), marker='.', label=name)
  ax.set_xlabel('training episodes (T=2, 1 per step)')
  ax.set_ylabel('validation accuracy (class-incr., mean over pairs)')
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  return _save(fig, output, dpi=110)


def project_2d(points: np.ndarray, projector: str = 'umap', seed: int = 0) -> np.ndarray:
  """[N, D] -> [N, 2] with UMAP (ImportError without `umap-learn`) or PCA."""
  if projector == 'umap':
    try:
      import umap  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError("projector='umap' needs umap-learn (pip install umap-learn); "
                        "projector='pca' needs nothing.") from e
    neighbours = max(2, min(15, len(points) - 1))
    reducer = umap.UMAP(n_components=2, n_neighbors=neighbours, random_state=seed)
    return reducer.fit_transform(points)
  if projector == 'pca':
    centred = points - points.mean(axis=0)
    _, _, vt = np.linalg.svd(centred, full_matrices=False)
    return centred @ vt[:2].T
  raise ValueError(f'projector must be one of {PROJECTORS}, got {projector!r}.')


def procrustes_align(points: np.ndarray, anchors: np.ndarray, targets: np.ndarray) -> np.ndarray:
  """Moves 2-D `points` [N, 2] by the similarity map taking `anchors` [A, 2] closest to
  `targets` [A, 2]: least-squares orthogonal Procrustes with one scale."""
  anchor_mean, target_mean = anchors.mean(axis=0), targets.mean(axis=0)
  a, b = anchors - anchor_mean, targets - target_mean
  u, singular, vt = np.linalg.svd(a.T @ b)
  rotation = u @ vt
  scale = singular.sum() / max(float(np.sum(a * a)), 1e-12)
  return (points - anchor_mean) @ rotation * scale + target_mean


def plot_embeddings(prototypes: np.ndarray, query_embeddings: np.ndarray,
                    query_labels: np.ndarray, output: str, trained_tasks: int | None = None,
                    projector: str = 'umap', seed: int = 0) -> str:
  """The appendix figure: panel t projects ('umap' or 'pca') the frozen prototypes [T, K, D] of
  tasks 0..t and `query_embeddings` [P, Q, D] of the pairs (t, tau <= t) (t-major; labels
  [T, Q]), aligned by Procrustes to panel t-1; dashed lines join queries to prototypes."""
  num_tasks, num_ways, _ = prototypes.shape
  t_of_pair, tau_of_pair = np.tril_indices(num_tasks)
  fig = figure_lib.Figure(figsize=(3.2 * num_tasks, 3.6))
  axes = np.asarray(fig.subplots(1, num_tasks, squeeze=False))[0]
  previous = None
  for t in range(num_tasks):
    rows = np.nonzero(t_of_pair == t)[0]  # Pairs (t, 0..t).
    protos = prototypes[:t + 1].reshape(-1, prototypes.shape[-1])
    queries = np.concatenate([query_embeddings[p] for p in rows])
    flat = project_2d(np.concatenate([protos, queries]).astype(np.float64), projector, seed)
    if previous is not None:
      shared = num_ways * t
      flat = procrustes_align(flat, flat[:shared], previous[:shared])
    previous = flat
    proto_2d, query_2d = flat[:len(protos)], flat[len(protos):]
    ax = axes[t]
    offset = 0
    for p in rows:
      tau = tau_of_pair[p]
      count = query_embeddings.shape[1]
      points = query_2d[offset:offset + count]
      offset += count
      targets = proto_2d[tau * num_ways + np.asarray(query_labels[tau])]
      for start, end in zip(points, targets):
        ax.plot([start[0], end[0]], [start[1], end[1]], color=f'C{tau % 10}', alpha=0.25,
                linewidth=0.5, linestyle='--')
      ax.scatter(points[:, 0], points[:, 1], s=8, color=f'C{tau % 10}', alpha=0.7)
      ax.scatter(proto_2d[tau * num_ways:(tau + 1) * num_ways, 0],
                 proto_2d[tau * num_ways:(tau + 1) * num_ways, 1], s=60, marker='*',
                 color=f'C{tau % 10}', edgecolors='black', linewidths=0.6, label=f'task {tau}')
    extrapolated = trained_tasks is not None and t >= trained_tasks
    ax.set_title(f'θ_{t}' + (' (extrapolated)' if extrapolated else ''))
    ax.set_xticks([])
    ax.set_yticks([])
  axes[-1].legend(fontsize='small', loc='best')
  fig.suptitle(f'{projector.upper()} of prototypes (stars) and queries, aligned by Procrustes')
  fig.tight_layout()
  return _save(fig, output, dpi=120)


def _define_flags():
  """Only when run as a script: a library import must not claim flag names."""
  flags.DEFINE_list('results', None, 'Evaluation result JSON files, one column each.')
  flags.DEFINE_list('baselines', [], 'Baseline JSON files (ConstPN, Merged HT, ...).')
  flags.DEFINE_list('settings', list(SETTINGS), 'Rows: task_incremental, class_incremental.')
  flags.DEFINE_string('output', 'figure.png', 'Where to write the figure.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS.results:
    raise app.UsageError('--results=a.json,b.json is required.')
  path = plot_results(load_results(FLAGS.results), FLAGS.output,
                      load_results(FLAGS.baselines), FLAGS.settings)
  print(f'Wrote {path}')


if __name__ == '__main__':
  _define_flags()
  app.run(main)
