"""One divergence rule for every method: non-finite steps, collapsed windows, when to stop.

The train step skips a step where one of `WATCHED` is not finite; `Guard` applies
`train.on_divergence`. A collapse can also stay finite (docs/results.md, sections 3, 6 and
10): `LossSpikes` finds it, and `Rollbacks` goes back at a lower learning rate.
"""

import collections

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from cht_jax.runtime import checkpoints

MAX_CONSECUTIVE_SKIPS = 20  # With on_divergence='skip', more than this stops the run.
# Train-step metrics that must be finite for the update to apply (if the method reports them).
WATCHED = {'loss': 'the loss', 'grad_norm': 'the gradient norm',
           'theta_norm': 'the norm of the generated weights',
           'update_norm': 'the norm of the parameter update'}


# A log window is a loss spike when its mean training loss exceeds train.loss_spike_factor
# x the lowest (not the median, which lags a fast-falling loss) of up to
# SPIKE_REFERENCE_WINDOWS earlier healthy windows, given at least SPIKE_MIN_WINDOWS.
SPIKE_REFERENCE_WINDOWS = 5
SPIKE_MIN_WINDOWS = 3
# Each rollback scales the learning rate by this; more than MAX_ROLLBACKS stop the run.
ROLLBACK_LEARNING_RATE_FACTOR = 0.5
MAX_ROLLBACKS = 4


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


class LossSpikes:
  """Which log windows' mean training loss jumped (a finite collapse)."""

  def __init__(self, factor: float):
    """`factor` 0: never a spike."""
    self._factor = factor
    self._healthy = []  # (last step, mean loss) of the windows that were not spikes.

  def check(self, step: int, loss: float) -> str | None:
    """Records the window ending at `step`; returns why it is a spike, or None."""
    if self._factor:
      reference = [l for _, l in self._healthy][-SPIKE_REFERENCE_WINDOWS:]
      if len(reference) >= SPIKE_MIN_WINDOWS and loss > self._factor * min(reference):
        return (f'the mean training loss of the steps up to {step} is {loss:.4g}, over '
                f'{self._factor:g} x {min(reference):.4g} (the lowest of the '
                f'{len(reference)} windows before)')
    self._healthy.append((step, loss))
    return None

  def forget_after(self, step: int) -> None:
    """Forgets the windows after `step` (rolled back past)."""
    self._healthy = [(s, l) for s, l in self._healthy if s <= step]


def checkpointed_error(reason: str, manager, policy: str) -> DivergenceError:
  """`error` once the saves in flight of the checkpoint manager have landed."""
  try:
    manager.wait_until_finished()  # An earlier, good save may be in flight.
  except Exception as e:  # pylint: disable=broad-except
    logging.error('Saving an earlier checkpoint failed: %s', checkpoints.root_cause(e))
  manager.reload()
  return error(reason, manager.latest_step(), manager.directory, policy)


class Rollbacks:
  """`train.loss_spike_factor`: the state is copied after each healthy log window (the last two
  kept); on a spike (`LossSpikes`) training goes back to the older copy, drops later rows and
  checkpoints, and scales the learning rate, in a 'rollback' row of metrics.jsonl."""

  def __init__(self, factor: float, log, first_step: int):
    """`factor`: train.loss_spike_factor (0: off); `log`: the run's `workdir.MetricsLog`."""
    self._log = log
    self._spikes = LossSpikes(factor)
    self._enabled = bool(factor)
    rows = [r for r in log.rows('rollback') if r['step'] <= first_step]
    self._count = len(rows)
    self.learning_rate_scale = rows[-1]['rollback/learning_rate_scale'] if rows else 1.0
    self._copies = collections.deque(maxlen=2)
    self._copy = jax.jit(lambda state: jax.tree.map(jnp.copy, state))
    self._reason = None  # Why the last window checked is a spike.

  def is_spike(self, step: int, loss: float, state) -> bool:
    """Records the log window ending at `step`; copies `state` if it is healthy."""
    if not self._enabled:
      return False
    self._reason = self._spikes.check(step, loss)
    if self._reason is None:
      self._copies.append(self._copy(state))
    return self._reason is not None

  def roll_back(self, step: int, manager):
    """The (training) state to go on from after the spike found at `step`."""
    self._count += 1
    if self._count > MAX_ROLLBACKS:
      # Policy 'skip': the advice then leaves out on_divergence, which is about NaNs.
      raise checkpointed_error(
          f'Training collapsed at step {step}: {self._reason}, after '
          f'{MAX_ROLLBACKS} rollbacks (train.loss_spike_factor).', manager, 'skip')
    target = self._copies[0]
    to_step = int(target.step)
    self.learning_rate_scale *= ROLLBACK_LEARNING_RATE_FACTOR
    logging.warning('Loss spike at step %d: %s. Rolling back to step %d, learning rate x%g '
                    'from there (rollback %d of at most %d).', step, self._reason, to_step,
                    self.learning_rate_scale, self._count, MAX_ROLLBACKS)
    manager.wait_until_finished()
    for saved in manager.all_steps():
      if saved > to_step:  # Written on the abandoned way.
        manager.delete(saved)
    self._log.drop_after(to_step)
    self._log.write(to_step, 'rollback', {'from_step': step,
                                          'learning_rate_scale': self.learning_rate_scale})
    self._spikes.forget_after(to_step)
    self._copies = collections.deque([target], maxlen=2)
    return self._copy(target)  # `target` stays: the step donates what it is given.
