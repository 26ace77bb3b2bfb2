r"""The paper's evaluation protocol, from an Orbax checkpoint, and its result files.

  python -m cht_jax.main --mode=eval --config=configs/omniglot_t5.py --workdir=DIR \
      [--eval_tasks=5] [--checkpoint_step=N] [--eval_split=test]

Protocol (DESIGN.md 1.5): `num_episodes` episodes of T_eval tasks drawn from
the split (test by default) with a seed of their own, so that every model is
scored on the same episodes. For each episode the HyperTransformer generates
theta_0..theta_{T_eval-1} and the frozen prototypes once from the support
sets; then, `num_query_draws` times, Q queries per class are drawn from the
images outside the support set and every pair (theta_t, task tau <= t) is
scored:
  task-incremental  A_ti[t, tau]: softmax over the K classes of tau (eq. 5);
  class-incremental A_ci[t, tau]: softmax over the classes of tasks 0..t
                    (eq. 6), counted on the queries of tau.
Each per-episode entry is the mean over the query draws; results are the mean
over episodes and the half-width of its 95% confidence interval,
1.96 * std / sqrt(num_episodes) (`metrics.mean_and_ci`). T_eval may exceed the
T the model was trained with (extrapolation).

Result files, `<workdir>/eval/<split>_T<T_eval>_step<step>.{json,csv,md,png}`:
see `write_results` and docs/evaluation.md.
"""

import dataclasses
import functools
import json
import math
import os
import time
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from cht_jax import continual
from cht_jax import devices
from cht_jax import methods
from cht_jax import metrics
from cht_jax import train
from cht_jax.data import datasets
from cht_jax.data import episodes as episodes_lib

DEFAULT_SEED = 0  # Evaluation episodes; independent of config.seed.
MATRICES = ('task_incremental', 'class_incremental', 'class_incremental_cumulative')


class EvaluationError(ValueError):
  """The protocol cannot run as asked (e.g. the split has too few classes)."""


# Errors whose message is the whole story: `main` prints them without traceback.
USER_ERRORS = train.USER_ERRORS + (EvaluationError,)


@dataclasses.dataclass(frozen=True)
class Protocol:
  """What to evaluate on.

  Attributes:
    num_tasks: T_eval, tasks per episode (may exceed the trained T).
    queries_per_class: Q, queries per class in each draw.
    num_episodes: episodes (each with its own support sets).
    num_query_draws: query draws per episode, on the same support sets.
    split: 'test' or 'validation' (or 'train').
    seed: seeds the episodes (not the model).
    batch_size: episodes per jit call; memory grows with it, not the results.
  """
  num_tasks: int
  queries_per_class: int
  num_episodes: int = 1024
  num_query_draws: int = 16
  split: str = 'test'
  seed: int = DEFAULT_SEED
  batch_size: int = 8

  def __post_init__(self):
    for name in ('num_tasks', 'queries_per_class', 'num_episodes', 'num_query_draws',
                 'batch_size'):
      if getattr(self, name) < 1:
        raise EvaluationError(f'Evaluation {name} must be >= 1, got {getattr(self, name)}.')
    if self.split not in ('train', 'validation', 'test'):
      raise EvaluationError(f"Evaluation split must be 'train', 'validation' or 'test', "
                       f'got {self.split!r}.')


def default_protocol(config: ml_collections.ConfigDict, **overrides) -> Protocol:
  """The paper's protocol for `config`; overrides that are None keep the default.

  T_eval and Q default to the config's episode.num_tasks and
  episode.queries_per_class.
  """
  values = dict(num_tasks=config.episode.num_tasks,
                queries_per_class=config.episode.queries_per_class)
  values.update({k: v for k, v in overrides.items() if v is not None})
  return Protocol(**values)


def _split_and_spec(config, protocol: Protocol, class_images):
  """The split's images (loaded when None) and the evaluation spec over them."""
  domain_sizes = ()
  if class_images is None:
    dataset = train.load_dataset(config)
    class_images = dataset[protocol.split]
    domain_sizes = dataset.get('domain_sizes', {}).get(protocol.split, ())
  return class_images, evaluation_spec(config, protocol, domain_sizes)


