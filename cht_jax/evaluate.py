r"""The paper's evaluation protocol, for every method, on a checkpoint or parameters.

  python -m cht_jax.main --mode=eval --config=configs/omniglot_t5.py --workdir=DIR \
      [--eval_tasks=5] [--checkpoint_step=N] [--eval_split=test]

Protocol (paper, "Experiments"): the same seeded episodes of T_eval tasks for every model (T_eval
may exceed the trained T). Each episode's theta_t (and frozen prototypes) are scored on every
task tau <= t in `num_query_draws` draws of Q queries per class outside the support set (or,
with sampler 'original', from all of a class's images as the original HT's
hypertransformer/tf/core/evaluation_lib.py, `evaluate_dataset`): task-incremental A_ti[t, tau]
over the K classes of tau (eq. 5), class-incremental A_ci[t, tau] over those of tasks 0..t
(eq. 6). Results: mean over episodes and 95% CI half-width, in
`<workdir>/eval/<split>_T<T_eval>_step<step>.{json,csv,md,png}` (docs/evaluation.md).
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
from jax.experimental import multihost_utils
import jax.numpy as jnp
import ml_collections
import numpy as np

from cht_jax import continual
from cht_jax import methods
from cht_jax import metrics
from cht_jax import reports
from cht_jax.data import datasets
from cht_jax.data import episodes as episodes_lib
from cht_jax.data import omniglot
from cht_jax.runtime import checkpoints
from cht_jax.runtime import devices
from cht_jax.runtime import preemption
from cht_jax.runtime import progress as progress_lib
from cht_jax.runtime import workdir as workdir_lib

DEFAULT_SEED = 0  # Evaluation episodes; independent of config.seed.
MATRICES = reports.MATRICES
# 'strict': a query is never a support image; 'original': see the module docstring.
SAMPLERS = ('strict', 'original')


class EvaluationError(ValueError):
  """The protocol cannot run as asked (e.g. the split has too few classes)."""


@dataclasses.dataclass(frozen=True)
class Protocol:
  """What to evaluate on. `batch_size` (episodes per jit call) changes memory, not results;
  `sampler` overrides the training config's episode.independent_draws."""
  num_tasks: int
  queries_per_class: int
  num_episodes: int = 1024
  num_query_draws: int = 16
  split: str = 'test'
  seed: int = DEFAULT_SEED
  batch_size: int = 8
  sampler: str = 'strict'
  # Pairs of tasks for `run_specificity` (at most num_episodes); 0: not measured.
  specificity_pairs: int = 256

  def __post_init__(self):
    for name in ('num_tasks', 'queries_per_class', 'num_episodes', 'num_query_draws', 'batch_size'):
      if getattr(self, name) < 1:
        raise EvaluationError(f'Evaluation {name} must be >= 1, got {getattr(self, name)}.')
    if self.specificity_pairs < 0:
      raise EvaluationError('Evaluation specificity_pairs must be >= 0, got '
                            f'{self.specificity_pairs}.')
    if self.split not in ('train', 'validation', 'test'):
      raise EvaluationError(f"Evaluation split must be 'train', 'validation' or 'test', "
                            f'got {self.split!r}.')
    if self.sampler not in SAMPLERS:
      raise EvaluationError(f'Evaluation sampler must be one of {SAMPLERS}, got '
                            f'{self.sampler!r}.')


def default_protocol(config: ml_collections.ConfigDict, **overrides) -> Protocol:
  """The paper's protocol for `config` (T_eval, Q from it); None overrides keep the default."""
  values = dict(num_tasks=config.episode.num_tasks,
                queries_per_class=config.episode.queries_per_class)
  values.update({k: v for k, v in overrides.items() if v is not None})
  return Protocol(**values)


def _split_and_spec(config, protocol: Protocol, class_images, domain_sizes=()):
  """The split's images (loaded when None) and the evaluation spec over them."""
  if class_images is None:
    dataset = datasets.load_dataset(config)
    if protocol.split not in dataset:
      # The host pipeline streams the training split rather than keeping it in memory.
      raise EvaluationError(
          f'The {protocol.split!r} classes are not kept in memory with '
          f'data.pipeline={config.data.pipeline!r} (only {", ".join(sorted(dataset))}): '
          f"evaluate on 'validation' or 'test', or set --config.data.pipeline=device.")
    class_images = dataset[protocol.split]
    domain_sizes = dataset.get('domain_sizes', {}).get(protocol.split, ())
  return class_images, evaluation_spec(config, protocol, domain_sizes)


