"""Meta-training: one jit-compiled step over a sharded batch of episodes.

Episodes are sampled on device inside the step (from the split's images kept
in device memory), so the input pipeline never waits on the host. The batch of
episodes is sharded over a 1-D `Mesh` of all devices ('data' axis); parameters
and optimiser state are replicated.

Reliability (docs/reliability.md):
* The episodes of step s depend only on (config.seed, s), so a run resumed
  from the checkpoint of step s repeats, bit for bit, what an uninterrupted
  run does after step s.
* Orbax writes each checkpoint into a temporary folder and renames it when
  complete; a run killed mid-save leaves only that temporary folder, which
  restarting ignores and removes. SIGTERM (preemption) saves a checkpoint
  of the current step before the process exits with status 143.
* A step whose loss, gradient or generated weights are not finite changes
  nothing but the step count; `train.on_divergence` decides whether the run
  then stops ('stop', before any later checkpoint is written) or goes on
  ('skip').
* The config is checked before anything is read or compiled, the workdir
  before anything is downloaded, and a checkpoint against the config before
  it is restored; each failure is one `USER_ERRORS` exception whose message
  names what is wrong and what to do.
"""

import json
import os
import re
import signal
import tempfile
import threading
import time
from typing import Any

from absl import logging
from etils import epath
import flax
import jax
from jax import flatten_util
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp

from cht_jax import config_validation
from cht_jax import continual
from cht_jax import devices
from cht_jax import methods
from cht_jax.data import augment as augment_lib
from cht_jax.data import datasets
from cht_jax.data import episodes as episodes_lib
from cht_jax.data import omniglot
from cht_jax.data import pipeline

OPTIMIZERS = config_validation.OPTIMIZERS
MAX_CONSECUTIVE_SKIPS = 20  # With on_divergence='skip', more than this stops the run.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM
# Train-step metrics that must be finite for the step's update to be applied.
_WATCHED = {'loss': 'the loss', 'grad_norm': 'the gradient norm',
            'theta_norm': 'the norm of the generated weights',
            'update_norm': 'the norm of the parameter update'}


class DivergenceError(FloatingPointError):
  """The loss, the gradient or the generated weights became non-finite."""


class CheckpointError(RuntimeError):
  """A checkpoint could not be written, read, or does not fit the config."""


class WorkdirError(RuntimeError):
  """The workdir cannot be written."""


class Preempted(Exception):
  """SIGTERM arrived; the current step was checkpointed."""


# Errors whose message is the whole story: `main` prints it without traceback.
USER_ERRORS = (config_validation.ConfigError, omniglot.DataError, DivergenceError,
               CheckpointError, WorkdirError)


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


def learning_rate_schedule(optim: ml_collections.ConfigDict) -> optax.Schedule:
  """The paper's schedule: lr * decay_rate ** floor(step / decay_steps)."""
  return optax.exponential_decay(
      optim.learning_rate, transition_steps=optim.decay_steps,
      decay_rate=optim.decay_rate, staircase=True)


def make_optimizer(optim: ml_collections.ConfigDict) -> optax.GradientTransformation:
  schedule = learning_rate_schedule(optim)
  if optim.name == 'sgd':
    optimizer = optax.sgd(schedule)
  elif optim.name == 'momentum':
    optimizer = optax.sgd(schedule, momentum=optim.momentum)
  elif optim.name == 'adam':
    optimizer = optax.adam(schedule)
  else:
    raise ValueError(f'Unknown optim.name {optim.name!r}; expected one of {OPTIMIZERS}.')
  if optim.grad_clip_norm > 0:
    optimizer = optax.chain(optax.clip_by_global_norm(optim.grad_clip_norm), optimizer)
  return optimizer


def episode_spec(config: ml_collections.ConfigDict,
                 domain_sizes: tuple[int, ...] = ()) -> episodes_lib.EpisodeSpec:
  return datasets.episode_spec(config, domain_sizes)


def load_dataset(config: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
  """Images of the in-memory splits, uint8 [classes, images per class, H, W, D].

  See `datasets.load_dataset` (no 'train' with data.pipeline=host; an extra
  'domain_sizes' entry for multidomain).
  """
  return datasets.load_dataset(config)


def init_state(config, ht, optimizer, key, image_shape) -> TrainState:
  # `ht`: a `methods` method (CHT, ConstPN, Merged HT) or a bare HyperTransformer (CHT).
  params = methods.as_method(ht).init(key, image_shape, config.episode.shots)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=optimizer.init(params))