def evaluation_spec(config: ml_collections.ConfigDict, protocol: Protocol,
                    domain_sizes: tuple[int, ...] = ()) -> episodes_lib.EpisodeSpec:
  """The training episode spec with T_eval tasks and Q queries per class.

  `domain_sizes`: classes of each domain in the split (task_classes='domain').
  """
  return train.episode_spec(config, domain_sizes)._replace(
      num_tasks=protocol.num_tasks, queries_per_class=protocol.queries_per_class)


# --------------------------------------------------------------------------
# Checkpoints.
# --------------------------------------------------------------------------


def abstract_params(config: ml_collections.ConfigDict) -> Any:
  """ShapeDtypeStructs of the parameters of `config` (its HyperTransformer, or baseline)."""
  ht = methods.build(config)
  state = jax.eval_shape(lambda: train.init_state(
      config, ht, train.make_optimizer(config.optim), jax.random.key(0),
      datasets.image_shape(config)))
  return state.params


def restore_params(workdir: str, config: ml_collections.ConfigDict,
                   step: int | None = None) -> tuple[Any, int]:
  """The HyperTransformer parameters of a checkpoint written by training.

  Only the parameters must fit `config`: the optimiser state is read and
  dropped, so a config that differs from the training one in the optimiser
  still restores.

  Args:
    workdir: the training workdir (checkpoints in `<workdir>/checkpoints`).
    config: the config the model was trained with.
    step: the checkpoint step; None for the latest.

  Returns:
    (params, step).

  Raises:
    train.CheckpointError: no checkpoint (at `step`), or parameters that do
      not fit the model of `config` (the differing arrays are named).
  """
  if not os.path.isdir(os.path.join(workdir, 'checkpoints')):
    raise train.CheckpointError(
        f'No checkpoint in {os.path.abspath(workdir)}: it has no checkpoints/ folder. '
        'Pass the --workdir of a trained model, or train one first (python -m '
        f'cht_jax.main --config=... --workdir={workdir}).')
  manager = train.checkpoint_manager(workdir, config)
  try:
    steps = sorted(manager.all_steps())
    if not steps:
      raise train.CheckpointError(
          f'No complete checkpoint in {manager.directory}. Pass the --workdir of a '
          f'trained model, or train one first (python -m cht_jax.main --config=... '
          f'--workdir={workdir}).')
    if step is None:
      step = steps[-1]
    elif step not in steps:
      raise train.CheckpointError(
          f'No checkpoint of step {step} in {manager.directory}; it has steps {steps}. '
          'Pass one of them as --checkpoint_step, or leave it out for the latest.')
    expected = {'params': abstract_params(config)}
    try:
      problems = [p for p in train.checkpoint_mismatches(manager, step, expected)
                  if p.startswith('params/')]
      restored = None if problems else manager.restore(step, args=ocp.args.StandardRestore())
    except Exception as e:  # pylint: disable=broad-except
      raise train.CheckpointError(
          f'Cannot read the checkpoint of step {step} in {manager.directory} '
          f'({type(e).__name__}: {" ".join(str(e).split())[:300]}). Pass another '
          f'--checkpoint_step (steps there: {steps}).') from None
    if problems:
      raise train.CheckpointError(
          f'The checkpoint of step {step} in {manager.directory} does not fit this '
          f'config: {len(problems)} parameter arrays differ ({"; ".join(problems[:3])}'
          f'{"; ..." if len(problems) > 3 else ""}). Evaluate with the config (and '
          '--config.* overrides) the model was trained with; training saved it as '
          f'{os.path.join(os.path.abspath(workdir), "config.json")}.')
  finally:
    manager.close()
  params = jax.tree.map(jnp.asarray, restored['params'])
  logging.info('Restored the parameters of step %d from %s.', step, manager.directory)
  return params, step


# --------------------------------------------------------------------------
# The protocol.
# --------------------------------------------------------------------------


