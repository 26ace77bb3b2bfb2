"""Meta-training: one jit-compiled step over a sharded batch of episodes.

Episodes are sampled on device inside the step (from the split's images kept
in device memory), so the input pipeline never waits on the host. The batch of
episodes is sharded over a 1-D `Mesh` of all devices ('data' axis); parameters
and optimiser state are replicated.
"""

import json
import os
import time
from typing import Any

from absl import logging
from clu import metric_writers
import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp

from cht_jax import continual
from cht_jax import models
from cht_jax.data import episodes as episodes_lib
from cht_jax.data import omniglot

OPTIMIZERS = ('sgd', 'momentum', 'adam')


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


def data_mesh() -> jax.sharding.Mesh:
  """A 1-D mesh over all devices; the episode batch is split along 'data'."""
  return jax.make_mesh((jax.device_count(),), ('data',),
                       axis_types=(jax.sharding.AxisType.Auto,))


def episode_spec(config: ml_collections.ConfigDict) -> episodes_lib.EpisodeSpec:
  ep = config.episode
  return episodes_lib.EpisodeSpec(
      num_tasks=ep.num_tasks, ways=ep.ways, shots=ep.shots,
      queries_per_class=ep.queries_per_class, task_classes=ep.task_classes)


def load_dataset(config: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
  """Images of every split, uint8 [classes, images per class, H, W, 1]."""
  data = config.data
  return omniglot.load_omniglot(
      data_dir=data.data_dir or None, manual_dir=data.manual_dir or None,
      split_scheme=data.split_scheme, split_seed=data.split_seed,
      image_size=data.image_size)


def init_state(config, ht, optimizer, key, image_shape) -> TrainState:
  num_ways = config.episode.ways
  support_images = jnp.zeros((num_ways * config.episode.shots, *image_shape))
  support_labels = jnp.zeros((num_ways * config.episode.shots,), jnp.int32)
  theta = models.hypertransformer.zeros_theta(ht.cnn, image_shape)
  params = ht.init(key, support_images, support_labels, theta)['params']
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=optimizer.init(params))


def batch_loss(ht, params, episodes, loss, remat):
  """Mean over a batch of episodes of Algorithm 1's loss, and mean metrics."""
  _, metrics = jax.vmap(
      lambda episode: continual.episode_loss(ht, params, episode, loss, remat))(episodes)
  metrics = jax.tree.map(jnp.mean, metrics)
  return metrics['loss'], metrics


def make_train_step(config, ht, optimizer, mesh):
  """Returns jit(step)(state, class_images, key) -> (state, metrics)."""
  spec = episode_spec(config)
  batch_sharding = jax.NamedSharding(mesh, jax.P('data'))
  schedule = learning_rate_schedule(config.optim)

  def train_step(state: TrainState, class_images, key):
    episodes = episodes_lib.sample_episodes(
        key, class_images, spec, config.train.episodes_per_step, rotate=config.data.rotate)
    episodes = jax.lax.with_sharding_constraint(episodes, batch_sharding)
    grad_fn = jax.grad(
        lambda p: batch_loss(ht, p, episodes, config.loss, config.model.remat), has_aux=True)
    grads, metrics = grad_fn(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics['grad_norm'] = optax.global_norm(grads)
    metrics['learning_rate'] = schedule(state.step)
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return jax.jit(train_step, donate_argnums=0)


def make_eval_step(config, ht, num_episodes: int):
  """Returns jit(evaluate)(params, class_images, key) -> metrics, no augmentation."""
  spec = episode_spec(config)

  def eval_step(params, class_images, key):
    episodes = episodes_lib.sample_episodes(key, class_images, spec, num_episodes, rotate=False)
    _, metrics = batch_loss(ht, params, episodes, config.loss, remat=False)
    return metrics

  return jax.jit(eval_step)


def checkpoint_manager(workdir: str, config) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
      os.path.join(os.path.abspath(workdir), 'checkpoints'),
      options=ocp.CheckpointManagerOptions(
          max_to_keep=config.train.keep_checkpoints, create=True))


def restore_or_init(manager: ocp.CheckpointManager, state: TrainState) -> TrainState:
  """The latest checkpoint of the workdir if any, else `state` unchanged."""
  step = manager.latest_step()
  if step is None:
    return state
  logging.info('Resuming from the checkpoint of step %d in %s.', step, manager.directory)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  return manager.restore(step, args=ocp.args.StandardRestore(abstract))


