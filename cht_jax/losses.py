"""Prototypical (class- and task-incremental) and cross-entropy losses (paper, eqs. 4-6).

All work on one query set Q(tau) embedded with one theta_t (vmapped over the pairs).
"""

import jax
import jax.numpy as jnp

LOSSES = ('class_incremental', 'task_incremental', 'cross_entropy')
# Stands in for -inf in masked logits: exp() of it is exactly 0 in float32 and,
# unlike -inf, it keeps gradients and log-softmax free of NaNs.
MASKED_LOGIT = -1e30


def class_prototypes(embeddings: jax.Array, labels: jax.Array, num_ways: int) -> jax.Array:
  """Eq. 4: per-class means of the support embeddings, [S, D] -> [num_ways, D]."""
  one_hot = jax.nn.one_hot(labels, num_ways, dtype=embeddings.dtype)
  counts = one_hot.sum(axis=0)
  return (one_hot.T @ embeddings) / jnp.maximum(counts, 1.0)[:, None]


def negative_squared_distances(embeddings: jax.Array, prototypes: jax.Array) -> jax.Array:
  """-||e - c||^2: [Q, D] x [M, D] -> [Q, M]."""
  return -jnp.sum(jnp.square(embeddings[:, None, :] - prototypes[None, :, :]), axis=-1)


def class_incremental_logits(embeddings, prototypes, t) -> jax.Array:
  """Eq. 6 logits over the classes of tasks 0..t: [Q, D] queries embedded with theta_t,
  prototypes [T, K, D] -> [Q, T*K] (class (tau, k) in column tau*K + k; later tasks masked)."""
  num_tasks, num_ways, dim = prototypes.shape
  logits = negative_squared_distances(embeddings, prototypes.reshape(-1, dim))
  seen = jnp.repeat(jnp.arange(num_tasks) <= t, num_ways)
  return jnp.where(seen[None, :], logits, MASKED_LOGIT)


def task_incremental_logits(embeddings, prototypes, tau) -> jax.Array:
  """Eq. 5 logits over the K classes of task tau: [Q, D] -> [Q, K]."""
  return negative_squared_distances(embeddings, prototypes[tau])


def pair_logits(loss: str, embeddings, prototypes, t, tau):
  """(logits [Q, M], offset) of task tau's queries under theta_t: label y's target is y + offset."""
  if loss == 'class_incremental':
    return class_incremental_logits(embeddings, prototypes, t), tau * prototypes.shape[1]
  if loss == 'task_incremental':
    return task_incremental_logits(embeddings, prototypes, tau), 0
  if loss == 'cross_entropy':
    # The dense head itself gives K logits (HT's original loss, appendix A.1).
    return embeddings, 0
  raise ValueError(f'Unknown loss {loss!r}; expected one of {LOSSES}.')


def cross_entropy_and_accuracy(logits: jax.Array, targets: jax.Array):
  """Mean softmax cross-entropy and accuracy: [Q, M] logits, [Q] int targets."""
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(log_probs, targets[:, None], axis=-1)[:, 0]
  accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == targets)
  return jnp.mean(nll), accuracy
