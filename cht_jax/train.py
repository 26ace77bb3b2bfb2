"""Training of every method: one jit-compiled step over a sharded batch, and the loop.

The method (`methods.build`) gives the step its gradient from episodes sampled on device
(or a host pipeline's batch) or, for the baselines, a batch of images or MAML++ episodes.
The batch is sharded over a 1-D `Mesh` ('data' axis); parameters and optimiser state
(optim.py) are replicated. Reliability (docs/reliability.md): the data of step s depend only
on (config.seed, s), so a resumed run repeats an uninterrupted one bit for bit; checkpoints
are whole or absent (runtime/checkpoints.py); SIGTERM checkpoints the current step
(runtime/preemption.py); a non-finite step changes nothing but the step count
(`train.on_divergence`; `train.loss_spike_factor` rolls back a finite collapse:
runtime/divergence.py); every user mistake is one of `USER_ERRORS`, naming what to do.
"""

import time
from typing import Any

from absl import logging
import flax
import jax
from jax import flatten_util
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from cht_jax import config_validation
from cht_jax import evaluate
from cht_jax import methods
from cht_jax import optim as optim_lib
from cht_jax.data import datasets
from cht_jax.data import episodes as episodes_lib
from cht_jax.data import omniglot
from cht_jax.runtime import checkpoints
from cht_jax.runtime import devices
from cht_jax.runtime import divergence
from cht_jax.runtime import preemption
from cht_jax.runtime import progress as progress_lib
from cht_jax.runtime import workdir as workdir_lib

# Errors whose message is the whole story: `main` prints it without traceback.
USER_ERRORS = (config_validation.ConfigError, omniglot.DataError, divergence.DivergenceError,
               checkpoints.CheckpointError, workdir_lib.WorkdirError, evaluate.EvaluationError)


# ====== The state and the training step ===============================================

@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


def method_schedule(method: methods.Method) -> optax.Schedule:
  """The method's learning-rate schedule, else `optim.learning_rate_schedule`'s."""
  optim = method.config.optim
  return method.learning_rate(optim) or optim_lib.learning_rate_schedule(optim)


def make_init(method: methods.Method, optimizer, mesh):
  """jit(key) -> the initial TrainState, replicated over `mesh` as the step returns it (a
  state of another sharding would compile the step a second time)."""
  def init(key):
    params = method.init(key)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params))
  return jax.jit(init, out_shardings=jax.NamedSharding(mesh, jax.P()))


def make_train_step(method: methods.Method, optimizer, mesh, variant=(), domain_sizes=(),
                    host=False):
  """Returns jit(step)(state, data, key, inputs=(), learning_rate_scale=None)
  -> (state, metrics).

  `data` is the training split's class images, or with `host` a host
  pipeline's episode batch (`datasets.host_batches`); `variant` and `inputs`
  come from `method.step_variant(step)`; `learning_rate_scale`, a traced scalar,
  multiplies the schedule's rate (below 1 after a loss-spike rollback). None runs the
  unscaled program: a multiply by a traced 1.0 would change how XLA fuses (and rounds)
  the update.

  A step where one of `divergence.WATCHED` (the loss, the norms of the
  gradient, of the generated weights and of the update) is not finite
  returns the parameters and optimiser state it was given (only the step
  count advances) and reports metrics['skipped'] = 1.
  """
  schedule = method_schedule(method)

  def train_step(state: TrainState, data, key, inputs=(), learning_rate_scale=None):
    grads, metrics = method.grads(state.params, data, key, mesh=mesh, variant=variant,
                                  inputs=inputs, domain_sizes=domain_sizes, host=host)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    learning_rate = schedule(state.step)
    if learning_rate_scale is not None:  # None (scale 1): exactly the unscaled program.
      # Every optimiser here ends by multiplying its update by the learning rate, so
      # scaling the update scales the learning rate (and AdamW's decay with it).
      updates = jax.tree.map(lambda u: u * learning_rate_scale, updates)
      learning_rate = learning_rate * learning_rate_scale
    params = optax.apply_updates(state.params, updates)
    metrics['grad_norm'] = _global_norm(grads)
    metrics['update_norm'] = _global_norm(updates)
    metrics['learning_rate'] = learning_rate
    watched = [metrics[k] for k in divergence.WATCHED if k in metrics]
    finite = jnp.all(jnp.isfinite(jnp.stack(watched)))
    metrics['skipped'] = 1.0 - finite.astype(jnp.float32)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    return TrainState(step=state.step + 1, params=keep(params, state.params),
                      opt_state=keep(opt_state, state.opt_state)), metrics

  return jax.jit(train_step, donate_argnums=0)


