r"""The paper's evaluation protocol, for every method, on a checkpoint or parameters.

  python -m cht_jax.main --mode=eval --config=configs/omniglot_t5.py --workdir=DIR \
      [--eval_tasks=5] [--checkpoint_step=N] [--eval_split=test]

Protocol (paper, "Experiments"): `num_episodes` episodes of T_eval tasks drawn from
the split (test by default) with a seed of their own, so that every model is
scored on the same episodes. For each episode the method produces
theta_0..theta_{T_eval-1} (and, for CHT, the frozen prototypes) once from the
support sets; then, `num_query_draws` times, Q queries per class are drawn from the
images outside the support set and every pair (theta_t, task tau <= t) is
scored:
  task-incremental  A_ti[t, tau]: softmax over the K classes of tau (eq. 5);
  class-incremental A_ci[t, tau]: softmax over the classes of tasks 0..t
                    (eq. 6), counted on the queries of tau.
With `sampler='original'` each query draw is instead the original HT's test
sampler's: Q images per class from all of its images, so a query may be the
support image itself (hypertransformer/tf/core/evaluation_lib.py,
`evaluate_dataset`); the episodes' classes and support sets are the same.
Each per-episode entry is the mean over the query draws; results are the mean
over episodes and the half-width of its 95% confidence interval,
1.96 * std / sqrt(num_episodes) (`metrics.mean_and_ci`). T_eval may exceed the
T the model was trained with (extrapolation).

Result files, `<workdir>/eval/<split>_T<T_eval>_step<step>.{json,csv,md,png}`:
see `reports.write_results` and docs/evaluation.md.
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
from cht_jax.runtime import workdir as workdir_lib

DEFAULT_SEED = 0  # Evaluation episodes; independent of config.seed.
MATRICES = reports.MATRICES
# Query draws: 'strict', never a support image; 'original', the original HT's
# test sampler, from all images of the class (episodes.sample_evaluation_episode).
SAMPLERS = ('strict', 'original')


class EvaluationError(ValueError):
  """The protocol cannot run as asked (e.g. the split has too few classes)."""


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
    sampler: 'strict': the queries of each draw never a support image;
      'original': the original HT's test sampler, queries drawn from all
      images of a class, independently of its support set. Whatever the
      training config's episode.independent_draws.
  """
  num_tasks: int
  queries_per_class: int
  num_episodes: int = 1024
  num_query_draws: int = 16
  split: str = 'test'
  seed: int = DEFAULT_SEED
  batch_size: int = 8
  sampler: str = 'strict'

  def __post_init__(self):
    for name in ('num_tasks', 'queries_per_class', 'num_episodes', 'num_query_draws',
                 'batch_size'):
      if getattr(self, name) < 1:
        raise EvaluationError(f'Evaluation {name} must be >= 1, got {getattr(self, name)}.')
    if self.split not in ('train', 'validation', 'test'):
      raise EvaluationError(f"Evaluation split must be 'train', 'validation' or 'test', "
                       f'got {self.split!r}.')
    if self.sampler not in SAMPLERS:
      raise EvaluationError(f'Evaluation sampler must be one of {SAMPLERS}, got '
                            f'{self.sampler!r}.')


def default_protocol(config: ml_collections.ConfigDict, **overrides) -> Protocol:
  """The paper's protocol for `config`; overrides that are None keep the default.

  T_eval and Q default to the config's episode.num_tasks and
  episode.queries_per_class.
  """
  values = dict(num_tasks=config.episode.num_tasks,
                queries_per_class=config.episode.queries_per_class)
  values.update({k: v for k, v in overrides.items() if v is not None})
  return Protocol(**values)


def _split_and_spec(config, protocol: Protocol, class_images, domain_sizes=()):
  """The split's images (loaded when None) and the evaluation spec over them.

  `domain_sizes`: the given split's classes per domain (task_classes='domain').
  """
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
  """The training episode spec with T_eval tasks, Q queries per class and the
  protocol's query sampler (independent draws for 'original').

  `domain_sizes`: classes of each domain in the split (task_classes='domain').
  """
  return datasets.episode_spec(config, domain_sizes)._replace(
      num_tasks=protocol.num_tasks, queries_per_class=protocol.queries_per_class,
      independent_draws=protocol.sampler == 'original')


