"""Update rules of the fine-tuning and EWC baselines, for `sequential.run_sequence`.

Fine-tuning: theta_t = k SGD steps of the support cross-entropy of S(t)
(over the classes of tasks 0..t) from theta_{t-1}.
EWC: the same loss plus `ewc.penalty` of the earlier tasks; at the end of task
t the Fisher of S(t) at theta_t and theta_t itself are recorded.
"""

import jax

from cht_jax.baselines import ewc
from cht_jax.baselines import sequential
from cht_jax.models import cnn as cnn_lib


def finetune_rule(cnn: cnn_lib.CNN, ways: int, num_steps: int,
                  learning_rate: float) -> sequential.UpdateFn:
  """Plain fine-tuning: k SGD steps on S(t); no state."""
  def update(theta, state, images, labels, t):
    loss = lambda th: sequential.support_loss(cnn, th, images, labels, t, ways)
    theta, _ = sequential.sgd_steps(loss, theta, learning_rate, num_steps)
    return theta, state, theta
  return update


def ewc_rule(cnn: cnn_lib.CNN, ways: int, num_steps: int, learning_rate: float,
             ewc_lambda: float, fisher: str = 'empirical') -> sequential.UpdateFn:
  """EWC: k SGD steps on S(t) plus the penalty; state from `ewc.init_state`."""
  def update(theta, state, images, labels, t):
    fishers, anchors = state
    loss = lambda th: (sequential.support_loss(cnn, th, images, labels, t, ways)
                       + ewc.penalty(th, fishers, anchors, ewc_lambda))
    theta, _ = sequential.sgd_steps(loss, theta, learning_rate, num_steps)
    log_probs = lambda th: sequential.seen_log_probs(cnn, th, images, t, ways)
    fisher_t = ewc.fisher_diagonal(log_probs, theta, t * ways + labels, fisher)
    state = ewc.record_task(state, t, jax.lax.stop_gradient(fisher_t), theta)
    return theta, state, theta
  return update
