"""When a long loop says how far it is, and its speed and time left: training's steps and the
evaluation's episodes.

A line at least every `interval` seconds of wall time, whatever the loop's own cadence
(`train.log_every_steps`, the evaluation's tenths): a run of millions of steps shows its
speed and the time it will take from its start, not after its first thousand steps. The loops
measure the speed from the end of their first step or batch, whose time is mostly
compilation.
"""

import time
from typing import Callable

INTERVAL_SECONDS = 30.0


class Progress:
  """`due()`: whether `interval` s passed since the last `status`; `status(done)`: the speed
  since then and the time left at that speed, e.g. '3.41 steps/s, 2 h 05 min left'."""

  def __init__(self, total: int, unit: str, done: int = 0,
               interval: float = INTERVAL_SECONDS,
               clock: Callable[[], float] = time.perf_counter):
    self._total, self._unit, self._interval, self._clock = total, unit, interval, clock
    self.restart(done)

  def restart(self, done: int) -> None:
    """Measures the speed from here (e.g. after a first step that also compiled)."""
    self._done, self._time = done, self._clock()

  def seconds(self) -> float:
    """Since the last `status` or `restart`."""
    return self._clock() - self._time

  def due(self) -> bool:
    return self.seconds() >= self._interval

  def status(self, done: int) -> str:
    now = self._clock()
    elapsed, count = now - self._time, done - self._done
    self._done, self._time = done, now
    if count <= 0 or elapsed <= 0:
      return f'{self._unit}/s from the next line on'
    rate = count / elapsed
    return f'{rate:.3g} {self._unit}/s, {duration((self._total - done) / rate)} left'


def duration(seconds: float) -> str:
  """'45 s', '12 min', '3 h 05 min', '2 days 4 h'."""
  minutes, hours = seconds / 60, seconds / 3600
  if seconds < 90:
    return f'{seconds:.0f} s'
  if minutes < 90:
    return f'{minutes:.0f} min'
  if hours < 48:
    return f'{int(hours)} h {int(minutes) % 60:02d} min'
  return f'{int(hours // 24)} days {int(hours) % 24} h'
