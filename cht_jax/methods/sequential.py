"""One continual mechanism for the gradient-based baselines: theta_t = update(theta_{t-1}, S(t)).

The CNN's final layer is a K*T-way head: class k of task t is output t*K + k.
Class-incremental accuracy of theta_t on Q(tau): argmax over tasks 0..t's
outputs; task-incremental: over task tau's K. `run_sequence` scans one
episode's T tasks with an update rule (finetune.py, ewc.py, maml.py).
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp

from cht_jax import continual
from cht_jax import losses
from cht_jax.models import cnn as cnn_lib

Theta = Any  # The `params` pytree of a `cnn_lib.CNN` with a K*T head.
# update(theta_{t-1}, state, images [S, H, W, C], labels [S], t) -> (theta_t, state, output).
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
  """Log-softmax over the classes of tasks 0..t: [S, H, W, C] -> [S, T*K] (later: ~-1e30)."""
  logits = cnn.apply({'params': theta}, images)
  mask = seen_classes_mask(t, logits.shape[-1], ways)
  return jax.nn.log_softmax(mask_logits(logits, mask), axis=-1)


def support_loss(cnn: cnn_lib.CNN, theta: Theta, images: jax.Array, labels: jax.Array, t,
                 ways: int) -> jax.Array:
  """Mean cross-entropy of task t's support set (labels [S] in 0..K-1) over the seen classes."""
  logits = cnn.apply({'params': theta}, images)
  logits = mask_logits(logits, seen_classes_mask(t, logits.shape[-1], ways))
  return losses.cross_entropy_and_accuracy(logits, t * ways + labels)[0]


def sgd_steps(loss_fn: Callable[[Theta], jax.Array], theta: Theta, learning_rates,
              num_steps: int, first_order: bool = False):
  """`num_steps` steps of theta <- theta - lr_j * grad loss_fn(theta) as a scan, `learning_rates`
  a scalar or theta's structure with leaves [num_steps] (LSLR): (last theta, every step's)."""
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
  """theta_t = update(theta_{t-1}, S(t)) for t = 0..T-1 in one `lax.scan`, `state` the rule's
  carry besides theta (EWC's Fishers and anchors; () for fine-tuning), support_images
  [T, S, H, W, C], support_labels [T, S]: every task's `output`, stacked on a leading T axis."""
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
  """(task-incremental, class-incremental) accuracy of theta_t's logits [Q, T*K] on
  Q(tau), labels [Q] in 0..K-1."""
  num_outputs = logits.shape[-1]
  targets = tau * ways + labels
  hit = lambda mask: jnp.mean(jnp.argmax(mask_logits(logits, mask), axis=-1) == targets)
  return (hit(task_classes_mask(tau, num_outputs, ways)),
          hit(seen_classes_mask(t, num_outputs, ways)))


def episode_accuracies(cnn: cnn_lib.CNN, thetas: Theta, query_images: jax.Array,
                       query_labels: jax.Array, ways: int, pairs: continual.TaskPairs,
                       vectorize: bool = False):
  """(task_incremental [P], class_incremental [P]) of every theta_t (leaves [T, ...]) on every
  task tau <= t, means over the R draws of query_images [R, T, K*Q, H, W, C] (each draw a
  BatchNorm batch), query_labels [T, K*Q]; `vectorize` vmaps pairs and draws, else loops."""
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