def warn_if_evaluation_cannot_run(config: ml_collections.ConfigDict) -> list[str]:
  """Logs (and returns) what keeps the default evaluation protocol (`--mode=eval`, the
  test split, T tasks) from running on this config, where the class counts are known
  without reading data: training can run, but its model could not be scored."""
  counts = {'omniglot': lambda: len(omniglot.class_split(
      config.data.split_scheme, config.data.split_seed)['test'])}
  if config.data.dataset not in counts:
    return []
  spec = evaluation_spec(config, default_protocol(config))
  problems = episodes_lib.spec_problems(spec, counts[config.data.dataset](),
                                        split="the 'test' split")
  for problem in problems:
    logging.warning('The evaluation protocol cannot run on this config as it is: %s '
                    '--mode=eval would need a smaller --eval_tasks.', problem)
  return problems


# --------------------------------------------------------------------------
# The protocol.
# --------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def make_evaluate_batch(method: methods.Method, spec: episodes_lib.EpisodeSpec, num_query_draws: int,
                        vectorize: bool | None = None, mesh: jax.sharding.Mesh | None = None):
  """jit(fn)(params, class_images, key, indices [B]) -> (task_inc, class_inc) [B, P].

  Cached: evaluating several checkpoints of one model compiles once.

  Episode i is drawn from fold_in(key, i): the same episodes whatever the
  batch size, the number of devices and the model. The batch is split over
  the devices of `mesh` (`shard_map`; B must be a multiple of their number),
  each device running its episodes on its own.

  Args:
    method: from `methods.build` (hashable: the cache's key).
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
      return method.episode_accuracies(params, episode, pairs, vectorize)
    return jax.lax.map(one, indices, batch_size=len(indices) if vectorize else None)

  replicated, batch = jax.P(), jax.P('data')
  return jax.jit(jax.shard_map(
      evaluate_shard, mesh=mesh, in_specs=(replicated, replicated, replicated, batch),
      out_specs=batch, check_vma=False))


def run_protocol(method: methods.Method, params, class_images, protocol: Protocol,
                 spec: episodes_lib.EpisodeSpec | None = None,
                 vectorize: bool | None = None) -> dict[str, Any]:
  """Runs the protocol in batches of episodes.

  Args:
    method, params: the method and its parameters.
    class_images: uint8 [C, M, H, W, D] of the evaluation split.
    protocol: the protocol.
    spec: from `evaluation_spec`; None for the config's (no domain sizes).
    vectorize: see `make_evaluate_batch`.

  Returns:
    'task_incremental', 'class_incremental': float64 [E, T, T] per-episode
    accuracy matrices (NaN above the diagonal); 'timing': seconds (total,
    first batch with compilation) and episodes_per_second (after the first
    batch).
  """
  spec = spec or evaluation_spec(method.config, protocol)
  evaluate_batch = make_evaluate_batch(method, spec, protocol.num_query_draws, vectorize)
  num_shards = jax.device_count()
  try:
    episodes_lib.validate_spec(spec, np.shape(class_images))
  except ValueError as e:
    raise EvaluationError(
        f'Cannot draw {protocol.split} episodes of {spec.num_tasks} tasks with '
        f'{spec.queries_per_class} queries per class: {e} Lower --eval_tasks or '
        '--eval_queries_per_class' + ('.' if protocol.split == 'test' else
                                      ', or use --eval_split=test (more classes).')) from None
  class_images = jnp.asarray(class_images)
  # Uncommitted copies: restored parameters sit on one device, and the batch
  # may spread over several (one per core on CPU, cht_jax/runtime/devices.py).
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
    outputs.append(_fetch(evaluate_batch(params, class_images, key, indices)))
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


def _fetch(batch_outputs):
  """The whole batch's outputs on this host: with several processes each holds only
  its devices' episodes, and every process gets all of them."""
  if jax.process_count() == 1:
    return jax.device_get(batch_outputs)
  return multihost_utils.process_allgather(batch_outputs, tiled=True)


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
  out['table'] = {'columns': reports.task_names(num_tasks, cumulative=True)}
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