def embed_query_draws(ht, thetas, query_images: jax.Array, pairs: continual.TaskPairs,
                      vectorize: bool) -> jax.Array:
  """Embeds every query draw of every task with every theta_t, t >= tau.

  `continual.embed_queries` for each draw (each draw of Q(tau) is a batch of
  its own for BatchNorm): on CPU, one draw and one pair at a time
  (`vectorize=False`) keeps each batch in cache and runs ~3x faster than
  vmapping them (measured, docs/evaluation.md); accelerators want everything
  vmapped.

  Args:
    ht: the HyperTransformer (its `.cnn` is applied).
    thetas: theta_0..theta_{T-1}, leaves with a leading T axis.
    query_images: [R, T, K*Q, H, W, C].
    pairs: `TaskPairs.lower_triangle(T)`.
    vectorize: vmap over pairs and draws instead of looping.

  Returns:
    [P, R, K*Q, D].
  """
  embed_draw = lambda images: continual.embed_queries(
      ht, thetas, images, pairs, remat=False, vectorize=vectorize)
  embeddings = jax.lax.map(embed_draw, query_images,
                           batch_size=query_images.shape[0] if vectorize else None)
  return jnp.swapaxes(embeddings, 0, 1)


def episode_accuracies(ht, params, episode, pairs: continual.TaskPairs,
                       vectorize: bool = False):
  """Accuracies of every (theta_t, tau <= t) pair on one evaluation episode.

  Args:
    ht, params: the method (`methods.build`; a bare HyperTransformer is CHT)
      and its parameters.
    episode: from `episodes.sample_evaluation_episode`: support [T, K*N, ...],
      query_images [R, T, K*Q, H, W, C], query_labels [T, K*Q].
    pairs: `TaskPairs.lower_triangle(T)`.
    vectorize: see `embed_query_draws`.

  Returns:
    (task_incremental [P], class_incremental [P]): mean over the R draws of
    the accuracy on the K*Q queries of tau under theta_t, pair p = (t, tau).
    For a method with `head_logits` (loss='cross_entropy') the task-incremental
    accuracy is that of the head's K logits.
  """
  method = methods.as_method(ht)
  thetas, prototypes = method.thetas_and_prototypes(
      params, episode['support_images'], episode['support_labels'], remat=False)
  embeddings = embed_query_draws(method, thetas, episode['query_images'], pairs, vectorize)

  def score(loss):  # Mean over draws of the accuracy of each pair: [P].
    accuracy = jax.vmap(
        lambda e: continual.pair_losses(loss, e, episode['query_labels'], prototypes, pairs)[1],
        in_axes=1)(embeddings)
    return accuracy.mean(axis=0)

  return score(method.task_incremental_score), score('class_incremental')


@functools.lru_cache(maxsize=8)
def make_evaluate_batch(ht, spec: episodes_lib.EpisodeSpec, num_query_draws: int,
                        vectorize: bool | None = None, mesh: jax.sharding.Mesh | None = None):
  """jit(fn)(params, class_images, key, indices [B]) -> (task_inc, class_inc) [B, P].

  Cached: evaluating several checkpoints of one model compiles once.

  Episode i is drawn from fold_in(key, i): the same episodes whatever the
  batch size, the number of devices and the model. The batch is split over
  the devices of `mesh` (`shard_map`; B must be a multiple of their number),
  each device running its episodes on its own.

  Args:
    ht: the HyperTransformer.
    spec: the evaluation episode spec (T_eval tasks).
    num_query_draws: R.
    vectorize: vmap over episodes, pairs and draws (accelerators) instead of
      looping over them (CPU); None picks by `jax.default_backend()`.
    mesh: a 1-D mesh with axis 'data'; None for all devices.
  """
  pairs = continual.TaskPairs.lower_triangle(spec.num_tasks)
  if vectorize is None:
    vectorize = continual.default_vectorize()
  mesh = mesh or devices.data_mesh()

  def evaluate_shard(params, class_images, key, indices):
    def one(index):
      episode = episodes_lib.sample_evaluation_episode(
          jax.random.fold_in(key, index), class_images, spec, num_query_draws)
      return episode_accuracies(ht, params, episode, pairs, vectorize)
    return jax.lax.map(one, indices, batch_size=len(indices) if vectorize else None)

  replicated, batch = jax.P(), jax.P('data')
  return jax.jit(jax.shard_map(
      evaluate_shard, mesh=mesh, in_specs=(replicated, replicated, replicated, batch),
      out_specs=batch, check_vma=False))


