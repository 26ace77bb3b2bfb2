"""One divergence rule for every method: which steps are non-finite, and when training stops.

The training step itself leaves parameters and optimiser state unchanged on a
step where one of `WATCHED` is not finite (metrics['skipped'] = 1); `Guard`
reads the fetched metrics and says when `train.on_divergence` stops the run:
'stop' at the first such step, 'skip' after more than MAX_CONSECUTIVE_SKIPS
in a row.
"""

from absl import logging
import numpy as np

MAX_CONSECUTIVE_SKIPS = 20  # With on_divergence='skip', more than this stops the run.
# Train-step metrics that must be finite for the step's update to be applied
# (those a method reports: baselines generate no weights).
WATCHED = {'loss': 'the loss', 'grad_norm': 'the gradient norm',
           'theta_norm': 'the norm of the generated weights',
           'update_norm': 'the norm of the parameter update'}


class DivergenceError(FloatingPointError):
  """The loss, the gradient or the generated weights became non-finite."""


def nonfinite(metrics: dict[str, float]) -> str:
  """E.g. 'the loss (nan), the norm of the generated weights (inf)'."""
  return ', '.join(f'{name} ({metrics[k]})' for k, name in WATCHED.items()
                   if k in metrics and not np.isfinite(metrics[k]))


class Guard:
  """Looks at fetched per-step metrics; says when training must stop."""

  def __init__(self, policy: str):
    self._policy = policy
    self._skipped = []  # Consecutive skipped steps.

  def check(self, rows: list[tuple[int, dict[str, float]]]) -> str | None:
    """Returns why training must stop, or None."""
    for step, metrics in rows:
      if not metrics['skipped']:
        self._skipped = []
        continue
      what = nonfinite(metrics)
      if self._policy == 'stop':
        return f'Training diverged at step {step}: {what} became non-finite.'
      self._skipped.append(step)
      logging.warning('Step %d skipped (train.on_divergence=skip), not finite: %s.', step, what)
      if len(self._skipped) > MAX_CONSECUTIVE_SKIPS:
        return (f'Training diverged: the {len(self._skipped)} steps {self._skipped[0]}..'
                f'{step} were all skipped (train.on_divergence=skip), the last one '
                f'because {what} became non-finite.')
    return None


def error(reason: str, last_checkpoint: int | None, directory: str,
          policy: str) -> DivergenceError:
  """The error that ends the run: `reason`, what is kept, and how to go on."""
  skip = '' if policy == 'skip' else ', or with train.on_divergence=skip to drop such steps'
  if last_checkpoint is None:
    return DivergenceError(
        f'{reason} No checkpoint had been written yet. Rerun with a lower '
        f'optim.learning_rate or a positive optim.grad_clip_norm{skip}.')
  return DivergenceError(
      f'{reason} The last good checkpoint, step {last_checkpoint} in {directory}, is kept '
      f'(no later one was written). Rerun with a lower optim.learning_rate{skip}: training '
      'resumes from that checkpoint (a new optim.name or optim.grad_clip_norm needs a new '
      '--workdir, as the optimiser state would not fit).')
