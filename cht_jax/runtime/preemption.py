"""SIGTERM (a cluster's preemption) and Ctrl-C as a flag the training loop polls between steps
(and the evaluation between batches of episodes, stopping without writing results).

The loop checkpoints the step and raises `Preempted`; `main` exits with its `exit_code`:
143 (128 + SIGTERM, "requeue me" to schedulers), or 130 after Ctrl-C. A second Ctrl-C
exits at once. Several processes stop at the same step: JAX's preemption service agrees
on it (`multihost_utils.reached_preemption_sync_point`), and Ctrl-C becomes a SIGTERM.
"""

import os
import signal
import sys
import threading

from absl import logging
import jax
from jax.experimental import multihost_utils

EXIT_CODE = 128 + signal.SIGTERM
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT


class Preempted(Exception):
  """SIGTERM or SIGINT arrived; the current step was checkpointed (or, in an evaluation,
  nothing was written)."""

  def __init__(self, message: str, signum: int = signal.SIGTERM):
    super().__init__(message)
    self.exit_code = 128 + signum
    self.label = 'Interrupted' if signum == signal.SIGINT else 'Preempted'


class SignalFlag:
  """Within `with`, SIGTERM and SIGINT set `.received` instead of ending the process;
  `.name` and `.signum` are the first signal's. `stopping` and `exiting` say in the log what
  the first signal, and a second Ctrl-C, do."""

  def __init__(self, signums=(signal.SIGTERM, signal.SIGINT),
               stopping: str = 'checkpointing and stopping after this step',
               exiting: str = 'without a checkpoint of this step'):
    self._stopping, self._exiting = stopping, exiting
    self._multiprocess = jax.process_count() > 1
    # SIGTERM is the preemption service's where there are several processes.
    self._signums = tuple(s for s in signums
                          if not (self._multiprocess and s == signal.SIGTERM))
    self._previous = {}
    self.received = False
    self.signum = None

  def stop_at(self, step: int) -> bool:
    """Whether to checkpoint `step` and stop: a signal arrived (with several
    processes: all of them have agreed on this step). Call once at every step (or batch
    of an evaluation, counted from 0)."""
    if not self._multiprocess:
      return self.received
    if multihost_utils.reached_preemption_sync_point(step):
      self.signum = self.signum or signal.SIGTERM
      return True
    return False

  @property
  def name(self) -> str:
    return signal.Signals(self.signum).name if self.signum else ''

  def _handle(self, signum, frame):
    del frame
    if self.received and signum == signal.SIGINT:
      print(f'Interrupted again: exiting now, {self._exiting}.', file=sys.stderr, flush=True)
      os._exit(INTERRUPTED_EXIT_CODE)  # pylint: disable=protected-access
    if not self.received:
      self.signum = signum
      logging.warning('Received %s: %s%s.', signal.Signals(signum).name, self._stopping,
                      ' (Ctrl-C again to exit at once)' if signum == signal.SIGINT else '')
      if self._multiprocess:  # Through the preemption service, to all processes.
        os.kill(os.getpid(), signal.SIGTERM)
    self.received = True

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for signum in self._signums:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc):
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