def _global_norm(tree) -> jax.Array:
  """The L2 norm of all of `tree`'s values as one vector: one reduction, where
  `optax.tree.norm` has one per leaf, each compiled as a kernel of its own."""
  return jnp.linalg.norm(flatten_util.ravel_pytree(tree)[0])


# ====== Validation during training ====================================================

def batch_loss(method, params, episodes, loss, remat):
  """Mean over a batch of episodes of Algorithm 1's loss, and mean metrics."""
  _, metrics = jax.vmap(
      lambda episode: method.episode_loss(params, episode, loss, remat))(episodes)
  metrics = jax.tree.map(jnp.mean, metrics)
  return metrics['loss'], metrics


def validation_tasks(config: ml_collections.ConfigDict, num_classes: int) -> int:
  """Tasks per validation episode: T, or as many disjoint tasks as the classes allow
  (Omniglot's 50 validation classes: two disjoint 20-way tasks)."""
  ep = config.episode
  if ep.task_classes != 'disjoint':
    return ep.num_tasks
  return max(1, min(ep.num_tasks, num_classes // ep.ways))


def make_eval_step(method: methods.Method, num_episodes: int, num_tasks: int | None = None,
                   domain_sizes=()):
  """jit(evaluate)(params, class_images, key) -> the loss metrics of `num_episodes`
  episodes without augmentation, of `num_tasks` (None: the config's T) tasks."""
  spec = datasets.episode_spec(method.config, domain_sizes)
  if num_tasks is not None:
    spec = spec._replace(num_tasks=num_tasks)

  def eval_step(params, class_images, key):
    episodes = episodes_lib.sample_episodes(key, class_images, spec, num_episodes, rotate=False)
    _, metrics = batch_loss(method, params, episodes, method.config.loss, remat=False)
    return metrics

  return jax.jit(eval_step)


def make_validation(method: methods.Method, class_images, domain_sizes=()):
  """validate(params, key) -> metrics of the validation classes: by `method.validation`, the
  loss metrics of train.eval_episodes episodes ('loss'), or ('protocol') the evaluation
  protocol on as many episodes, one query draw, the accuracies of theta_{T-1}."""
  config = method.config
  num_tasks = validation_tasks(config, len(class_images))
  if method.validation == 'loss':
    step = make_eval_step(method, config.train.eval_episodes, num_tasks, domain_sizes)
    specificity = make_validation_specificity(method, class_images, domain_sizes)
    return lambda params, key: {**jax.device_get(step(params, class_images, key)),
                                **specificity(params)}
  protocol = evaluate.default_protocol(
      config, num_tasks=num_tasks, num_episodes=config.train.eval_episodes,
      num_query_draws=1, split='validation', batch_size=config.train.eval_episodes)

  def validate(params, key):
    del key  # The protocol's episodes have their own seed.
    per_episode = evaluate.run_protocol(method, params, class_images, protocol)
    final = lambda name: float(np.nanmean(per_episode[name][:, -1, :]))
    return {'class_incremental_final': final('class_incremental'),
            'task_incremental_final': final('task_incremental')}
  return validate


def make_validation_specificity(method: methods.Method, class_images, domain_sizes=()):
  """specificity(params) -> {'specificity_own', '_swapped', '_difference'}: the evaluation's task
  specificity (evaluate.task_specificity) on train.eval_episodes pairs of validation tasks,
  one query draw, so that a curve shows when the written CNN starts to depend on its task;
  {} where the method writes no CNN from a support set or the classes are too few."""
  config = method.config
  protocol = evaluate.default_protocol(
      config, num_tasks=2, num_episodes=config.train.eval_episodes, num_query_draws=1,
      split='validation', batch_size=config.train.eval_episodes,
      specificity_pairs=config.train.eval_episodes)
  spec = evaluate.evaluation_spec(config, protocol, domain_sizes)
  if evaluate.why_specificity_unmeasured(method, spec, class_images, 'validation'):
    return lambda params: {}
  per_pair_of = evaluate.make_specificity(method, class_images, protocol, spec)

  def specificity(params):
    per_pair = per_pair_of(params)
    own, swapped = float(per_pair['own'].mean()), float(per_pair['swapped'].mean())
    return {'specificity_own': own, 'specificity_swapped': swapped,
            'specificity_difference': own - swapped}
  return specificity


# ====== The run and its loop ==========================================================

def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       dataset: dict[str, np.ndarray] | None = None) -> dict[str, float]:
  """Trains `config.method`, checkpointing into `workdir` and resuming from it.

  `dataset`: split name -> uint8 [C, M, H, W, D] class images (None: loaded). Returns the last
  logged training metrics (and 'validation/...' of the last validation). Raises one of
  `USER_ERRORS`, or preemption.Preempted after SIGTERM or SIGINT once the step is saved.
  """
  config_validation.validate(config)
  created = workdir_lib.new_folders(workdir)
  workdir = workdir_lib.check_workdir(workdir)
  try:
    with workdir_lib.RunLock(workdir):  # One training run per workdir.
      return _train(config, workdir, dataset)
  finally:  # A start that failed before writing anything leaves no folders behind.
    workdir_lib.remove_if_empty(created)


def _train(config, workdir, dataset) -> dict[str, float]:
  """`train_and_evaluate` once the workdir is this run's."""
  evaluate.warn_if_evaluation_cannot_run(config)
  method = methods.build(config, None if dataset is None else len(dataset['train']))
  optimizer = optim_lib.make_optimizer(method.config.optim, method_schedule(method))
  mesh = devices.data_mesh(method.batch_size)
  init_key, train_key, eval_key = jax.random.split(jax.random.key(config.seed), 3)
  init = make_init(method, optimizer, mesh)  # Traced once, for its shapes and to run.

  manager = checkpoints.manager(workdir, config, remove_partial=True)
  log = None
  try:
    latest = manager.latest_step()
    if latest is not None:  # Before any download or compilation.
      checkpoints.check_fits(manager, latest, init.eval_shape(init_key), config)
    if dataset is None:
      dataset = datasets.load_dataset(config)
    methods.check_training_episodes(method, dataset)
    state = checkpoints.restore_or_init(manager, init(init_key), config)
    workdir_lib.record_start(workdir, config, int(state.step))
    log = workdir_lib.MetricsLog(workdir)
    log.drop_after(int(state.step))
    with preemption.SignalFlag() as signals:  # Until here SIGTERM just ends the process.
      return _train_loop(method, optimizer, mesh, state, dataset, manager, log, signals,
                         train_key, eval_key)
  finally:
    checkpoints.close(manager)
    if log is not None:
      log.close()


def _train_loop(method, optimizer, mesh, state, dataset, manager, log, signals,
                train_key, eval_key) -> dict[str, float]:
  """Steps from `state.step` to `config.train.num_steps`."""
  config, tc = method.config, method.config.train
  replicated = jax.NamedSharding(mesh, jax.P())
  host = config.data.pipeline == 'host'
  domain_sizes = dataset.get('domain_sizes', {})
  train_data = None if host else jax.device_put(dataset['train'], replicated)
  validate = make_validation(method, jax.device_put(dataset['validation'], replicated),
                             domain_sizes.get('validation', ()))
  train_steps = {}  # One compiled step per variant (MAML++'s phases; one for the rest).
  guard = divergence.Guard(tc.on_divergence)
  rollbacks = divergence.Rollbacks(tc.loss_spike_factor, log, int(state.step))
  first_step, num_steps = int(state.step), tc.num_steps
  logging.info('%s: training steps %d..%d, %d per step on %d device(s).',
               method.display_name, first_step, num_steps, method.batch_size,
               mesh.devices.size)
  if signals.received and jax.process_count() == 1:  # Several: they agree at step 1.
    kept = (f'the checkpoint of step {first_step} is kept' if first_step else
            'no step had been trained')
    raise preemption.Preempted(f'Stopped by {signals.name} before training step '
                               f'{first_step + 1}; {kept}.', signals.signum)

  if host:  # Host pipeline: the batch of step s is a function of (seed, s) too.
    batches = datasets.host_batches(config, first_step + 1)
    batch_sharding = jax.NamedSharding(mesh, jax.P('data'))
  pending, window, window_start, last_metrics = [], [], time.perf_counter(), {}
  progress = progress_lib.Progress(num_steps, 'steps', first_step)
  step = first_step
  while step < num_steps:
    step += 1
    if host:
      train_data = jax.tree.map(
          lambda x: jax.make_array_from_process_local_data(batch_sharding, x), next(batches))
    variant, inputs = method.step_variant(step)
    if variant not in train_steps:
      train_steps[variant] = make_train_step(method, optimizer, mesh, variant,
                                             domain_sizes.get('train', ()), host)
    # The data of step s depend only on (seed, s): a resumed run sees the same.
    scale = rollbacks.learning_rate_scale
    state, metrics = train_steps[variant](state, train_data, jax.random.fold_in(train_key, step),
                                          inputs, None if scale == 1.0 else jnp.float32(scale))
    pending.append((step, metrics))
    last = step == num_steps
    stop = signals.stop_at(step)  # Read once: the signal may arrive at any moment.
    do_log = step % tc.log_every_steps == 0 or last or stop
    do_eval = tc.eval_every_steps and (step % tc.eval_every_steps == 0 or last)
    do_save = step % tc.checkpoint_every_steps == 0 or last or stop
    if step == first_step + 1 or (progress.due() and not do_log):  # Lines between log steps.
      jax.block_until_ready(metrics)  # The steps done, not just dispatched.
      if step == first_step + 1:  # Its time includes compilation: the speed is measured after.
        logging.info('step %d/%d: the first step took %s (compilation included).', step,
                     num_steps, progress_lib.duration(progress.seconds()))
        progress.restart(step)
      else:
        logging.info('step %d/%d: %s', step, num_steps, progress.status(step))
    if not (do_log or do_eval or do_save):
      continue
    # Never log, evaluate or checkpoint past a step that diverged.
    fetched = list(zip([s for s, _ in pending], jax.device_get([m for _, m in pending])))
    pending, window = [], window + fetched
    reason = guard.check(fetched)
    if reason:
      raise divergence.checkpointed_error(reason, manager, tc.on_divergence)
    if do_log:
      last_metrics = workdir_lib.window_means(window, time.perf_counter() - window_start,
                                   tc.episodes_per_step)
      log.write(step, 'train', last_metrics)
      logging.info('step %d/%d: %s, %s', step, num_steps, ', '.join(
          f'{k} {last_metrics[k]:.4g}' for k in ('loss', 'accuracy', 'final_accuracy')
          if k in last_metrics), progress.status(step))
      window, window_start = [], time.perf_counter()
      if rollbacks.is_spike(step, last_metrics['loss'], state):
        state = rollbacks.roll_back(step, manager)
        step = int(state.step)
        progress.restart(step)
        if not stop:
          if host:
            batches = datasets.host_batches(config, step + 1)
          continue
        # Stopping: checkpoint the rolled-back state below, unless it is saved already.
        do_eval, last, do_save = False, False, step not in manager.all_steps()
    if do_eval:
      validation = validate(state.params, eval_key)
      log.write(step, 'validation', validation)
      last_metrics.update({f'validation/{k}': float(v) for k, v in validation.items()})
      logging.info('step %d validation: %s', step,
                   ', '.join(f'{k} {float(v):.3f}' for k, v in validation.items()))
    if do_save:
      checkpoints.save(manager, step, state, wait=last or stop)
    if stop and not last:
      raise preemption.Preempted(f'Stopped by {signals.name} after step {step}, checkpointed '
                                 f'in {manager.directory}; rerun the same command to resume.',
                                 signals.signum)
  return last_metrics