def evaluation_spec(config: ml_collections.ConfigDict, protocol: Protocol,
                    domain_sizes: tuple[int, ...] = ()) -> episodes_lib.EpisodeSpec:
  """The training episode spec (for `domain_sizes`) with the protocol's T_eval, Q, sampler."""
  return datasets.episode_spec(config, domain_sizes)._replace(
      num_tasks=protocol.num_tasks, queries_per_class=protocol.queries_per_class,
      independent_draws=protocol.sampler == 'original')


def warn_if_evaluation_cannot_run(config: ml_collections.ConfigDict) -> list[str]:
  """Logs and returns why the default protocol cannot run on this (Omniglot) config."""
  if config.data.dataset != 'omniglot':
    return []
  test = omniglot.class_split(config.data.split_scheme, config.data.split_seed)['test']
  problems = episodes_lib.spec_problems(evaluation_spec(config, default_protocol(config)),
                                        len(test), split="the 'test' split")
  for problem in problems:
    logging.warning('The evaluation protocol cannot run on this config as it is: %s '
                    '--mode=eval would need a smaller --eval_tasks.', problem)
  return problems


@functools.lru_cache(maxsize=8)
def make_evaluate_batch(method: methods.Method, spec: episodes_lib.EpisodeSpec,
                        num_query_draws: int, vectorize: bool | None = None,
                        mesh: jax.sharding.Mesh | None = None, measure: str = 'accuracies'):
  """jit(fn)(params, class_images, key, indices [B]) -> per-episode outputs [B, ...], cached.
  Episode i is drawn from fold_in(key, i), whatever the batch size, devices and model; B is
  split over `mesh` (None: all devices); `vectorize` (None: by backend) vmaps, else loops.
  `measure`: 'accuracies' ((task_inc, class_inc) [B, P]) or 'specificity' ((own, swapped)
  [B] and theta_a, leaves [B, ...]; `EpisodicMethod.task_specificity`)."""
  pairs = continual.TaskPairs.lower_triangle(spec.num_tasks)
  if vectorize is None:
    vectorize = continual.default_vectorize()
  mesh = mesh or devices.data_mesh()
  if measure == 'accuracies':
    measure_episode = lambda params, episode: method.episode_accuracies(
        params, episode, pairs, vectorize)
  else:
    measure_episode = lambda params, episode: method.task_specificity(params, episode, vectorize)

  def evaluate_shard(params, class_images, key, indices):
    def one(index):
      episode = episodes_lib.sample_evaluation_episode(
          jax.random.fold_in(key, index), class_images, spec, num_query_draws)
      return measure_episode(params, episode)
    return jax.lax.map(one, indices, batch_size=len(indices) if vectorize else None)

  replicated, batch = jax.P(), jax.P('data')
  return jax.jit(jax.shard_map(
      evaluate_shard, mesh=mesh, in_specs=(replicated, replicated, replicated, batch),
      out_specs=batch, check_vma=False))


def _check_spec(spec: episodes_lib.EpisodeSpec, class_images, split: str) -> None:
  try:
    episodes_lib.validate_spec(spec, np.shape(class_images))
  except ValueError as e:
    raise EvaluationError(
        f'Cannot draw {split} episodes of {spec.num_tasks} tasks with '
        f'{spec.queries_per_class} queries per class: {e} Lower --eval_tasks or '
        '--eval_queries_per_class' + ('.' if split == 'test' else
                                      ', or use --eval_split=test (more classes).')) from None


def images_mesh(class_images) -> jax.sharding.Mesh:
  """The mesh `class_images` are placed on (training's, for validation), else every device:
  where `make_evaluate_batch` must split the episodes."""
  sharding = getattr(class_images, 'sharding', None)
  if isinstance(sharding, jax.NamedSharding):
    return sharding.mesh
  return devices.data_mesh()