def batch_loss(ht, params, episodes, loss, remat):
  """Mean over a batch of episodes of Algorithm 1's loss, and mean metrics."""
  _, metrics = jax.vmap(
      lambda episode: methods.as_method(ht).episode_loss(params, episode, loss, remat))(episodes)
  metrics = jax.tree.map(jnp.mean, metrics)
  return metrics['loss'], metrics


def batch_grads(loss_fn, params, episodes, mesh: jax.sharding.Mesh, vectorize: bool):
  """Mean gradient and metrics of `loss_fn(params, episode) -> (loss, metrics)` over a batch.

  The batch [B, ...] is split over the devices of `mesh` (axis 'data',
  `shard_map`): each device takes its B / devices episodes and the means are
  averaged across devices (`pmean`), as in evaluation. Explicit per-device
  code rather than a sharded vmap: XLA's partitioner would gather the whole
  batch onto every device around custom calls (`model.conv_impl='fused_cpu'`).
  On a device the episodes are vmapped when `vectorize`, else looped
  (`lax.scan` summing the gradients): on CPU one episode at a time stays in
  cache, where a vmapped batch of generated CNNs does not (docs/performance.md).
  """
  def device_grads(params, row):
    size = jax.tree.leaves(row)[0].shape[0]
    if vectorize:
      def mean_loss(p):
        _, metrics = jax.vmap(lambda episode: loss_fn(p, episode))(row)
        metrics = jax.tree.map(jnp.mean, metrics)
        return metrics['loss'], metrics
      grads, metrics = jax.grad(mean_loss, has_aux=True)(params)
    else:
      grad_fn = jax.grad(loss_fn, has_aux=True)
      def accumulate(total, episode):
        return jax.tree.map(jnp.add, total, grad_fn(params, episode)), None
      first = jax.tree.map(lambda x: x[0], row)
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                           jax.eval_shape(grad_fn, params, first))
      total, _ = jax.lax.scan(accumulate, zeros, row)
      grads, metrics = jax.tree.map(lambda x: x / size, total)
    # One all-reduce of one vector: of a pytree, XLA makes several, which may
    # run at once, and two collectives in flight can hang XLA:CPU (each holds
    # one of the pool's threads while it waits for the other devices).
    flat, unravel = flatten_util.ravel_pytree((grads, metrics))
    return unravel(jax.lax.pmean(flat, 'data'))

  return jax.shard_map(device_grads, mesh=mesh, in_specs=(jax.P(), jax.P('data')),
                       out_specs=jax.P(), check_vma=False)(params, episodes)


def make_train_step(config, ht, optimizer, mesh, domain_sizes=(), host=False):
  """Returns jit(step)(state, class_images, key) -> (state, metrics).

  With `host`, the step takes a host pipeline's episode batch (uint8 images,
  `datasets.host_batches`) in place of `class_images`. The training
  augmentation of `config.data.augment` is applied in both cases.

  A step where one of `_WATCHED` (the loss, the norms of the gradient, of the
  generated weights and of the update) is not finite returns the parameters
  and optimiser state it was given (only the step count advances) and reports
  metrics['skipped'] = 1.
  """
  spec = methods.training_spec(config, domain_sizes)  # ConstPN trains on wider single tasks.
  batch_sharding = jax.NamedSharding(mesh, jax.P('data'))
  schedule = learning_rate_schedule(config.optim)
  augment_spec = datasets.augment_spec(config)

  vectorize = continual.vectorize_option(config.model.vectorize)
  remat = continual.remat_option(config.model.remat, vectorize, spec.num_tasks)

  def loss_fn(params, episode):
    return methods.as_method(ht).episode_loss(params, episode, config.loss, remat,
                                              vectorize=vectorize)

  def train_step(state: TrainState, class_images, key):
    if host:  # `class_images` is the step's episode batch.
      episodes = pipeline.device_episodes(class_images)
    else:
      episodes = episodes_lib.sample_episodes(
          key, class_images, spec, config.train.episodes_per_step, rotate=config.data.rotate)
      # Sampled whole on every device (a few ms per step), then split: with the
      # batch's sharding propagated into it, XLA gathered the sampler's scores
      # around its top-k, and two all-gathers in flight at once can hang
      # XLA:CPU (each blocks one of the pool's threads, here 2, that the other
      # device needs to reach them).
      episodes = jax.lax.with_sharding_constraint(episodes, jax.NamedSharding(mesh, jax.P()))
    episodes = augment_lib.augment_episodes(jax.random.fold_in(key, 1), episodes, augment_spec)
    episodes = jax.lax.with_sharding_constraint(episodes, batch_sharding)
    grads, metrics = batch_grads(loss_fn, state.params, episodes, mesh, vectorize)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics['grad_norm'] = optax.tree.norm(grads)
    metrics['update_norm'] = optax.tree.norm(updates)
    metrics['learning_rate'] = schedule(state.step)
    finite = jnp.all(jnp.isfinite(jnp.stack([metrics[k] for k in _WATCHED])))
    metrics['skipped'] = 1.0 - finite.astype(jnp.float32)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    return TrainState(step=state.step + 1, params=keep(params, state.params),
                      opt_state=keep(opt_state, state.opt_state)), metrics

  return jax.jit(train_step, donate_argnums=0)


