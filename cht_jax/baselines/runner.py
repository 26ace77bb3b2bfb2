"""Entry points of the Table 1 baselines: training (`train_and_evaluate`) and the protocol
(`evaluate_checkpoint`), for `config.method` in METHODS.

  finetune  pretrain `models.cnn.CNN` on the training classes (config.train.num_steps
            batches of baseline.pretrain_batch_size), then for every test episode
            fine-tune it task after task with a fresh K*T head
            (baseline.inner_steps SGD steps of baseline.inner_learning_rate per task).
  ewc       the same pretrained network and fine-tuning, plus EWC's penalty
            (baseline.ewc_lambda, baseline.ewc_fisher).
  maml      meta-train MAML++ (maml.py) on episodes of the training classes for
            config.train.num_steps steps, then run its inner loop task after task.

Training checkpoints into `<workdir>/checkpoints` (Orbax, `train.checkpoint_manager`,
a `train.TrainState`) and resumes from the latest; metrics go to `train.MetricsLog`
(`metrics.jsonl` and TensorBoard). Evaluation draws the same episodes as CHT's
(`episodes.sample_evaluation_episode` from fold_in(seed, i)) and writes the same
files as `evaluate.write_results`: `<workdir>/eval/<split>_T<T>_step<step>.*`.
"""

import dataclasses
import json
import os
import time
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp

from cht_jax import baselines
from cht_jax import config_validation
from cht_jax import continual
from cht_jax import evaluate as evaluate_lib
from cht_jax import train
from cht_jax.baselines import ewc
from cht_jax.baselines import maml
from cht_jax.baselines import pretrain
from cht_jax.baselines import rules
from cht_jax.baselines import sequential
from cht_jax.data import episodes as episodes_lib
from cht_jax.data import omniglot

METHODS = baselines.METHODS
DISPLAY_NAMES = {'finetune': 'Pretraining + fine-tuning', 'ewc': 'EWC', 'maml': 'MAML++'}


def _method(config: ml_collections.ConfigDict) -> str:
  if config.method not in METHODS:
    raise config_validation.ConfigError(
        f'config.method = {config.method!r} is not a baseline of cht_jax.baselines; '
        f'expected one of {METHODS}.')
  return config.method


def num_train_classes(config: ml_collections.ConfigDict,
                      dataset: dict[str, np.ndarray] | None = None) -> int:
  """C, the classes of the training split (from the split alone if no dataset)."""
  if dataset is not None:
    return len(dataset['train'])
  return len(omniglot.class_split(config.data.split_scheme, config.data.split_seed)['train'])


def training_cnn(config: ml_collections.ConfigDict, num_classes: int):
  """The CNN trained by `train_and_evaluate`: C logits (pretraining) or K*T (MAML++)."""
  if _method(config) == 'maml':
    return pretrain.build_cnn(config, config.episode.ways * config.episode.num_tasks)
  return pretrain.build_cnn(config, num_classes)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """`train.make_optimizer`, or for MAML++ with cosine annealing the same optimiser on
  a cosine schedule from optim.learning_rate to baseline.maml_min_learning_rate."""
  b, optim = config.baseline, config.optim
  if not (_method(config) == 'maml' and b.maml_cosine_annealing):
    return train.make_optimizer(optim)
  schedule = optax.cosine_decay_schedule(
      optim.learning_rate, config.train.num_steps,
      alpha=min(b.maml_min_learning_rate / optim.learning_rate, 1.0))
  optimizer = {'sgd': lambda: optax.sgd(schedule),
               'momentum': lambda: optax.sgd(schedule, momentum=optim.momentum),
               'adam': lambda: optax.adam(schedule)}[optim.name]()
  if optim.grad_clip_norm > 0:
    optimizer = optax.chain(optax.clip_by_global_norm(optim.grad_clip_norm), optimizer)
  return optimizer


def init_state(config: ml_collections.ConfigDict, optimizer, key: jax.Array,
               num_classes: int) -> train.TrainState:
  """Step 0: the pretraining CNN, or MAML++'s {'theta', 'lslr'}."""
  cnn = training_cnn(config, num_classes)
  params = pretrain.init_theta(cnn, key, config.data.image_size)
  if _method(config) == 'maml':
    params = maml.init_params(params, config.baseline.inner_steps,
                              config.baseline.inner_learning_rate)
  return train.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=optimizer.init(params))


# --------------------------------------------------------------------------
# Training.
# --------------------------------------------------------------------------