def map_episodes(evaluate_batch, params, class_images, protocol: Protocol, num_episodes: int,
                 mesh: jax.sharding.Mesh, what: str = 'episodes',
                 signals: preemption.SignalFlag | None = None) -> tuple[Any, dict[str, Any]]:
  """(outputs of episodes 0..num_episodes-1 of `protocol`'s seed, leaves [E, ...]; timing):
  `evaluate_batch` from `make_evaluate_batch` over `mesh`, in batches of `protocol.batch_size`.
  Raises preemption.Preempted before a batch once `signals` has received SIGTERM or SIGINT."""
  num_shards = mesh.devices.size
  class_images = jnp.asarray(class_images)
  # Uncommitted copies: restored parameters sit on one device, the batch may span several.
  params = jax.tree.map(jnp.asarray, jax.device_get(params))
  key = jax.random.key(protocol.seed)
  # Whole multiples of the device count, at most what is needed.
  num = num_episodes
  size = num_shards * math.ceil(min(protocol.batch_size, num) / num_shards)
  num_batches = math.ceil(num / size)
  outputs = []
  start = time.perf_counter()
  first_seconds = None
  progress = progress_lib.Progress(num, what)
  for b in range(num_batches):
    if signals is not None and signals.stop_at(b):
      raise preemption.Preempted(
          f'Stopped by {signals.name} during the evaluation, after {b * size} of {num} '
          f'{what}; no result file was written or changed. Rerun the same command to '
          'evaluate.', signals.signum)
    # The last batch is padded with episodes past `num`, dropped below: one compiled shape.
    indices = jnp.arange(b * size, (b + 1) * size, dtype=jnp.int32)
    outputs.append(_fetch(evaluate_batch(params, class_images, key, indices)))
    done = min((b + 1) * size, num)
    if first_seconds is None:  # Compilation included: the speed is measured after it.
      first_seconds = time.perf_counter() - start
      progress.restart(done)
    if (b == num_batches - 1 or (b + 1) % max(1, num_batches // 10) == 0
        or progress.due()):  # Every tenth, and at least every 30 s.
      status = progress.status(done) if num_batches > 1 else 'one batch, compilation included'
      logging.info('Evaluated %d/%d %s, %.1f s, %s.', done, num, what,
                   time.perf_counter() - start, status)
  total = time.perf_counter() - start
  steady = (num_batches - 1) * size
  rate = steady / (total - first_seconds) if steady else num / total
  timing = {'seconds': total, 'first_batch_seconds': first_seconds,
            'episodes_per_second': rate, 'device': f'{num_shards} x {jax.devices()[0].device_kind}'}
  stacked = jax.tree.map(lambda *batches: np.concatenate(batches)[:num], *outputs)
  return stacked, timing


def run_protocol(method: methods.Method, params, class_images, protocol: Protocol,
                 spec: episodes_lib.EpisodeSpec | None = None,
                 vectorize: bool | None = None,
                 signals: preemption.SignalFlag | None = None) -> dict[str, Any]:
  """The protocol in batches of episodes on uint8 `class_images` [C, M, H, W, D] (`spec`: from
  `evaluation_spec`, None: the config's): 'task_incremental', 'class_incremental' float64
  [E, T, T] per-episode accuracies (NaN above the diagonal), and 'timing'. Raises
  preemption.Preempted before a batch once `signals` has received SIGTERM or SIGINT."""
  spec = spec or evaluation_spec(method.config, protocol)
  _check_spec(spec, class_images, protocol.split)
  mesh = images_mesh(class_images)
  evaluate_batch = make_evaluate_batch(method, spec, protocol.num_query_draws, vectorize, mesh)
  outputs, timing = map_episodes(evaluate_batch, params, class_images, protocol,
                                 protocol.num_episodes, mesh, signals=signals)
  pairs = continual.TaskPairs.lower_triangle(spec.num_tasks)
  result = {'timing': timing}
  for name, per_pair in zip(('task_incremental', 'class_incremental'), outputs):
    matrix = np.full((protocol.num_episodes, spec.num_tasks, spec.num_tasks), np.nan)
    matrix[:, pairs.t, pairs.tau] = per_pair.astype(np.float64)
    result[name] = matrix
  return result


def measures_specificity(method: methods.Method) -> bool:
  """Whether `method` writes its CNN from a support set (the episodic methods)."""
  return hasattr(method, 'task_specificity')


def why_specificity_unmeasured(method: methods.Method, spec: episodes_lib.EpisodeSpec,
                               class_images, split: str) -> str | None:
  """Why task specificity cannot be measured on `class_images` of `split` with episodes of
  `spec` (its T replaced by 2), or None if it can: the one check of the evaluation's
  measure and of validation's."""
  if not measures_specificity(method):
    return (f'{method.display_name} learns theta_t by gradient steps, not from the support '
            'set alone.')
  problems = episodes_lib.spec_problems(spec._replace(num_tasks=2),
                                        *np.shape(class_images)[:2],
                                        split=f'the {split!r} split')
  if problems:
    return 'it needs two disjoint tasks. ' + ' '.join(problems)
  return None


def num_specificity_pairs(protocol: Protocol) -> int:
  """protocol.specificity_pairs, at most as many as the protocol's episodes."""
  return min(protocol.specificity_pairs, protocol.num_episodes)


def run_specificity(method: methods.Method, params, class_images, protocol: Protocol,
                    spec: episodes_lib.EpisodeSpec | None = None,
                    vectorize: bool | None = None,
                    signals: preemption.SignalFlag | None = None) -> dict[str, Any]:
  """Task specificity on `num_specificity_pairs` two-task episodes of the protocol's
  split, seed and query draws (`EpisodicMethod.task_specificity`; `spec` as in
  `run_protocol`, its T replaced by 2): 'own', 'swapped' [N] accuracies and 'theta'
  (theta_a of every pair, leaves [N, ...]). `signals`: see `run_protocol`."""
  return make_specificity(method, class_images, protocol, spec, vectorize)(params, signals)


def make_specificity(method: methods.Method, class_images, protocol: Protocol,
                     spec: episodes_lib.EpisodeSpec | None = None,
                     vectorize: bool | None = None):
  """per_pair(params, signals=None): `run_specificity` on these classes, compiled once for
  every call (validation measures it on each evaluation of the run)."""
  spec = (spec or evaluation_spec(method.config, protocol))._replace(num_tasks=2)
  _check_spec(spec, class_images, protocol.split)
  mesh = images_mesh(class_images)
  evaluate_batch = make_evaluate_batch(method, spec, protocol.num_query_draws, vectorize, mesh,
                                       measure='specificity')

  def per_pair(params, signals: preemption.SignalFlag | None = None) -> dict[str, Any]:
    (own, swapped, theta), _ = map_episodes(evaluate_batch, params, class_images, protocol,
                                            num_specificity_pairs(protocol), mesh,
                                            'pairs of tasks', signals)
    return {'own': own.astype(np.float64), 'swapped': swapped.astype(np.float64),
            'theta': theta}
  return per_pair


def summarize_specificity(per_pair: dict[str, Any]) -> dict[str, Any]:
  """Means and 95% CIs of `run_specificity`'s output, JSON-ready: 'own', 'swapped',
  'difference' (own - swapped, paired), 'ci95' (of the difference), 'own_ci95',
  'num_pairs', and 'spread': per array of theta, the standard deviation of its values
  across tasks over their root mean square (0 for arrays that are not written)."""
  own, swapped = per_pair['own'], per_pair['swapped']
  ci95 = lambda x: float(metrics.mean_and_ci(x)[1])
  spread = {}
  for path, values in jax.tree_util.tree_flatten_with_path(per_pair['theta'])[0]:
    values = np.asarray(values, np.float64)
    rms = np.sqrt(np.mean(values ** 2))
    spread[jax.tree_util.keystr(path, simple=True, separator='/')] = (
        float(values.std(axis=0).mean() / rms) if rms > 0 else 0.0)
  return {'own': float(own.mean()), 'swapped': float(swapped.mean()),
          'difference': float((own - swapped).mean()), 'ci95': ci95(own - swapped),
          'own_ci95': ci95(own), 'num_pairs': len(own), 'spread': spread}


def _fetch(batch_outputs):
  """The whole batch's outputs on this host, gathered from every process."""
  if jax.process_count() == 1:
    return jax.device_get(batch_outputs)
  return multihost_utils.process_allgather(batch_outputs, tiled=True)


def summarize(per_episode: dict[str, np.ndarray], trained_tasks: int) -> dict[str, Any]:
  """Means, CIs, Table 1 rows and summaries of per-episode [E, T, T] matrices, JSON-ready
  (theta_t with t >= trained_tasks extrapolates)."""
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
  out['table'] = {'columns': reports.task_names(num_tasks, cumulative=True)}
  for name, cumulative in (('class_incremental', per_episode['class_incremental_cumulative']),
                           ('task_incremental', task_cumulative)):
    mean, ci = metrics.mean_and_ci(np.diagonal(cumulative, axis1=-2, axis2=-1))
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


def evaluate(config: ml_collections.ConfigDict, params: Any, protocol: Protocol,
             class_images: np.ndarray | None = None,
             method: methods.Method | None = None,
             domain_sizes: tuple[int, ...] = (),
             signals: preemption.SignalFlag | None = None) -> dict[str, Any]:
  """Runs the protocol on `params`: the `summarize` dict plus 'protocol', 'episode', 'timing'
  and 'method' (no files). `class_images`: uint8 [C, M, H, W, 1] of the split (None: loaded),
  with its classes per domain `domain_sizes` (multi-domain); `method`: None to build it;
  `signals`: see `run_protocol`."""
  if config.loss == 'cross_entropy':
    logging.warning('config.loss is cross_entropy: task-incremental accuracy from the '
                    "head's logits, class-incremental from prototypes of the head outputs.")
  method = method or methods.build(config)
  if method.max_eval_tasks is not None and protocol.num_tasks > method.max_eval_tasks:
    raise EvaluationError(
        f'{method.display_name} was trained for {method.max_eval_tasks} tasks and cannot '
        f'be evaluated on {protocol.num_tasks}; use --eval_tasks <= {method.max_eval_tasks}.')
  class_images, spec = _split_and_spec(config, protocol, class_images, domain_sizes)
  logging.info('Evaluating %s on %s: %s.', method.display_name, protocol.split, protocol)
  per_episode = run_protocol(method, params, class_images, protocol, spec, signals=signals)
  results = summarize(per_episode, trained_tasks=method.trained_tasks(protocol.num_tasks))
  results.update(protocol=dataclasses.asdict(protocol), episode=spec._asdict(),
                 timing=per_episode['timing'], method=method.display_name)
  results['task_specificity'] = task_specificity(method, params, class_images, protocol, spec,
                                                 signals)
  if getattr(method, 'note', None):
    results['note'] = method.note
  logging.info('Evaluation took %.1f s, %.2f episodes/s after compilation.',
               results['timing']['seconds'], results['timing']['episodes_per_second'])
  logging.info('Class-incremental accuracy of theta_t on tasks 0..t: %s',
               ', '.join(f'{c} {100 * m:.1f}%' for c, m in zip(
                   results['table']['columns'], results['table']['class_incremental']['mean'])))
  return results


def task_specificity(method: methods.Method, params, class_images, protocol: Protocol,
                     spec: episodes_lib.EpisodeSpec,
                     signals: preemption.SignalFlag | None = None) -> dict[str, Any] | None:
  """`summarize_specificity` of `run_specificity` plus its 'seconds', logged; None where
  it is not measured (a method that writes no CNN from a support set, too few classes,
  or protocol.specificity_pairs = 0), saying why."""
  if not protocol.specificity_pairs:
    return None
  reason = why_specificity_unmeasured(method, spec, class_images, protocol.split)
  if reason:
    # A method without the measure is expected; too few classes is the user's to fix.
    log = logging.warning if measures_specificity(method) else logging.info
    log('Task specificity is not measured: %s', reason)
    return None
  start = time.perf_counter()
  result = summarize_specificity(run_specificity(method, params, class_images, protocol, spec,
                                                 signals=signals))
  result['seconds'] = time.perf_counter() - start
  result['swap'] = ('the layers below the head (each task keeps its own head)'
                    if method.task_incremental_score == 'cross_entropy' else 'every array')
  logging.info('Task specificity, %d pairs of tasks: own %.1f%%, swapped %.1f%%, own - '
               'swapped %+.2f +- %.2f points (%.1f s).', result['num_pairs'],
               100 * result['own'], 100 * result['swapped'], 100 * result['difference'],
               100 * result['ci95'], result['seconds'])
  return result


def restore_params(workdir: str, config: ml_collections.ConfigDict, step: int | None = None,
                   method: methods.Method | None = None) -> tuple[Any, int]:
  """(params, step) of `config`'s method from a checkpoint of `workdir` (None: latest)."""
  method = method or methods.build(config)
  abstract = jax.eval_shape(method.init, jax.random.key(0))
  return checkpoints.restore_params(workdir, abstract, step)


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str,
                        step: int | None = None, plot: bool = True,
                        embeddings: str | None = None,
                        dataset: dict[str, np.ndarray] | None = None,
                        **protocol_overrides) -> tuple[dict[str, Any], list[str]]:
  """(results, written paths) of the protocol on a checkpoint of `workdir` (`step` None: latest);
  `embeddings` 'umap' or 'pca' adds `<prefix>_embeddings.png`; `dataset`: split -> uint8 class
  images (None: loaded). Headline numbers also go to metrics.jsonl as `eval_<split>_T<T>`.
  SIGTERM and SIGINT stop it before the results are written (preemption.Preempted); a failed
  evaluation leaves no folder it made."""
  folder = os.path.join(os.path.abspath(workdir), 'eval')  # reports.check_writable's.
  created = [folder] if jax.process_index() == 0 and not os.path.isdir(folder) else []
  try:
    with preemption.SignalFlag(  # Until here SIGTERM just ends the process.
        stopping='stopping the evaluation before its next batch of episodes',
        exiting='without writing results') as signals:
      return _evaluate_checkpoint(config, workdir, step, plot, embeddings, dataset, signals,
                                  protocol_overrides)
  finally:
    workdir_lib.remove_if_empty(created)