def validation_tasks(config: ml_collections.ConfigDict, num_classes: int) -> int:
  """Tasks per validation episode: T, or as many disjoint tasks as the classes allow.

  Omniglot's validation split has 50 classes: two disjoint 20-way tasks.
  """
  ep = config.episode
  if ep.task_classes != 'disjoint':
    return ep.num_tasks
  return max(1, min(ep.num_tasks, num_classes // ep.ways))


def make_eval_step(config, ht, num_episodes: int, num_tasks: int | None = None,
                   domain_sizes=()):
  """Returns jit(evaluate)(params, class_images, key) -> metrics, no augmentation.

  `num_tasks` overrides the config's T (validation has too few classes for
  more than two disjoint 20-way tasks).
  """
  spec = episode_spec(config, domain_sizes)
  if num_tasks is not None:
    spec = spec._replace(num_tasks=num_tasks)

  def eval_step(params, class_images, key):
    episodes = episodes_lib.sample_episodes(key, class_images, spec, num_episodes, rotate=False)
    _, metrics = batch_loss(ht, params, episodes, config.loss, remat=False)
    return metrics

  return jax.jit(eval_step)


# --------------------------------------------------------------------------
# Checkpoints.
# --------------------------------------------------------------------------


def checkpoint_manager(workdir: str, config, remove_partial: bool = False
                       ) -> ocp.CheckpointManager:
  """The Orbax manager of `<workdir>/checkpoints`.

  Args:
    workdir: the training workdir.
    config: the config (for `train.keep_checkpoints`).
    remove_partial: delete the temporary folders of saves that never
      completed (a killed run). Only the trainer of the workdir may: another
      process would delete the save in progress of a live run.
  """
  return ocp.CheckpointManager(
      os.path.join(os.path.abspath(workdir), 'checkpoints'),
      item_handlers=ocp.StandardCheckpointHandler(),
      options=ocp.CheckpointManagerOptions(
          max_to_keep=config.train.keep_checkpoints, create=True,
          cleanup_tmp_directories=remove_partial))


def _flat_shapes(tree) -> dict[str, tuple[tuple[int, ...], str]]:
  """'params/block_0/kernel'-style path -> (shape, dtype) of every array leaf."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(path, simple=True, separator='/'):
          (tuple(leaf.shape), str(np.dtype(leaf.dtype))) for path, leaf in leaves}


def checkpoint_mismatches(manager: ocp.CheckpointManager, step: int, abstract) -> list[str]:
  """How the arrays of the checkpoint of `step` differ from `abstract`'s."""
  found = _flat_shapes(manager.item_metadata(step))
  if not found:
    raise ValueError('its metadata lists no arrays (_METADATA missing or unreadable)')
  expected = _flat_shapes(abstract)
  problems = {k: f'{k} has shape {found[k][0]} {found[k][1]} in the checkpoint but '
                 f'{expected[k][0]} {expected[k][1]} in this config'
              for k in found.keys() & expected.keys() if found[k] != expected[k]}
  problems.update({k: f'{k} is in this config but not in the checkpoint'
                   for k in expected.keys() - found.keys()})
  problems.update({k: f'{k} is in the checkpoint but not in this config'
                   for k in found.keys() - expected.keys()})
  # Parameters first: the optimiser state only mirrors them.
  return [problems[k] for k in sorted(problems, key=lambda k: (not k.startswith('params'), k))]


def _config_changes(workdir: str, config) -> str:
  """The fields where `config` differs from `<workdir>/config.json`, or ''."""
  path = os.path.join(workdir, 'config.json')
  try:
    with open(path) as f:
      saved = _flat_dict(json.load(f))
  except (OSError, ValueError):  # No record of the earlier config: nothing to compare.
    return ''
  if config is None:
    return ''
  now = _flat_dict(json.loads(config.to_json_best_effort()))
  changes = [f'{k} {saved.get(k, "(absent)")!r} -> {now.get(k, "(absent)")!r}'
             for k in sorted(saved.keys() | now.keys()) if saved.get(k) != now.get(k)]
  return (' Fields that differ from the config of the last run in this workdir: '
          + ', '.join(changes) + '.') if changes else ''


def _flat_dict(tree: dict, prefix: str = '') -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat_dict(value, f'{prefix}{key}.'))
    else:
      out[f'{prefix}{key}'] = value
  return out


def _root_cause(error: BaseException) -> str:
  """The innermost error of a chain in one line, e.g. 'No space left on device (errno 28)'."""
  seen = []
  while error is not None and error not in seen:
    seen.append(error)
    error = error.__cause__ or error.__context__
  for e in reversed(seen):  # Prefer the innermost OS error, the actionable one.
    if isinstance(e, OSError) and e.errno:
      return f'{e.strerror} (errno {e.errno})'
    # TensorStore (Orbax's array writer) reports OS errors inside its message.
    code = re.search(r"os_error_code='?(\d+)", str(e))
    if code:
      return f'{os.strerror(int(code.group(1)))} (errno {code.group(1)})'
  e = seen[-1]
  return f'{type(e).__name__}: {" ".join(str(e).split())}'[:300]


def _check_fits(manager, step: int, abstract, config) -> None:
  """Raises CheckpointError if the checkpoint of `step` does not fit `abstract`."""
  try:
    problems = checkpoint_mismatches(manager, step, abstract)
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(
        f'Cannot read the checkpoint of step {step} in {manager.directory} '
        f'({_root_cause(e)}). It is left untouched; to resume from an earlier checkpoint, '
        f'move {manager.directory}/{step} out of that folder, or use a new --workdir.'
    ) from None
  if problems:
    shown = '; '.join(problems[:3]) + ('; ...' if len(problems) > 3 else '')
    raise CheckpointError(
        f'The checkpoint of step {step} in {manager.directory} was written by a '
        f'different config: {len(problems)} arrays differ ({shown}).'
        + _config_changes(os.path.dirname(os.fspath(manager.directory)), config)
        + ' Resume with the config (and --config.* overrides) it was trained with, or '
        'start afresh with a new --workdir; the checkpoints are left untouched.')


def restore_or_init(manager: ocp.CheckpointManager, state: TrainState,
                    config: ml_collections.ConfigDict | None = None) -> TrainState:
  """The latest complete checkpoint of the workdir if any, else `state` unchanged.

  Raises:
    CheckpointError: the checkpoint does not fit `state` (a different config;
      the fields that changed are named when `config` is given) or cannot be
      read. Nothing is deleted.
  """
  step = manager.latest_step()
  if step is None:
    return state
  logging.info('Resuming from the checkpoint of step %d in %s.', step, manager.directory)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  _check_fits(manager, step, abstract, config)
  try:
    return manager.restore(step, args=ocp.args.StandardRestore(abstract))
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(
        f'Cannot restore the checkpoint of step {step} in {manager.directory} '
        f'({_root_cause(e)}). It is left untouched; to resume from an earlier one, move '
        f'{manager.directory}/{step} out of that folder, or use a new --workdir.') from None


def _save(manager: ocp.CheckpointManager, step: int, state: TrainState, wait: bool) -> None:
  """Saves asynchronously (or not, if `wait`); errors become CheckpointError.

  An asynchronous save that failed raises here at the next save or wait.
  """
  try:
    manager.save(step, args=ocp.args.StandardSave(state))
    if wait:
      manager.wait_until_finished()
  except Exception as e:  # pylint: disable=broad-except
    try:
      manager.reload()
      kept = manager.all_steps()
    except Exception:  # pylint: disable=broad-except
      # Orbax may fail to read a directory in mid-failure: complete steps are
      # the folders named by a bare number (partial saves carry a suffix).
      kept = sorted(int(p.name) for p in epath.Path(manager.directory).iterdir()
                    if p.name.isdigit())
    raise CheckpointError(
        f'Saving a checkpoint in {manager.directory} failed ({_root_cause(e)}). The '
        f'complete checkpoints there (steps {", ".join(map(str, kept)) or "none"}) are '
        'kept, and a partial one is removed when training restarts. Free disk space or '
        'fix the permissions, then rerun the same command to resume'
        + (f' from step {max(kept)}.' if kept else ' from the start.')) from None


def _close(manager: ocp.CheckpointManager) -> None:
  """Waits for an asynchronous save in flight; its failure is only logged here."""
  try:
    manager.close()
  except Exception as e:  # pylint: disable=broad-except
    logging.error('Closing the checkpoint manager of %s: %s', manager.directory,
                  _root_cause(e))


# --------------------------------------------------------------------------
# Workdir, metrics, signals, divergence.
# --------------------------------------------------------------------------


def check_workdir(workdir: str) -> str:
  """Creates `workdir` (and its checkpoints folder) and checks both are writable.

  Returns:
    The absolute path of the workdir.

  Raises:
    WorkdirError: naming the folder and the reason.
  """
  workdir = os.path.abspath(workdir)
  for folder in (workdir, os.path.join(workdir, 'checkpoints')):
    try:
      os.makedirs(folder, exist_ok=True)
      fd, probe = tempfile.mkstemp(dir=folder, prefix='.write_test_')
      os.close(fd)
      os.remove(probe)
    except OSError as e:
      raise WorkdirError(
          f'Cannot write to {folder} ({type(e).__name__}: {e.strerror or e}). Choose '
          'another --workdir or make this one writable; nothing was read or '
          'changed.') from None
  return workdir


def _write_json_atomically(path: str, text: str) -> None:
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix='.tmp')
  try:
    with os.fdopen(fd, 'w') as f:
      f.write(text)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


