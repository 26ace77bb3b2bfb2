"""One continual mechanism for the gradient-based baselines: theta_t = update(theta_{t-1}, S(t)).

The network is `models.cnn.CNN` whose final dense layer is a classification
head with K*T outputs: class k of task t is output t*K + k. After task t the
classes seen so far are those of tasks 0..t, outputs 0..(t+1)K-1.

  class-incremental accuracy of theta_t on the queries of tau <= t: argmax over
      the outputs of tasks 0..t, target tau*K + y;
  task-incremental: argmax over the K outputs of task tau.

`run_sequence` is the `jax.lax.scan` over the T tasks of one episode, with the
update rule plugged in (finetune.py, ewc.py, maml.py); `episode_accuracies` scores every
theta_t on every query draw of every task tau <= t, as evaluate.py does for CHT.
Everything is for one episode; vmap or lax.map over episodes.
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp

from cht_jax import continual
from cht_jax import losses
from cht_jax.models import cnn as cnn_lib

Theta = Any  # The `params` pytree of a `cnn_lib.CNN` with a K*T head.
# update(theta_{t-1}, state, support_images [S, H, W, C], support_labels [S], t)
#   -> (theta_t, state, output); `output` is what `run_sequence` stacks over t.
UpdateFn = Callable[[Theta, Any, jax.Array, jax.Array, jax.Array], tuple[Theta, Any, Any]]


def seen_classes_mask(t, num_outputs: int, ways: int) -> jax.Array:
  """bool [T*K]: the outputs of tasks 0..t (t may be traced)."""
  return jnp.arange(num_outputs) < (t + 1) * ways


def task_classes_mask(tau, num_outputs: int, ways: int) -> jax.Array:
  """bool [T*K]: the K outputs of task tau."""
  return jnp.arange(num_outputs) // ways == tau


def mask_logits(logits: jax.Array, mask: jax.Array) -> jax.Array:
  """[..., M] logits with the outputs where `mask` [M] is False set to losses.MASKED_LOGIT."""
  return jnp.where(mask, logits, losses.MASKED_LOGIT)


def seen_log_probs(cnn: cnn_lib.CNN, theta: Theta, images: jax.Array, t,
                   ways: int) -> jax.Array:
  """Log-softmax over the classes of tasks 0..t: [S, H, W, C] -> [S, T*K].

  BatchNorm uses the statistics of `images` (the whole batch), as everywhere.
  Outputs of later tasks get log-probability ~ -1e30 (probability 0).
  """
  logits = cnn.apply({'params': theta}, images)
  mask = seen_classes_mask(t, logits.shape[-1], ways)
  return jax.nn.log_softmax(mask_logits(logits, mask), axis=-1)


def support_loss(cnn: cnn_lib.CNN, theta: Theta, images: jax.Array, labels: jax.Array, t,
                 ways: int) -> jax.Array:
  """Mean cross-entropy of task t's support set over the classes seen so far.

  Args:
    images: [S, H, W, C]; labels: [S] in 0..K-1 (task t's own labels).
  """
  logits = cnn.apply({'params': theta}, images)
  logits = mask_logits(logits, seen_classes_mask(t, logits.shape[-1], ways))
  return losses.cross_entropy_and_accuracy(logits, t * ways + labels)[0]


def sgd_steps(loss_fn: Callable[[Theta], jax.Array], theta: Theta, learning_rates,
              num_steps: int, first_order: bool = False):
  """`num_steps` steps of theta <- theta - lr_j * grad loss_fn(theta), as a scan.

  Args:
    loss_fn: theta -> scalar.
    learning_rates: a scalar (plain SGD), or a pytree with theta's structure
      whose leaves are [num_steps] (MAML++'s per-layer per-step rates, LSLR).
    first_order: stop gradients through the inner gradients (first-order MAML).

  Returns:
    (theta after the last step, every step's theta with leaves [num_steps, ...]).
  """
  if jax.tree.structure(learning_rates) != jax.tree.structure(theta):  # One rate for all.
    learning_rates = jax.tree.map(
        lambda leaf: jnp.full((num_steps,), learning_rates, leaf.dtype), theta)

  def step(theta, rates):
    grads = jax.grad(loss_fn)(theta)
    if first_order:
      grads = jax.lax.stop_gradient(grads)
    theta = jax.tree.map(lambda p, g, lr: p - lr * g, theta, grads, rates)
    return theta, theta

  return jax.lax.scan(step, theta, learning_rates, length=num_steps)


def run_sequence(update: UpdateFn, theta: Theta, state: Any, support_images: jax.Array,
                 support_labels: jax.Array):
  """theta_t = update(theta_{t-1}, S(t)) for t = 0..T-1, one `lax.scan`.

  Args:
    update: the rule (see `UpdateFn`); `state` is its carry besides theta
      (EWC's Fishers and anchors; () for plain fine-tuning).
    theta: theta_{-1}, the starting network.
    support_images: [T, S, H, W, C]; support_labels: [T, S] in 0..K-1.

  Returns:
    The `output` of every task stacked on a leading T axis (theta_t for
    fine-tuning and EWC: leaves [T, ...]).
  """
  def step(carry, task):
    theta, state = carry
    images, labels, t = task
    theta, state, output = update(theta, state, images, labels, t)
    return (theta, state), output

  num_tasks = support_images.shape[0]
  _, outputs = jax.lax.scan(step, (theta, state),
                            (support_images, support_labels, jnp.arange(num_tasks)))
  return outputs


def pair_accuracies(logits: jax.Array, labels: jax.Array, t, tau, ways: int):
  """Task- and class-incremental accuracy of theta_t on the queries of task tau.

  Args:
    logits: [Q, T*K], the queries of tau under theta_t; labels: [Q] in 0..K-1.

  Returns:
    (task_incremental, class_incremental), scalars.
  """
  num_outputs = logits.shape[-1]
  targets = tau * ways + labels
  hit = lambda mask: jnp.mean(jnp.argmax(mask_logits(logits, mask), axis=-1) == targets)
  return (hit(task_classes_mask(tau, num_outputs, ways)),
          hit(seen_classes_mask(t, num_outputs, ways)))


def episode_accuracies(cnn: cnn_lib.CNN, thetas: Theta, query_images: jax.Array,
                       query_labels: jax.Array, ways: int, pairs: continual.TaskPairs,
                       vectorize: bool = False):
  """Scores every theta_t on every query draw of every task tau <= t.

  Each draw of Q(tau) is a batch of its own for BatchNorm, as for CHT.

  Args:
    thetas: leaves [T, ...] from `run_sequence`.
    query_images: [R, T, K*Q, H, W, C]; query_labels: [T, K*Q].
    pairs: `continual.TaskPairs.lower_triangle(T)`.
    vectorize: vmap over pairs and draws (accelerators) instead of looping (CPU).

  Returns:
    (task_incremental [P], class_incremental [P]): mean over the R draws.
  """
  def one_pair(pair):
    t, tau = pair
    theta = jax.tree.map(lambda leaf: leaf[t], thetas)
    def one_draw(images):
      logits = cnn.apply({'params': theta}, images[tau])
      return jnp.stack(pair_accuracies(logits, query_labels[tau], t, tau, ways))
    draws = query_images.shape[0]
    return jax.lax.map(one_draw, query_images, batch_size=draws if vectorize else None).mean(0)

  pair_ids = (jnp.asarray(pairs.t), jnp.asarray(pairs.tau))
  scores = jax.lax.map(one_pair, pair_ids, batch_size=len(pairs.t) if vectorize else None)
  return scores[:, 0], scores[:, 1]