def make_train_step(config: ml_collections.ConfigDict, cnn, optimizer,
                    first_order: bool = False, multi_step: bool = False):
  """jit(step)(state, class_images, key, step_weights [k]) -> (state, metrics).

  Pretraining: one batch of baseline.pretrain_batch_size images. MAML++:
  train.episodes_per_step episodes; `first_order` and `multi_step` (whether
  `step_weights` is used) are fixed per compiled step.
  """
  method, b = _method(config), config.baseline

  def loss_fn(params, class_images, key, step_weights):
    if method != 'maml':
      images, labels = pretrain.sample_batch(key, class_images, b.pretrain_batch_size,
                                             config.data.rotate)
      loss, accuracy = pretrain.batch_loss(cnn, params, images, labels)
      return loss, {'loss': loss, 'accuracy': accuracy}
    episodes = episodes_lib.sample_episodes(key, class_images, train.episode_spec(config),
                                            config.train.episodes_per_step, config.data.rotate)
    _, metrics = jax.vmap(lambda episode: maml.episode_loss(
        cnn, params, episode, config.episode.ways, b.inner_steps,
        step_weights if multi_step else None, first_order, b.maml_learn_inner_lr))(episodes)
    metrics = jax.tree.map(jnp.mean, metrics)
    return metrics['loss'], metrics

  def step(state, class_images, key, step_weights):
    grads, metrics = jax.grad(loss_fn, has_aux=True)(state.params, class_images, key,
                                                      step_weights)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    metrics['grad_norm'] = optax.tree.norm(grads)
    return train.TrainState(step=state.step + 1,
                            params=optax.apply_updates(state.params, updates),
                            opt_state=opt_state), metrics

  return jax.jit(step, donate_argnums=0)