class MetricsLog:
  """TensorBoard summaries and a JSON-lines copy (`metrics.jsonl`) for scripts."""

  TRAINING_SPLITS = ('train', 'validation')  # The rows the training loop writes.

  def __init__(self, workdir: str):
    # Imported here: clu's writers pull in TensorFlow, which the training step,
    # the benchmark and the API do not need (a GPU image may not have it).
    from clu import metric_writers  # pylint: disable=g-import-not-at-top
    self._is_main = jax.process_index() == 0
    self._writer = metric_writers.create_default_writer(
        workdir, just_logging=not self._is_main)
    self._path = os.path.join(workdir, 'metrics.jsonl')

  def write(self, step: int, split: str, metrics: dict[str, float]):
    scalars = {f'{split}/{k}': float(v) for k, v in metrics.items()}
    self._writer.write_scalars(step, scalars)
    if self._is_main:
      try:
        with open(self._path, 'a') as f:
          f.write(json.dumps({'step': step, 'split': split, **scalars}) + '\n')
      except OSError as e:
        raise WorkdirError(f'Cannot append to {self._path} ({e}). Free disk space or fix '
                           'the permissions, then rerun the same command to resume from '
                           'the last checkpoint.') from None

  def drop_after(self, step: int) -> None:
    """Drops training rows after `step` and a torn last line, before resuming from `step`.

    A run killed after its last checkpoint has logged steps that the resumed
    run logs again; without this they would appear twice.
    """
    if not self._is_main or not os.path.exists(self._path):
      return
    with open(self._path) as f:
      lines = f.readlines()
    kept = [line for line in lines if self._keep(line, step)]
    if len(kept) != len(lines):
      logging.info('Dropping %d rows after step %d from %s.', len(lines) - len(kept),
                   step, self._path)
      _write_json_atomically(self._path, ''.join(kept))

  def _keep(self, line: str, step: int) -> bool:
    if not line.endswith('\n'):
      return False
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      return False
    return row.get('split') not in self.TRAINING_SPLITS or row.get('step', 0) <= step

  def close(self):
    self._writer.flush()
    self._writer.close()


