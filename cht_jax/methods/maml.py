"""MAML++ (Antoniou et al., 2019) run continually over the tasks of an episode.

Meta-parameters: theta^0, a CNN with a K*T head (class k of task t is output
t*K + k), and, with LSLR, one inner learning rate per parameter tensor and per
inner step. For an episode, theta_{-1} = theta^0 and task t runs k inner steps
  theta_t^{(j+1)} = theta_t^{(j)} - lr[leaf, j] * grad L_{S(t)}(theta_t^{(j)}),
  theta_t^{(0)} = theta_{t-1},  theta_t = theta_t^{(k)},
with L_{S(t)} the support cross-entropy over tasks 0..t's classes. The outer
loss mirrors CHT's Algorithm 1: sum over t and tau <= t of the class-incremental
cross-entropy of Q(tau) under theta_t (with the multi-step loss, over steps j).
Implemented (config.baseline.maml_*): LSLR, the annealed multi-step loss,
derivative-order and cosine annealing. Not: per-step BatchNorm statistics
(BNRS; ours are the batch's own) and weights (BNWB), and weight decay.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cht_jax import continual
from cht_jax import losses
from cht_jax.data import datasets
from cht_jax.data import episodes as episodes_lib
from cht_jax.methods import base
from cht_jax.methods import finetune
from cht_jax.methods import sequential
from cht_jax.models import cnn as cnn_lib
from cht_jax.runtime import devices


def init_params(theta: Any, num_steps: int, inner_learning_rate: float) -> dict:
  """{'theta': theta^0, 'lslr': leaves [num_steps], all `inner_learning_rate`}."""
  lslr = jax.tree.map(lambda p: jnp.full((num_steps,), inner_learning_rate, p.dtype), theta)
  return {'theta': theta, 'lslr': lslr}


def inner_rule(cnn: cnn_lib.CNN, ways: int, lslr: Any, num_steps: int,
               first_order: bool = False, keep_steps: bool = False) -> sequential.UpdateFn:
  """The inner loop on S(t); its output is theta_t, or with `keep_steps` every
  theta_t^{(j)}, j = 1..k (leaves [k, ...], for the multi-step loss)."""
  def update(theta, state, images, labels, t):
    loss = lambda th: sequential.support_loss(cnn, th, images, labels, t, ways)
    theta, steps = sequential.sgd_steps(loss, theta, lslr, num_steps, first_order)
    return theta, state, (steps if keep_steps else theta)
  return update


def learn(cnn: cnn_lib.CNN, params: dict, support_images: jax.Array, support_labels: jax.Array,
          ways: int, num_steps: int, first_order: bool = False, keep_steps: bool = False,
          learn_inner_lr: bool = True):
  """theta_0..theta_{T-1} (leaves [T, ...]; [T, k, ...] with `keep_steps`) of one episode."""
  lslr = params['lslr'] if learn_inner_lr else jax.lax.stop_gradient(params['lslr'])
  rule = inner_rule(cnn, ways, lslr, num_steps, first_order, keep_steps)
  return sequential.run_sequence(rule, params['theta'], (), support_images, support_labels)


def multi_step_weights(step: int, num_steps: int, anneal_steps: int) -> np.ndarray:
  """MAML++'s `get_per_step_loss_importance_vector` (meta-steps for epochs): float32 [k],
  uniform at step 0, annealed towards the final step only from `anneal_steps`."""
  k = num_steps
  if step >= anneal_steps:
    return np.eye(k, dtype=np.float32)[-1]
  weights = np.full(k, 1.0 / k)
  decay = 1.0 / k / anneal_steps
  floor = 0.03 / k
  weights[:-1] = np.maximum(weights[:-1] - step * decay, floor)
  weights[-1] = min(weights[-1] + step * (k - 1) * decay, 1.0 - (k - 1) * floor)
  return weights.astype(np.float32)


def episode_loss(cnn: cnn_lib.CNN, params: dict, episode: dict, ways: int, num_steps: int,
                 step_weights: jax.Array | None = None, first_order: bool = False,
                 learn_inner_lr: bool = True):
  """(loss, metrics) of one episode: sum_t sum_{tau<=t} sum_j w_j CE(Q(tau); theta_t^{(j)}),
  `step_weights` w [k] (None: the final step only); 'accuracy' is class-incremental at the
  final inner step, 'final_accuracy' theta_{T-1}'s."""
  num_tasks = episode['support_images'].shape[0]
  pairs = continual.TaskPairs.lower_triangle(num_tasks)
  keep = step_weights is not None
  outputs = learn(cnn, params, episode['support_images'], episode['support_labels'], ways,
                  num_steps, first_order, keep_steps=keep, learn_inner_lr=learn_inner_lr)
  if not keep:  # One "step": theta_t itself.
    outputs = jax.tree.map(lambda leaf: leaf[:, None], outputs)
    step_weights = jnp.ones((1,))

  def one_pair(t, tau):
    images, labels = episode['query_images'][tau], episode['query_labels'][tau]
    def one_step(theta):
      logits = cnn.apply({'params': theta}, images)
      logits = sequential.mask_logits(
          logits, sequential.seen_classes_mask(t, logits.shape[-1], ways))
      return losses.cross_entropy_and_accuracy(logits, tau * ways + labels)
    return jax.vmap(one_step)(jax.tree.map(lambda leaf: leaf[t], outputs))  # [k], [k]

  cross_entropy, accuracy = jax.vmap(one_pair)(pairs.t, pairs.tau)  # [P, k]
  loss = jnp.sum(cross_entropy @ step_weights)
  final = pairs.t == num_tasks - 1
  metrics = {'loss': loss, 'accuracy': jnp.mean(accuracy[:, -1]),
             'final_accuracy': jnp.mean(accuracy[final, -1])}
  return loss, metrics