class MetricsLog:
  """TensorBoard summaries and a JSON-lines copy (`metrics.jsonl`) for scripts."""

  def __init__(self, workdir: str):
    self._is_main = jax.process_index() == 0
    self._writer = metric_writers.create_default_writer(
        workdir, just_logging=not self._is_main)
    self._path = os.path.join(workdir, 'metrics.jsonl')

  def write(self, step: int, split: str, metrics: dict[str, float]):
    scalars = {f'{split}/{k}': float(v) for k, v in metrics.items()}
    self._writer.write_scalars(step, scalars)
    if self._is_main:
      with open(self._path, 'a') as f:
        f.write(json.dumps({'step': step, 'split': split, **scalars}) + '\n')

  def close(self):
    self._writer.flush()
    self._writer.close()


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Meta-trains, checkpointing into `workdir` and resuming from it.

  Returns:
    The last logged training metrics.
  """
  os.makedirs(workdir, exist_ok=True)
  dataset = load_dataset(config)
  image_shape = dataset['train'].shape[2:]
  mesh = data_mesh()
  replicated = jax.NamedSharding(mesh, jax.P())
  train_images = jax.device_put(dataset['train'], replicated)
  validation_images = jax.device_put(dataset['validation'], replicated)

  ht = models.build_hypertransformer(config)
  optimizer = make_optimizer(config.optim)
  init_key, train_key, eval_key = jax.random.split(jax.random.key(config.seed), 3)
  state = jax.device_put(init_state(config, ht, optimizer, init_key, image_shape), replicated)
  manager = checkpoint_manager(workdir, config)
  state = restore_or_init(manager, state)
  first_step = int(state.step)

  train_step = make_train_step(config, ht, optimizer, mesh)
  eval_step = make_eval_step(config, ht, config.train.eval_episodes)
  log = MetricsLog(workdir)
  episodes_per_step = config.train.episodes_per_step
  num_steps = config.train.num_steps
  logging.info('Training steps %d..%d, %d episode(s) per step on %d device(s).',
               first_step, num_steps, episodes_per_step, jax.device_count())

  window, window_start, last_metrics = [], time.perf_counter(), {}
  for step in range(first_step + 1, num_steps + 1):
    # Episodes of step s depend only on (seed, s): a resumed run sees the same data.
    state, metrics = train_step(state, train_images, jax.random.fold_in(train_key, step))
    window.append(metrics)
    if step % config.train.log_every_steps == 0 or step == num_steps:
      metrics = jax.tree.map(lambda *m: float(np.mean(m)), *jax.device_get(window))
      elapsed = time.perf_counter() - window_start
      metrics['steps_per_sec'] = len(window) / elapsed
      metrics['episodes_per_sec'] = len(window) * episodes_per_step / elapsed
      _check_finite(step, metrics)
      log.write(step, 'train', metrics)
      logging.info('step %d/%d: loss %.4g, accuracy %.3f, final-task accuracy %.3f, '
                   '%.2f steps/s', step, num_steps, metrics['loss'], metrics['accuracy'],
                   metrics['final_accuracy'], metrics['steps_per_sec'])
      window, window_start, last_metrics = [], time.perf_counter(), metrics
    if config.train.eval_every_steps and (
        step % config.train.eval_every_steps == 0 or step == num_steps):
      eval_metrics = jax.device_get(eval_step(state.params, validation_images, eval_key))
      log.write(step, 'validation', eval_metrics)
      logging.info('step %d validation: accuracy %.3f, final-task accuracy %.3f',
                   step, eval_metrics['accuracy'], eval_metrics['final_accuracy'])
    if step % config.train.checkpoint_every_steps == 0 or step == num_steps:
      manager.save(step, args=ocp.args.StandardSave(state))
  manager.wait_until_finished()
  manager.close()
  log.close()
  return last_metrics


class DivergenceError(FloatingPointError):
  pass


def _check_finite(step: int, metrics: dict[str, float]):
  bad = [k for k in ('loss', 'grad_norm') if not np.isfinite(metrics[k])]
  if bad:
    raise DivergenceError(
        f'Training diverged by step {step}: {", ".join(bad)} became non-finite '
        f'({", ".join(f"{k}={metrics[k]}" for k in bad)}). The last checkpoint '
        'before this step is kept. Lower optim.learning_rate, set '
        'optim.grad_clip_norm, or use optim.name=adam.')