def evaluate(config: ml_collections.ConfigDict, params: Any, protocol: Protocol,
             class_images: np.ndarray | None = None,
             method: methods.Method | None = None,
             domain_sizes: tuple[int, ...] = ()) -> dict[str, Any]:
  """Runs the protocol on `params` and summarises it (no files).

  Args:
    config: the training config (method, model, episode shape, data).
    params: the method's parameters.
    protocol: see `Protocol`.
    class_images: uint8 [C, M, H, W, 1] of the split; None to load
      `protocol.split` with `datasets.load_dataset(config)`.
    method: `methods.build(config)` if None.
    domain_sizes: with `class_images` of a multi-domain split, its classes per
      domain (`datasets.load_dataset(config)['domain_sizes'][split]`).

  Returns:
    The `summarize` dict plus 'protocol', 'episode', 'timing' and 'method'.
  """
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
  per_episode = run_protocol(method, params, class_images, protocol, spec)
  results = summarize(per_episode, trained_tasks=method.trained_tasks(protocol.num_tasks))
  results['protocol'] = dataclasses.asdict(protocol)
  results['episode'] = spec._asdict()
  results['timing'] = per_episode['timing']
  results['method'] = method.display_name
  if getattr(method, 'note', None):
    results['note'] = method.note
  logging.info('Evaluation took %.1f s, %.2f episodes/s after compilation.',
               results['timing']['seconds'], results['timing']['episodes_per_second'])
  logging.info('Class-incremental accuracy of theta_t on tasks 0..t: %s',
               ', '.join(f'{c} {100 * m:.1f}%' for c, m in zip(
                   results['table']['columns'], results['table']['class_incremental']['mean'])))
  return results


def restore_params(workdir: str, config: ml_collections.ConfigDict, step: int | None = None,
                   method: methods.Method | None = None) -> tuple[Any, int]:
  """(params, step) of the method of `config` from a checkpoint of `workdir` (latest
  if `step` is None); `checkpoints.restore_params` says what may go wrong."""
  method = method or methods.build(config)
  abstract = jax.eval_shape(method.init, jax.random.key(0))
  return checkpoints.restore_params(workdir, abstract, step)


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str,
                        step: int | None = None, plot: bool = True,
                        embeddings: str | None = None,
                        dataset: dict[str, np.ndarray] | None = None,
                        **protocol_overrides) -> tuple[dict[str, Any], list[str]]:
  """Restores a checkpoint of `workdir`, runs the protocol and writes the result files.

  Args:
    config: the config the model was trained with.
    workdir: the training workdir.
    step: the checkpoint step; None for the latest.
    plot: also write the PNG.
    embeddings: also write `<prefix>_embeddings.png` (`embedding_report`)
      with projector 'umap' or 'pca'; None for no report.
    dataset: split name -> uint8 class images, as training was given; None
      to load the config's dataset.
    **protocol_overrides: `Protocol` fields (None keeps the default).

  Returns:
    (results, paths of the written files). Headline numbers also go to the
    workdir's metrics log under the split `eval_<split>_T<T_eval>` (with
    `_original` added for that sampler).
  """
  method = methods.build(config, None if dataset is None else len(dataset['train']))
  params, step = restore_params(workdir, config, step, method)
  if jax.process_index() == 0:  # The one writer of the results (below), checked first.
    reports.check_writable(workdir)
  protocol = default_protocol(config, **protocol_overrides)
  class_images = None if dataset is None else dataset[protocol.split]
  domain_sizes = () if dataset is None else dataset.get('domain_sizes', {}).get(protocol.split, ())
  results = evaluate(config, params, protocol, class_images, method, domain_sizes)
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
  sampler = '' if protocol.sampler == 'strict' else f'_{protocol.sampler}'
  log.write(step, f'eval_{protocol.split}_T{protocol.num_tasks}{sampler}', scalars)
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