@dataclasses.dataclass(frozen=True)
class MAML(base.SequentialMethod):
  """MAML++ with per-layer per-step inner rates (LSLR) and a K*T head."""
  name = 'maml'
  display_name = 'MAML++'

  @property
  def max_eval_tasks(self) -> int:
    return self.config.episode.num_tasks  # The head has K*T outputs.

  @property
  def cnn(self):
    return finetune.build_cnn(self.config,
                              self.config.episode.ways * self.config.episode.num_tasks)

  def init(self, key) -> Any:
    b = self.config.baseline
    theta = finetune.init_theta(self.cnn, key, datasets.image_shape(self.config))
    return init_params(theta, b.inner_steps, b.inner_learning_rate)

  def learning_rate(self, optim):
    """Cosine annealing from optim.learning_rate to baseline.maml_min_learning_rate."""
    b = self.config.baseline
    if not b.maml_cosine_annealing:
      return None
    return optax.cosine_decay_schedule(
        optim.learning_rate, self.config.train.num_steps,
        alpha=min(b.maml_min_learning_rate / optim.learning_rate, 1.0))

  def step_variant(self, step: int):
    """((first_order, multi_step), step_weights [k]) of training step `step` (1-based)."""
    b = self.config.baseline
    first_order = step <= b.maml_first_order_steps
    multi_step = bool(b.maml_multi_step_loss) and step - 1 < b.maml_msl_anneal_steps
    weights = multi_step_weights(step - 1, b.inner_steps, b.maml_msl_anneal_steps)
    return (first_order, multi_step), jnp.asarray(weights)

  def grads(self, params, data, key, *, mesh, variant=(False, False), inputs=None, **unused):
    """The mean meta-loss of train.episodes_per_step episodes, split over `mesh`."""
    del unused
    first_order, multi_step = variant
    config, b = self.config, self.config.baseline
    episodes = episodes_lib.sample_episodes(key, data, datasets.episode_spec(config),
                                            config.train.episodes_per_step, config.data.rotate)
    episodes = jax.lax.with_sharding_constraint(episodes, jax.NamedSharding(mesh, jax.P('data')))
    loss_fn = lambda p, episode: episode_loss(
        self.cnn, p, episode, config.episode.ways, b.inner_steps,
        inputs if multi_step else None, first_order, b.maml_learn_inner_lr)
    return devices.batch_grads(loss_fn, params, episodes, mesh, vectorize=True)

  def sequence_learner(self, params, num_tasks: int):
    """(cnn with a K*num_tasks head, learn(support_images, support_labels) -> thetas)."""
    ways, trained = self.config.episode.ways, self.config.episode.num_tasks
    if num_tasks > trained:
      raise ValueError(  # evaluate.evaluate checks max_eval_tasks first.
          f'MAML++ was meta-trained with a head for T={trained} tasks of {ways} classes; '
          f'it cannot be evaluated on {num_tasks} tasks. Use --eval_tasks <= {trained}.')
    num_outputs = ways * num_tasks
    cnn = finetune.build_cnn(self.config, num_outputs)
    head = params['theta']['head']
    theta = {**params['theta'], 'head': {'kernel': head['kernel'][:, :num_outputs],
                                         'bias': head['bias'][:num_outputs]}}
    return cnn, lambda images, labels: learn(
        cnn, {'theta': theta, 'lslr': params['lslr']}, images, labels, ways,
        self.config.baseline.inner_steps)