def run_protocol(ht, params, class_images, spec: episodes_lib.EpisodeSpec,
                 protocol: Protocol, vectorize: bool | None = None) -> dict[str, Any]:
  """Runs the protocol in batches of episodes.

  Args:
    ht, params: the HyperTransformer and its parameters.
    class_images: uint8 [C, M, H, W, D] of the evaluation split.
    spec: from `evaluation_spec`.
    protocol: the protocol.
    vectorize: see `make_evaluate_batch`.

  Returns:
    'task_incremental', 'class_incremental': float64 [E, T, T] per-episode
    accuracy matrices (NaN above the diagonal); 'timing': seconds (total,
    first batch with compilation) and episodes_per_second (after the first
    batch).
  """
  evaluate_batch = make_evaluate_batch(ht, spec, protocol.num_query_draws, vectorize)
  return run_batches(evaluate_batch, params, class_images, spec, protocol, jax.device_count())


def run_batches(evaluate_batch, params, class_images, spec: episodes_lib.EpisodeSpec,
                protocol: Protocol, num_shards: int) -> dict[str, Any]:
  """Runs the protocol's episodes through `evaluate_batch`, in batches.

  `evaluate_batch(params, class_images, key, indices [B])` -> (task-incremental,
  class-incremental) accuracies [B, P] of episodes `indices` (`make_evaluate_batch`,
  or a baseline's); batches are whole multiples of `num_shards` (the devices it
  spreads them over). Returns what `run_protocol` does.
  """
  try:
    episodes_lib.validate_spec(spec, np.shape(class_images))
  except ValueError as e:
    raise EvaluationError(
        f'Cannot draw {protocol.split} episodes of {spec.num_tasks} tasks with '
        f'{spec.queries_per_class} queries per class: {e} Lower --eval_tasks or '
        '--eval_queries_per_class, or use --eval_split=test.') from None
  class_images = jnp.asarray(class_images)
  # Uncommitted copies: restored parameters sit on one device, and the batch
  # may spread over several (one per core on CPU, cht_jax/devices.py).
  params = jax.tree.map(jnp.asarray, jax.device_get(params))
  key = jax.random.key(protocol.seed)
  # Whole multiples of the device count, at most what is needed.
  num = protocol.num_episodes
  size = num_shards * math.ceil(min(protocol.batch_size, num) / num_shards)
  num_batches = math.ceil(num / size)
  pairs = continual.TaskPairs.lower_triangle(spec.num_tasks)
  outputs = []
  start = time.perf_counter()
  first_seconds = None
  for b in range(num_batches):
    # The last batch is padded with episodes past `num`, dropped below: one
    # compiled shape for all batches.
    indices = jnp.arange(b * size, (b + 1) * size, dtype=jnp.int32)
    outputs.append(jax.device_get(evaluate_batch(params, class_images, key, indices)))
    if first_seconds is None:
      first_seconds = time.perf_counter() - start
    done = min((b + 1) * size, num)
    if b == num_batches - 1 or (b + 1) % max(1, num_batches // 10) == 0:
      elapsed = time.perf_counter() - start
      logging.info('Evaluated %d/%d episodes, %.1f s, %.2f episodes/s.', done, num,
                   elapsed, done / elapsed)
  total = time.perf_counter() - start
  steady = (num_batches - 1) * size
  rate = steady / (total - first_seconds) if steady else num / total
  result = {'timing': {'seconds': total, 'first_batch_seconds': first_seconds,
                       'episodes_per_second': rate,
                       'device': f'{num_shards} x {jax.devices()[0].device_kind}'}}
  for i, name in enumerate(('task_incremental', 'class_incremental')):
    per_pair = np.concatenate([o[i] for o in outputs])[:num].astype(np.float64)
    matrix = np.full((num, spec.num_tasks, spec.num_tasks), np.nan)
    matrix[:, pairs.t, pairs.tau] = per_pair
    result[name] = matrix
  return result


# --------------------------------------------------------------------------
# Results.
# --------------------------------------------------------------------------


def task_names(num_tasks: int, cumulative: bool) -> list[str]:
  """'0', '1', ... or, for accuracies on tasks 0..k, '0', '0-1', '0-2', ..."""
  if cumulative:
    return ['0'] + [f'0-{k}' for k in range(1, num_tasks)]
  return [str(k) for k in range(num_tasks)]


def summarize(per_episode: dict[str, np.ndarray], trained_tasks: int) -> dict[str, Any]:
  """Means, confidence intervals, Table 1 rows and summaries of per-episode matrices.

  Args:
    per_episode: 'task_incremental', 'class_incremental': [E, T, T].
    trained_tasks: the T the model was trained with; theta_t with
      t >= trained_tasks is an extrapolation.

  Returns:
    A JSON-ready dict (NumPy arrays; see `write_results`).
  """
  num_tasks = per_episode['task_incremental'].shape[-1]
  per_episode = dict(per_episode)
  per_episode['class_incremental_cumulative'] = metrics.cumulative_accuracy(
      per_episode['class_incremental'])
  task_cumulative = metrics.cumulative_accuracy(per_episode['task_incremental'])
  out = {'num_tasks': num_tasks, 'trained_tasks': trained_tasks,
         'num_episodes': per_episode['task_incremental'].shape[0]}
  for name in MATRICES:
    mean, ci = metrics.mean_and_ci(per_episode[name])
    out[name] = {'mean': mean, 'ci95': ci}
  diagonal = lambda m: np.diagonal(m, axis1=-2, axis2=-1)
  rows = {
      'class_incremental': diagonal(per_episode['class_incremental_cumulative']),
      'task_incremental': diagonal(task_cumulative),
  }
  out['table'] = {'columns': task_names(num_tasks, cumulative=True)}
  for name, values in rows.items():
    mean, ci = metrics.mean_and_ci(values)
    out['table'][name] = {'mean': mean, 'ci95': ci}
  horizons = {'evaluated': num_tasks}
  if trained_tasks < num_tasks:
    horizons['trained'] = trained_tasks
  out['summaries'] = {}
  for horizon, size in horizons.items():
    out['summaries'][horizon] = {'num_tasks': size}
    for name in ('task_incremental', 'class_incremental'):
      matrix = out[name]['mean'][:size, :size]
      out['summaries'][horizon][name] = metrics.summaries(matrix)
  return out


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
      f'-shot; episode seed {protocol["seed"]}. Accuracy in %, mean ± half-width of the '
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
  os.makedirs(os.path.dirname(os.path.abspath(path_prefix)), exist_ok=True)
  results = _jsonable(results)
  paths = [path_prefix + ext for ext in ('.json', '.csv', '.md')]
  with open(paths[0], 'w') as f:
    json.dump(results, f, indent=1)
  with open(paths[1], 'w') as f:
    f.write('\n'.join(','.join(str(v) for v in row) for row in csv_rows(results)) + '\n')
  with open(paths[2], 'w') as f:
    f.write(format_markdown(results))
  if plot:
    from cht_jax import plots  # Matplotlib only when a figure is wanted.
    paths.append(path_prefix + '.png')
    plots.plot_results([results], paths[-1])
  return paths


def evaluate(config: ml_collections.ConfigDict, params: Any, protocol: Protocol,
             class_images: np.ndarray | None = None) -> dict[str, Any]:
  """Runs the protocol on `params` and summarises it (no files).

  Args:
    config: the training config (model, episode shape, data).
    params: HyperTransformer parameters.
    protocol: see `Protocol`.
    class_images: uint8 [C, M, H, W, 1] of the split; None to load
      `protocol.split` with `train.load_dataset(config)`.

  Returns:
    The `summarize` dict plus 'protocol', 'episode' and 'timing'.
  """
  if config.loss == 'cross_entropy':
    logging.warning('config.loss is cross_entropy: task-incremental accuracy from the '
                    "head's logits, class-incremental from prototypes of the head outputs.")
  ht = methods.build(config)
  if ht.max_eval_tasks is not None and protocol.num_tasks > ht.max_eval_tasks:
    raise EvaluationError(
        f'{methods.display_name(config)} was trained for {ht.max_eval_tasks} tasks merged '
        f'into one and cannot be evaluated on {protocol.num_tasks}; use --eval_tasks <= '
        f'{ht.max_eval_tasks}.')
  class_images, spec = _split_and_spec(config, protocol, class_images)
  logging.info('Evaluating on %s: %s.', protocol.split, protocol)
  per_episode = run_protocol(ht, params, class_images, spec, protocol)
  results = summarize(per_episode, trained_tasks=config.episode.num_tasks)
  results['protocol'] = dataclasses.asdict(protocol)
  results['episode'] = spec._asdict()
  results['timing'] = per_episode['timing']
  if methods.method_name(config) == 'merged_ht':
    results['note'] = ('Merged HT: one HT given all tasks at once; only the class-incremental '
                       'accuracy of theta_{T-1} on tasks 0..T-1 is the baseline (theta_t for '
                       't < T-1 has seen the support sets of later tasks).')
  logging.info('Evaluation took %.1f s, %.2f episodes/s after compilation.',
               results['timing']['seconds'], results['timing']['episodes_per_second'])
  logging.info('Class-incremental accuracy of theta_t on tasks 0..t: %s',
               ', '.join(f'{c} {100 * m:.1f}%' for c, m in zip(
                   results['table']['columns'], results['table']['class_incremental']['mean'])))
  return results


def result_prefix(workdir: str, protocol: Protocol, step: int) -> str:
  """`<workdir>/eval/<split>_T<T_eval>_step<step>`."""
  return os.path.join(workdir, 'eval', f'{protocol.split}_T{protocol.num_tasks}_step{step}')


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str,
                        step: int | None = None, plot: bool = True,
                        embeddings: str | None = None,
                        **protocol_overrides) -> tuple[dict[str, Any], list[str]]:
  """Restores a checkpoint of `workdir`, runs the protocol and writes the result files.

  Args:
    config: the config the model was trained with.
    workdir: the training workdir.
    step: the checkpoint step; None for the latest.
    plot: also write the PNG.
    embeddings: also write `<prefix>_embeddings.png` (`embedding_report`)
      with projector 'umap' or 'pca'; None for no report.
    **protocol_overrides: `Protocol` fields (None keeps the default).

  Returns:
    (results, paths of the written files). Headline numbers also go to the
    workdir's metrics log under the split `eval_<split>_T<T_eval>`.
  """
  params, step = restore_params(workdir, config, step)
  protocol = default_protocol(config, **protocol_overrides)
  results = evaluate(config, params, protocol)
  results.update(method=methods.display_name(config), workdir=os.path.abspath(workdir), step=step,
                 config=json.loads(config.to_json_best_effort()))
  prefix = result_prefix(workdir, protocol, step)
  paths = write_results(results, prefix, plot=plot)
  if embeddings:
    report = embedding_report(config, params, protocol, prefix + '_embeddings.png', embeddings)
    paths += [report] if report else []
  logging.info('Wrote %s.', ', '.join(paths))
  log = train.MetricsLog(workdir)
  scalars = {f'class_incremental/{c}': m for c, m in zip(
      results['table']['columns'], results['table']['class_incremental']['mean'])}
  scalars.update({f'task_incremental/{c}': m for c, m in zip(
      results['table']['columns'], results['table']['task_incremental']['mean'])})
  scalars['episodes_per_sec'] = results['timing']['episodes_per_second']
  log.write(step, f'eval_{protocol.split}_T{protocol.num_tasks}', scalars)
  log.close()
  return results, paths


