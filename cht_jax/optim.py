"""The optimiser and the learning-rate schedule of `config.optim`.

The paper (Experiments) trains with SGD on an exponentially decaying rate; the other optimisers
and warmup-then-cosine are the ':fast' recipe's (configs/variants.py).
"""

import ml_collections
import optax

OPTIMIZERS = ('sgd', 'momentum', 'adam', 'adamw')
SCHEDULES = ('exponential', 'cosine')


def learning_rate_schedule(optim: ml_collections.ConfigDict) -> optax.Schedule:
  """`optim.schedule` after `optim.warmup_steps` of linear warmup from 0: 'exponential' (the
  paper's) lr * decay_rate ** (step / decay_steps), not staircase, as the original HT's
  `tf.train.exponential_decay` (hypertransformer/tf/train.py); 'cosine' to lr * end_fraction."""
  if optim.schedule == 'exponential':
    decay = optax.exponential_decay(
        optim.learning_rate, transition_steps=optim.decay_steps,
        decay_rate=optim.decay_rate, staircase=False)
  elif optim.schedule == 'cosine':
    decay = optax.cosine_decay_schedule(
        optim.learning_rate, decay_steps=max(optim.decay_steps - optim.warmup_steps, 1),
        alpha=optim.end_fraction)
  else:
    raise ValueError(f'Unknown optim.schedule {optim.schedule!r}; expected one of '
                     f'{SCHEDULES}.')
  if not optim.warmup_steps:
    return decay
  warmup = optax.linear_schedule(0.0, optim.learning_rate, optim.warmup_steps)
  return optax.join_schedules([warmup, decay], [optim.warmup_steps])


def make_optimizer(optim: ml_collections.ConfigDict,
                   schedule: optax.Schedule | None = None) -> optax.GradientTransformation:
  """`optim.name` on `schedule` (default: the paper's), clipped if optim.grad_clip_norm."""
  schedule = schedule or learning_rate_schedule(optim)
  if optim.name == 'sgd':
    optimizer = optax.sgd(schedule)
  elif optim.name == 'momentum':
    optimizer = optax.sgd(schedule, momentum=optim.momentum)
  elif optim.name == 'adam':
    optimizer = optax.adam(schedule)
  elif optim.name == 'adamw':
    optimizer = optax.adamw(schedule, weight_decay=optim.weight_decay)
  else:
    raise ValueError(f'Unknown optim.name {optim.name!r}; expected one of '
                     f'{OPTIMIZERS}.')
  if optim.grad_clip_norm > 0:
    optimizer = optax.chain(optax.clip_by_global_norm(optim.grad_clip_norm), optimizer)
  return optimizer