class _SignalFlag:
  """Within `with`, SIGTERM sets `.received` instead of ending the process."""

  def __init__(self, signum: int = signal.SIGTERM):
    self._signum = signum
    self._previous = None
    self.received = False

  def _handle(self, signum, frame):
    del frame
    logging.warning('Received signal %d: checkpointing and stopping after this step.', signum)
    self.received = True

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(self._signum, self._handle)
    return self

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(self._signum, self._previous)


def _nonfinite(metrics: dict[str, float]) -> str:
  """E.g. 'the loss (nan), the norm of the generated weights (inf)'."""
  return ', '.join(f'{name} ({metrics[k]})' for k, name in _WATCHED.items()
                   if not np.isfinite(metrics[k]))


class _DivergenceGuard:
  """Looks at fetched per-step metrics; says when training must stop."""

  def __init__(self, policy: str):
    self._policy = policy
    self._skipped = []  # Consecutive skipped steps.

  def check(self, rows: list[tuple[int, dict[str, float]]]) -> str | None:
    """Returns why training must stop, or None."""
    for step, metrics in rows:
      if not metrics['skipped']:
        self._skipped = []
        continue
      what = _nonfinite(metrics)
      if self._policy == 'stop':
        return f'Training diverged at step {step}: {what} became non-finite.'
      self._skipped.append(step)
      logging.warning('Step %d skipped (train.on_divergence=skip), not finite: %s.', step, what)
      if len(self._skipped) > MAX_CONSECUTIVE_SKIPS:
        return (f'Training diverged: the {len(self._skipped)} steps {self._skipped[0]}..'
                f'{step} were all skipped (train.on_divergence=skip), the last one '
                f'because {what} became non-finite.')
    return None