def _evaluate_checkpoint(config, workdir, step, plot, embeddings, dataset, signals,
                         protocol_overrides):
  """`evaluate_checkpoint` within its signal handlers."""
  method = methods.build(config, None if dataset is None else len(dataset['train']))
  params, step = restore_params(workdir, config, step, method)
  if jax.process_index() == 0:  # The one writer of the results (below), checked first.
    reports.check_writable(workdir)
  protocol = default_protocol(config, **protocol_overrides)
  class_images = None if dataset is None else dataset[protocol.split]
  domain_sizes = () if dataset is None else dataset.get('domain_sizes', {}).get(protocol.split, ())
  results = evaluate(config, params, protocol, class_images, method, domain_sizes, signals)
  results.update(workdir=os.path.abspath(workdir), step=step,
                 config=json.loads(config.to_json_best_effort()))
  prefix = reports.result_prefix(workdir, protocol, step)
  if jax.process_index() != 0:  # Every process has the results; process 0 writes them.
    return results, []
  paths = reports.write_results(results, prefix, plot=plot)
  if embeddings and isinstance(method, methods.base.EpisodicMethod):
    report = embedding_report(config, params, protocol, prefix + '_embeddings.png', embeddings)
    paths += [report] if report else []
  elif embeddings:
    logging.warning('No embedding report for %s (a figure of prototypes).', method.display_name)
  logging.info('Wrote %s.', ', '.join(paths))
  log = workdir_lib.MetricsLog(workdir)
  scalars = {f'{name}/{c}': m for name in ('class_incremental', 'task_incremental')
             for c, m in zip(results['table']['columns'], results['table'][name]['mean'])}
  scalars['episodes_per_sec'] = results['timing']['episodes_per_second']
  if results['task_specificity']:
    scalars.update({f'task_specificity/{name}': results['task_specificity'][name]
                    for name in ('own', 'swapped', 'difference', 'ci95')})
  sampler = '' if protocol.sampler == 'strict' else f'_{protocol.sampler}'
  log.write(step, f'eval_{protocol.split}_T{protocol.num_tasks}{sampler}', scalars)
  log.close()
  return results, paths