def embedding_report(config: ml_collections.ConfigDict, params: Any, protocol: Protocol,
                     output: str, projector: str = 'umap',
                     class_images: np.ndarray | None = None) -> str | None:
  """The appendix figure for episode 0 of the protocol (its first query draw).

  Returns:
    `output`, or None (with a warning) for projector 'umap' without umap-learn.
  """
  from cht_jax import plots  # pylint: disable=g-import-not-at-top
  class_images, spec = _split_and_spec(config, protocol, class_images)
  ht = methods.build(config)
  pairs = continual.TaskPairs.lower_triangle(spec.num_tasks)

  @jax.jit
  def embed(params, class_images):
    episode = episodes_lib.sample_evaluation_episode(
        jax.random.fold_in(jax.random.key(protocol.seed), 0), class_images, spec, 1)
    thetas, prototypes = ht.thetas_and_prototypes(
        params, episode['support_images'], episode['support_labels'], remat=False)
    queries = continual.embed_queries(ht, thetas, episode['query_images'][0], pairs, remat=False)
    return prototypes, queries, episode['query_labels']

  prototypes, queries, labels = jax.device_get(embed(params, jnp.asarray(class_images)))
  try:
    return plots.plot_embeddings(prototypes, queries, labels, output,
                                 config.episode.num_tasks, projector, protocol.seed)
  except ImportError as e:
    logging.warning('No embedding report: %s', e)
    return None