def _divergence_error(reason: str, manager: ocp.CheckpointManager,
                      policy: str) -> DivergenceError:
  try:
    manager.wait_until_finished()  # An earlier, good save may be in flight.
  except Exception as e:  # pylint: disable=broad-except
    logging.error('Saving an earlier checkpoint failed: %s', _root_cause(e))
  manager.reload()
  last = manager.latest_step()
  skip = '' if policy == 'skip' else ', or with train.on_divergence=skip to drop such steps'
  if last is None:
    return DivergenceError(
        f'{reason} No checkpoint had been written yet. Rerun with a lower '
        f'optim.learning_rate or a positive optim.grad_clip_norm{skip}.')
  return DivergenceError(
      f'{reason} The last good checkpoint, step {last} in {manager.directory}, is kept '
      f'(no later one was written). Rerun with a lower optim.learning_rate{skip}: training '
      'resumes from that checkpoint (a new optim.name or optim.grad_clip_norm needs a new '
      '--workdir, as the optimiser state would not fit).')


def _window_means(rows: list[tuple[int, dict[str, float]]], elapsed: float,
                  episodes_per_step: int) -> dict[str, float]:
  """Mean metrics over the steps of a log window that were not skipped."""
  kept = [m for _, m in rows if not m['skipped']] or [m for _, m in rows]
  means = {k: float(np.mean([m[k] for m in kept])) for k in kept[0] if k != 'skipped'}
  means['skipped_steps'] = float(sum(m['skipped'] for _, m in rows))
  means['steps_per_sec'] = len(rows) / elapsed
  means['episodes_per_sec'] = len(rows) * episodes_per_step / elapsed
  return means