def _step_variant(config, step: int) -> tuple[bool, bool, np.ndarray]:
  """(first_order, multi_step, step_weights) of training step `step` (1-based)."""
  b = config.baseline
  first_order = step <= b.maml_first_order_steps
  multi_step = bool(b.maml_multi_step_loss) and step - 1 < b.maml_msl_anneal_steps
  weights = maml.multi_step_weights(step - 1, b.inner_steps, b.maml_msl_anneal_steps)
  return first_order, multi_step, weights


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       dataset: dict[str, np.ndarray] | None = None) -> dict[str, float]:
  """Pretrains (finetune, ewc) or meta-trains (maml), checkpointing and resuming.

  Args:
    config: a `configs/baselines_table1.py` config.
    workdir: checkpoints, metrics.jsonl, TensorBoard events, config.json.
    dataset: split name -> uint8 [C, M, H, W, 1]; None to load Omniglot
      (`train.load_dataset`).

  Returns:
    The last logged training metrics (plus 'validation/...' of the last
    validation, when there was one).
  """
  config_validation.validate(config)
  method = _method(config)
  workdir = train.check_workdir(workdir)
  tc = config.train
  if dataset is None:
    dataset = train.load_dataset(config)
  num_classes = num_train_classes(config, dataset)
  cnn = training_cnn(config, num_classes)
  optimizer = make_optimizer(config)
  init_key, train_key = jax.random.split(jax.random.key(config.seed))
  state = jax.jit(lambda key: init_state(config, optimizer, key, num_classes))(init_key)
  manager = train.checkpoint_manager(workdir, config, remove_partial=True)
  log = None
  try:
    state = train.restore_or_init(manager, state, config)
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      f.write(config.to_json_best_effort())
    log = train.MetricsLog(workdir)
    log.drop_after(int(state.step))
    train_images = jnp.asarray(dataset['train'])
    steps = {}
    first_step = int(state.step)
    logging.info('%s: training steps %d..%d.', DISPLAY_NAMES[method], first_step, tc.num_steps)
    window, window_start, last = [], time.perf_counter(), {}
    for step in range(first_step + 1, tc.num_steps + 1):
      first_order, multi_step, weights = _step_variant(config, step)
      variant = (first_order, multi_step) if method == 'maml' else (False, False)
      if variant not in steps:
        steps[variant] = make_train_step(config, cnn, optimizer, *variant)
      state, metrics = steps[variant](state, train_images, jax.random.fold_in(train_key, step),
                                      jnp.asarray(weights))
      window.append(metrics)
      is_last = step == tc.num_steps
      if step % tc.log_every_steps == 0 or is_last:
        rows = jax.device_get(window)
        last = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
        last['steps_per_sec'] = len(rows) / (time.perf_counter() - window_start)
        if not np.isfinite(last['loss']):
          raise train.DivergenceError(
              f'{DISPLAY_NAMES[method]} training diverged before step {step} (loss '
              f'{last["loss"]}). Rerun with a lower optim.learning_rate; the last good '
              f'checkpoint in {manager.directory} is kept.')
        log.write(step, 'train', last)
        logging.info('step %d/%d: loss %.4g, accuracy %.3f, %.2f steps/s', step,
                     tc.num_steps, last['loss'], last['accuracy'], last['steps_per_sec'])
        window, window_start = [], time.perf_counter()
      if tc.eval_every_steps and (step % tc.eval_every_steps == 0 or is_last):
        validation = _validate(config, state.params, dataset['validation'])
        log.write(step, 'validation', validation)
        last.update({f'validation/{k}': v for k, v in validation.items()})
      if step % tc.checkpoint_every_steps == 0 or is_last:
        manager.save(step, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
    return last
  finally:
    manager.close()
    if log is not None:
      log.close()


def _validate(config, params, class_images) -> dict[str, float]:
  """The protocol on the validation classes: train.eval_episodes episodes, one query
  draw, as many tasks as the split allows; accuracies of theta_{T-1}."""
  num_tasks = train.validation_tasks(config, len(class_images))
  protocol = evaluate_lib.default_protocol(
      config, num_tasks=num_tasks, num_episodes=config.train.eval_episodes,
      num_query_draws=1, split='validation', batch_size=config.train.eval_episodes)
  per_episode = run_protocol(config, params, class_images, protocol)
  final = lambda name: float(np.nanmean(per_episode[name][:, -1, :]))
  return {'class_incremental_final': final('class_incremental'),
          'task_incremental_final': final('task_incremental')}


# --------------------------------------------------------------------------
# Evaluation.
# --------------------------------------------------------------------------


def sequence_learner(config: ml_collections.ConfigDict, params: Any, num_tasks: int):
  """(cnn with a K*num_tasks head, learn(support_images [T, S, ...], support_labels [T, S])
  -> theta_0..theta_{T-1}, leaves [T, ...]) of the trained `params`."""
  method, b, ways = _method(config), config.baseline, config.episode.ways
  num_outputs = ways * num_tasks
  cnn = pretrain.build_cnn(config, num_outputs)
  if method == 'maml':
    trained = config.episode.num_tasks
    if num_tasks > trained:
      raise evaluate_lib.EvaluationError(
          f'MAML++ was meta-trained with a head for T={trained} tasks of {ways} classes; '
          f'it cannot be evaluated on {num_tasks} tasks. Use --eval_tasks <= {trained}.')
    head = params['theta']['head']
    theta = {**params['theta'], 'head': {'kernel': head['kernel'][:, :num_outputs],
                                         'bias': head['bias'][:num_outputs]}}
    lslr = params['lslr']
    def learn(images, labels):
      return maml.learn(cnn, {'theta': theta, 'lslr': lslr}, images, labels, ways,
                        b.inner_steps)
    return cnn, learn
  theta = pretrain.fresh_head(params, num_outputs, b.head_init,
                              jax.random.fold_in(jax.random.key(config.seed), 1))
  if method == 'finetune':
    rule = rules.finetune_rule(cnn, ways, b.inner_steps, b.inner_learning_rate)
    state = ()
  else:
    rule = rules.ewc_rule(cnn, ways, b.inner_steps, b.inner_learning_rate, b.ewc_lambda,
                          b.ewc_fisher)
    state = ewc.init_state(theta, num_tasks)
  return cnn, lambda images, labels: sequential.run_sequence(rule, theta, state, images,
                                                             labels)


def make_evaluate_batch(config: ml_collections.ConfigDict, spec: episodes_lib.EpisodeSpec,
                        num_query_draws: int, vectorize: bool):
  """jit(fn)(params, class_images, key, indices [B]) -> (task_inc, class_inc) [B, P].

  Episode i is drawn from fold_in(key, i), as `evaluate.make_evaluate_batch`
  draws CHT's: every method is scored on the same episodes.
  """
  pairs = continual.TaskPairs.lower_triangle(spec.num_tasks)

  def evaluate_batch(params, class_images, key, indices):
    cnn, learn = sequence_learner(config, params, spec.num_tasks)
    def one(index):
      episode = episodes_lib.sample_evaluation_episode(
          jax.random.fold_in(key, index), class_images, spec, num_query_draws)
      thetas = learn(episode['support_images'], episode['support_labels'])
      return sequential.episode_accuracies(cnn, thetas, episode['query_images'],
                                           episode['query_labels'], spec.ways, pairs,
                                           vectorize)
    return jax.lax.map(one, indices, batch_size=len(indices) if vectorize else None)

  return jax.jit(evaluate_batch)


def run_protocol(config: ml_collections.ConfigDict, params: Any, class_images,
                 protocol: evaluate_lib.Protocol, vectorize: bool | None = None
                 ) -> dict[str, Any]:
  """`evaluate.run_protocol` for a baseline: per-episode matrices [E, T, T] and timing."""
  spec = evaluate_lib.evaluation_spec(config, protocol)
  if vectorize is None:
    vectorize = continual.default_vectorize()
  evaluate_batch = make_evaluate_batch(config, spec, protocol.num_query_draws, vectorize)
  return evaluate_lib.run_batches(evaluate_batch, params, class_images, spec, protocol,
                                  num_shards=1)  # Baselines evaluate on one device.


def evaluate(config: ml_collections.ConfigDict, params: Any, protocol: evaluate_lib.Protocol,
             class_images: np.ndarray | None = None) -> dict[str, Any]:
  """The protocol on trained `params`, summarised as `evaluate.evaluate` does (no files)."""
  if class_images is None:
    class_images = train.load_dataset(config)[protocol.split]
  logging.info('Evaluating %s on %s: %s.', DISPLAY_NAMES[_method(config)], protocol.split,
               protocol)
  per_episode = run_protocol(config, params, class_images, protocol)
  # Pretraining never sees a task sequence: no theta_t of fine-tuning or EWC extrapolates.
  trained = config.episode.num_tasks if config.method == 'maml' else protocol.num_tasks
  results = evaluate_lib.summarize(per_episode, trained_tasks=trained)
  results['protocol'] = dataclasses.asdict(protocol)
  results['episode'] = evaluate_lib.evaluation_spec(config, protocol)._asdict()
  results['timing'] = per_episode['timing']
  results['method'] = DISPLAY_NAMES[config.method]
  logging.info('Class-incremental accuracy of theta_t on tasks 0..t: %s', ', '.join(
      f'{c} {100 * m:.1f}%' for c, m in zip(results['table']['columns'],
                                            results['table']['class_incremental']['mean'])))
  return results


def restore_params(config: ml_collections.ConfigDict, workdir: str, step: int | None = None,
                   num_classes: int | None = None) -> tuple[Any, int]:
  """(params, step) of a checkpoint written by `train_and_evaluate`."""
  manager = train.checkpoint_manager(workdir, config)
  try:
    steps = sorted(manager.all_steps())
    if not steps or (step is not None and step not in steps):
      raise train.CheckpointError(
          f'No checkpoint{"" if step is None else f" of step {step}"} in '
          f'{manager.directory} (steps there: {steps}). Train first (config.method='
          f'{config.method!r}) or pass one of those steps.')
    step = steps[-1] if step is None else step
    num_classes = num_classes or num_train_classes(config)
    abstract = jax.eval_shape(lambda: init_state(config, make_optimizer(config),
                                                 jax.random.key(0), num_classes))
    train._check_fits(manager, step, abstract, config)  # pylint: disable=protected-access
    state = manager.restore(step, args=ocp.args.StandardRestore(abstract))
  finally:
    manager.close()
  return state.params, step


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str,
                        step: int | None = None, plot: bool = True,
                        dataset: dict[str, np.ndarray] | None = None,
                        embeddings: str | None = None,
                        **protocol_overrides) -> tuple[dict[str, Any], list[str]]:
  """`evaluate.evaluate_checkpoint` for a baseline: restore, run the protocol, write
  `<workdir>/eval/<split>_T<T>_step<step>.{json,csv,md(,png)}`.

  Args:
    embeddings: accepted for the same call as CHT's; no embedding report here.
    dataset: split name -> uint8 class images; None to load Omniglot.
    **protocol_overrides: `evaluate.Protocol` fields (None keeps the default).
  """
  if embeddings:
    logging.warning('No embedding report for %s (a CHT figure).', config.method)
  protocol = evaluate_lib.default_protocol(config, **protocol_overrides)
  num_classes = num_train_classes(config, dataset)
  params, step = restore_params(config, workdir, step, num_classes)
  class_images = None if dataset is None else dataset[protocol.split]
  results = evaluate(config, params, protocol, class_images)
  results.update(workdir=os.path.abspath(workdir), step=step,
                 config=json.loads(config.to_json_best_effort()))
  paths = evaluate_lib.write_results(results, evaluate_lib.result_prefix(workdir, protocol, step),
                                     plot=plot)
  logging.info('Wrote %s.', ', '.join(paths))
  log = train.MetricsLog(workdir)
  scalars = {f'{name}/{c}': m for name in ('class_incremental', 'task_incremental')
             for c, m in zip(results['table']['columns'], results['table'][name]['mean'])}
  scalars['episodes_per_sec'] = results['timing']['episodes_per_second']
  log.write(step, f'eval_{protocol.split}_T{protocol.num_tasks}', scalars)
  log.close()
  return results, paths
