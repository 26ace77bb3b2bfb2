"""SIGTERM (a cluster's preemption) as a flag the training loop polls between steps.

The loop checkpoints the step in progress and raises `Preempted`; `main`
exits with `EXIT_CODE` (128 + SIGTERM), the status schedulers read as
"terminated, requeue me".
"""

import signal
import threading

from absl import logging

EXIT_CODE = 128 + signal.SIGTERM


class Preempted(Exception):
  """SIGTERM arrived; the current step was checkpointed."""


class SignalFlag:
  """Within `with`, SIGTERM sets `.received` instead of ending the process."""

  def __init__(self, signum: int = signal.SIGTERM):
    self._signum = signum
    self._previous = None
    self.received = False

  def _handle(self, signum, frame):
    del frame
    logging.warning('Received signal %d: checkpointing and stopping after this step.', signum)
    self.received = True

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(self._signum, self._handle)
    return self

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(self._signum, self._previous)