def embedding_report(config: ml_collections.ConfigDict, params: Any, protocol: Protocol,
                     output: str, projector: str = 'umap',
                     class_images: np.ndarray | None = None) -> str | None:
  """The appendix figure of the protocol's episode 0: `output`, or None without umap-learn."""
  from cht_jax import plots  # pylint: disable=g-import-not-at-top
  class_images, spec = _split_and_spec(config, protocol, class_images)
  method = methods.build(config)
  pairs = continual.TaskPairs.lower_triangle(spec.num_tasks)

  @jax.jit
  def embed(params, class_images):
    episode = episodes_lib.sample_evaluation_episode(
        jax.random.fold_in(jax.random.key(protocol.seed), 0), class_images, spec, 1)
    thetas, prototypes = method.thetas_and_prototypes(
        params, episode['support_images'], episode['support_labels'], remat=False,
        **methods.base.unlabeled_support(episode))
    queries = continual.embed_queries(method.cnn, thetas, episode['query_images'][0], pairs,
                                      remat=False)
    return prototypes, queries, episode['query_labels']

  prototypes, queries, labels = jax.device_get(embed(params, jnp.asarray(class_images)))
  try:
    return plots.plot_embeddings(prototypes, queries, labels, output,
                                 config.episode.num_tasks, projector, protocol.seed)
  except ImportError as e:
    logging.warning('No embedding report: %s', e)
    return None
