"""EWC (Kirkpatrick et al., 2017): fine-tuning (finetune.py) plus a penalty on earlier tasks.

After task tau, theta*_tau and the diagonal Fisher F_tau of its log-likelihood
on S(tau) are kept; learning task t then minimises
  L_t(theta) + lambda/2 * sum_{tau < t} sum_i F_tau,i (theta_i - theta*_tau,i)^2,
one penalty per earlier task, as in the original; unseen tasks have F = 0.
"""

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from cht_jax.methods import finetune
from cht_jax.methods import sequential
from cht_jax.models import cnn as cnn_lib

FISHERS = ('empirical', 'true')
Theta = Any


def penalty(theta: Theta, fishers: Theta, anchors: Theta, ewc_lambda: float) -> jax.Array:
  """lambda/2 * sum_tau sum_i F_tau,i (theta_i - theta*_tau,i)^2; `fishers`, `anchors`:
  theta's structure, leaves [T, *leaf shape]."""
  terms = jax.tree.map(lambda p, f, a: jnp.sum(f * jnp.square(p[None] - a)),
                       theta, fishers, anchors)
  return 0.5 * ewc_lambda * sum(jax.tree.leaves(terms))


def fisher_diagonal(log_probs_fn: Callable[[Theta], jax.Array], theta: Theta,
                    targets: jax.Array, kind: str = 'empirical') -> Theta:
  """Diagonal Fisher at theta of `log_probs_fn`: theta -> [S, M], mean over the S samples:
  'empirical', mean_n (d log p(y_n | x_n) / d theta)^2 with `targets` [S]; 'true' (the original
  EWC), mean_n sum_m p(m | x_n) (d log p(m | x_n) / d theta)^2, one sweep per output m."""
  if kind == 'empirical':
    per_sample = lambda th: jnp.take_along_axis(log_probs_fn(th), targets[:, None], -1)[:, 0]
    jacobian = jax.jacrev(per_sample)(theta)  # Leaves [S, ...].
    return jax.tree.map(lambda j: jnp.mean(jnp.square(j), axis=0), jacobian)
  if kind == 'true':
    probs = jax.lax.stop_gradient(jnp.exp(log_probs_fn(theta)))  # [S, M]
    num_samples = probs.shape[0]

    def one_output(m):
      jacobian = jax.jacrev(lambda th: log_probs_fn(th)[:, m])(theta)  # Leaves [S, ...].
      weight = probs[:, m]
      return jax.tree.map(
          lambda j: jnp.tensordot(weight, jnp.square(j), axes=1) / num_samples, jacobian)

    per_output = jax.lax.map(one_output, jnp.arange(probs.shape[1]))
    return jax.tree.map(lambda f: f.sum(axis=0), per_output)
  raise ValueError(f'Unknown Fisher {kind!r}; expected one of {FISHERS}.')


def init_state(theta: Theta, num_tasks: int) -> tuple[Theta, Theta]:
  """(fishers, anchors): zeros with leaves [T, *leaf shape]."""
  zeros = jax.tree.map(lambda p: jnp.zeros((num_tasks, *p.shape), p.dtype), theta)
  return zeros, zeros


def record_task(state: tuple[Theta, Theta], t, fisher: Theta, theta: Theta):
  """Stores F_t and theta*_t = theta in row t of the (fishers, anchors) state."""
  fishers, anchors = state
  put = lambda stacked, new: jax.tree.map(lambda s, n: s.at[t].set(n), stacked, new)
  return put(fishers, fisher), put(anchors, theta)


def ewc_rule(cnn: cnn_lib.CNN, ways: int, num_steps: int, learning_rate: float,
             ewc_lambda: float, fisher: str = 'empirical') -> sequential.UpdateFn:
  """EWC: k SGD steps on S(t) plus the penalty; state from `ewc.init_state`."""
  def update(theta, state, images, labels, t):
    fishers, anchors = state
    loss = lambda th: (sequential.support_loss(cnn, th, images, labels, t, ways)
                       + penalty(th, fishers, anchors, ewc_lambda))
    theta, _ = sequential.sgd_steps(loss, theta, learning_rate, num_steps)
    log_probs = lambda th: sequential.seen_log_probs(cnn, th, images, t, ways)
    fisher_t = fisher_diagonal(log_probs, theta, t * ways + labels, fisher)
    state = record_task(state, t, jax.lax.stop_gradient(fisher_t), theta)
    return theta, state, theta
  return update


@dataclasses.dataclass(frozen=True)
class EWC(finetune.Finetune):
  """Fine-tuning plus EWC's penalty on the earlier tasks' parameters."""
  name = 'ewc'
  display_name = 'EWC'

  def update_rule(self, cnn, num_tasks: int, theta):
    b = self.config.baseline
    rule = ewc_rule(cnn, self.config.episode.ways, b.inner_steps,
                    b.inner_learning_rate, b.ewc_lambda, b.ewc_fisher)
    return rule, init_state(theta, num_tasks)