# --------------------------------------------------------------------------
# The loop.
# --------------------------------------------------------------------------


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Meta-trains, checkpointing into `workdir` and resuming from it.

  Returns:
    The last logged training metrics.

  Raises:
    One of `USER_ERRORS` (bad config, data, workdir or checkpoint; divergence),
    or Preempted after SIGTERM, once the current step is checkpointed.
  """
  config_validation.validate(config)
  workdir = check_workdir(workdir)
  ht = methods.build(config)  # config.method: CHT or a baseline.
  optimizer = make_optimizer(config.optim)
  image_shape = datasets.image_shape(config)
  mesh = devices.data_mesh(config.train.episodes_per_step)
  replicated = jax.NamedSharding(mesh, jax.P())
  init_key, train_key, eval_key = jax.random.split(jax.random.key(config.seed), 3)
  init = jax.jit(lambda key: init_state(config, ht, optimizer, key, image_shape),
                 out_shardings=replicated)

  manager = checkpoint_manager(workdir, config, remove_partial=True)
  log = None
  try:
    latest = manager.latest_step()
    if latest is not None:  # Before any download or compilation.
      _check_fits(manager, latest, jax.eval_shape(init, init_key), config)
    dataset = load_dataset(config)
    state = restore_or_init(manager, init(init_key), config)
    _write_json_atomically(os.path.join(workdir, 'config.json'), config.to_json_best_effort())
    log = MetricsLog(workdir)
    log.drop_after(int(state.step))
    with _SignalFlag() as preemption:  # Until here SIGTERM just ends the process.
      return _train_loop(config, ht, optimizer, mesh, state, dataset, manager, log,
                         preemption, train_key, eval_key)
  finally:
    _close(manager)
    if log is not None:
      log.close()


def _train_loop(config, ht, optimizer, mesh, state, dataset, manager, log, preemption,
                train_key, eval_key) -> dict[str, float]:
  """Steps from `state.step` to `config.train.num_steps`."""
  replicated = jax.NamedSharding(mesh, jax.P())
  host = config.data.pipeline == 'host'
  domain_sizes = dataset.get('domain_sizes', {})
  train_images = None if host else jax.device_put(dataset['train'], replicated)
  validation_images = jax.device_put(dataset['validation'], replicated)
  train_step = make_train_step(config, ht, optimizer, mesh, domain_sizes.get('train', ()), host)
  eval_step = make_eval_step(config, ht, config.train.eval_episodes,
                             validation_tasks(config, len(dataset['validation'])),
                             domain_sizes.get('validation', ()))
  guard = _DivergenceGuard(config.train.on_divergence)
  tc = config.train
  first_step, num_steps = int(state.step), tc.num_steps
  logging.info('Training steps %d..%d, %d episode(s) per step on %d device(s).',
               first_step, num_steps, tc.episodes_per_step, jax.device_count())
  if preemption.received:
    kept = (f'the checkpoint of step {first_step} is kept' if first_step else
            'no step had been trained')
    raise Preempted(f'Stopped by SIGTERM before training step {first_step + 1}; {kept}.')

  if host:  # Host pipeline: the batch of step s is a function of (seed, s) too.
    batches = datasets.host_batches(config, first_step + 1)
    batch_sharding = jax.NamedSharding(mesh, jax.P('data'))
  pending, window, window_start, last_metrics = [], [], time.perf_counter(), {}
  for step in range(first_step + 1, num_steps + 1):
    if host:
      train_images = jax.tree.map(
          lambda x: jax.make_array_from_process_local_data(batch_sharding, x), next(batches))
    # Episodes of step s depend only on (seed, s): a resumed run sees the same data.
    state, metrics = train_step(state, train_images, jax.random.fold_in(train_key, step))
    pending.append((step, metrics))
    last = step == num_steps
    stop = preemption.received  # Read once: the signal may arrive at any moment.
    do_log = step % tc.log_every_steps == 0 or last or stop
    do_eval = tc.eval_every_steps and (step % tc.eval_every_steps == 0 or last)
    do_save = step % tc.checkpoint_every_steps == 0 or last or stop
    if not (do_log or do_eval or do_save):
      continue
    # Never log, evaluate or checkpoint past a step that diverged.
    fetched = list(zip([s for s, _ in pending], jax.device_get([m for _, m in pending])))
    pending, window = [], window + fetched
    reason = guard.check(fetched)
    if reason:
      raise _divergence_error(reason, manager, tc.on_divergence)
    if do_log:
      last_metrics = _window_means(window, time.perf_counter() - window_start,
                                   tc.episodes_per_step)
      log.write(step, 'train', last_metrics)
      logging.info('step %d/%d: loss %.4g, accuracy %.3f, final-task accuracy %.3f, '
                   '%.2f steps/s', step, num_steps, last_metrics['loss'],
                   last_metrics['accuracy'], last_metrics['final_accuracy'],
                   last_metrics['steps_per_sec'])
      window, window_start = [], time.perf_counter()
    if do_eval:
      eval_metrics = jax.device_get(eval_step(state.params, validation_images, eval_key))
      log.write(step, 'validation', eval_metrics)
      logging.info('step %d validation: accuracy %.3f, final-task accuracy %.3f',
                   step, eval_metrics['accuracy'], eval_metrics['final_accuracy'])
    if do_save:
      _save(manager, step, state, wait=last or stop)
    if stop and not last:
      raise Preempted(f'Stopped by SIGTERM after step {step}, checkpointed in '
                      f'{manager.directory}; rerun the same command to resume.')
  return last_metrics
