"""The workdir of a run: checked before anything is read, its lock, config record and metrics.

  <workdir>/run.lock        held by the training run using the workdir (`RunLock`)
  <workdir>/config.json     the config of the last run (written atomically)
  <workdir>/metrics.jsonl   one JSON row per logged step and split, for scripts
  <workdir>/events.out.*    the same scalars for TensorBoard
  <workdir>/checkpoints/    Orbax (cht_jax/runtime/checkpoints.py)

Files get the umask's permissions (a group on a shared cluster can read the results).
"""

import contextlib
import datetime
import glob
import json
import os
import socket
import tempfile
import threading
import time
from typing import Any, Iterator

from absl import logging
import jax
import ml_collections
import numpy as np

LOCK_NAME = 'run.lock'
# A live run touches its lock this often; one untouched for STALE_LOCK_SECONDS is a dead
# run's (on the lock's own host a dead holder is seen at once) and is taken over.
LOCK_REFRESH_SECONDS = 30
STALE_LOCK_SECONDS = 300


class WorkdirError(RuntimeError):
  """The workdir cannot be written."""


def check_workdir(workdir: str) -> str:
  """Creates `workdir` and its checkpoints folder, checks both are writable; returns the
  workdir's absolute path. Raises WorkdirError naming the folder and the reason."""
  workdir = os.path.abspath(workdir)
  for folder in (workdir, os.path.join(workdir, 'checkpoints')):
    try:
      os.makedirs(folder, exist_ok=True)
      fd, probe = tempfile.mkstemp(dir=folder, prefix='.write_test_')
      os.close(fd)
      os.remove(probe)
    except OSError as e:
      raise WorkdirError(
          f'Cannot write to {folder} ({type(e).__name__}: {e.strerror or e}). Choose '
          'another --workdir or make this one writable; nothing was read or '
          'changed.') from None
  return workdir


def new_folders(workdir: str) -> list[str]:
  """The folders `check_workdir` would create: what a failed start must not leave behind."""
  folder = os.path.abspath(workdir)
  folders = [os.path.join(folder, 'checkpoints')]
  while not os.path.isdir(folder):  # The workdir and its missing parents.
    folders.append(folder)
    folder = os.path.dirname(folder)
  return [f for f in folders if not os.path.isdir(f)]


def remove_if_empty(folders: list[str]) -> None:
  """Removes those of `folders` that are empty, deepest first."""
  for folder in sorted(folders, key=len, reverse=True):
    with contextlib.suppress(OSError):  # Not empty, or already gone.
      os.rmdir(folder)


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
  """A temporary path beside `path` to write to, renamed to `path` when the block ends
  (removed if it raises), so `path` always holds a complete file with the umask's
  permissions. It keeps `path`'s extension, for writers that read it (savefig)."""
  folder, name = os.path.split(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=f'.{name}.',
                             suffix='.tmp' + os.path.splitext(name)[1])
  try:
    os.fchmod(fd, 0o666 & ~_umask())
    os.close(fd)
    yield tmp
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


def write_atomically(path: str, data: str | bytes) -> None:
  """`data` into `path` whole or not at all (`atomic_path`)."""
  with atomic_path(path) as tmp, open(tmp, 'wb' if isinstance(data, bytes) else 'w') as f:
    f.write(data)


def window_means(rows: list[tuple[int, dict[str, float]]], elapsed: float,
                  episodes_per_step: int) -> dict[str, float]:
  """A log window's means over its steps not skipped (divergence.py), how many were, speed."""
  kept = [m for _, m in rows if not m['skipped']] or [m for _, m in rows]
  means = {k: float(np.mean([m[k] for m in kept])) for k in kept[0] if k != 'skipped'}
  means['skipped_steps'] = float(sum(m['skipped'] for _, m in rows))
  means['steps_per_sec'] = len(rows) / elapsed
  means['episodes_per_sec'] = len(rows) * episodes_per_step / elapsed
  return means


def _parse_row(line: str) -> dict[str, Any] | None:
  """A line of metrics.jsonl as a dict; None for a torn line (a killed writer's last)."""
  if not line.endswith('\n'):
    return None
  try:
    return json.loads(line)
  except json.JSONDecodeError:
    return None


class MetricsLog:
  """TensorBoard summaries and a JSON-lines copy (`metrics.jsonl`) for scripts."""

  # The rows the training loop writes ('rollback': divergence.Rollbacks).
  TRAINING_SPLITS = ('train', 'validation', 'rollback')

  def __init__(self, workdir: str):
    self._is_main = jax.process_index() == 0
    self._writer = self._create_writer(workdir)
    self._path = os.path.join(workdir, 'metrics.jsonl')

  def _create_writer(self, workdir: str):
    if not self._is_main:
      return _NoEventsWriter()
    try:
      return _EventFileWriter(workdir)
    except ImportError as e:
      logging.log_first_n(logging.WARNING, 'TensorBoard event files are not written (%s): '
                          'metrics.jsonl has every row.', 1, e)
      return _NoEventsWriter()

  def write(self, step: int, split: str, metrics: dict[str, float]):
    scalars = {f'{split}/{k}': float(v) for k, v in metrics.items()}
    self._writer.write_scalars(step, scalars)
    if self._is_main:
      try:
        with open(self._path, 'a') as f:
          f.write(json.dumps({'step': step, 'split': split, **scalars}) + '\n')
      except OSError as e:
        raise WorkdirError(f'Cannot append to {self._path} ({e}). Free disk space or fix '
                           'the permissions, then rerun the same command to resume from '
                           'the last checkpoint.') from None

  def rows(self, split: str) -> list[dict[str, Any]]:
    """The rows of `split` in metrics.jsonl (any process may read them)."""
    if not os.path.exists(self._path):
      return []
    with open(self._path) as f:
      rows = [_parse_row(line) for line in f]
    return [row for row in rows if row is not None and row.get('split') == split]

  def drop_after(self, step: int) -> None:
    """Drops training rows after `step` and a torn last line, before resuming from `step`
    (a killed run logged steps past its last checkpoint that the resumed run logs again)."""
    if not self._is_main or not os.path.exists(self._path):
      return
    with open(self._path) as f:
      lines = f.readlines()
    kept = [line for line in lines if self._keep(line, step)]
    if len(kept) != len(lines):
      logging.info('Dropping %d rows after step %d from %s.', len(lines) - len(kept),
                   step, self._path)
      write_atomically(self._path, ''.join(kept))
      self._rebuild_events(kept)

  def _rebuild_events(self, lines: list[str]) -> None:
    """TensorBoard's event files rewritten from the kept rows (they cannot drop rows)."""
    workdir = os.path.dirname(self._path)
    self._writer.close()
    for path in glob.glob(os.path.join(workdir, 'events.out.tfevents.*')):
      os.remove(path)
    self._writer = self._create_writer(workdir)
    for line in lines:
      row = json.loads(line)
      step = row.pop('step')
      row.pop('split', None)
      self._writer.write_scalars(step, row)
    self._writer.flush()

  def _keep(self, line: str, step: int) -> bool:
    row = _parse_row(line)
    return row is not None and (row.get('split') not in self.TRAINING_SPLITS
                                or row.get('step', 0) <= step)

  def close(self):
    self._writer.flush()
    self._writer.close()


class _NoEventsWriter:
  """Where no event files are written (other processes; no TensorBoard package)."""

  def write_scalars(self, step, scalars):
    del step, scalars

  def flush(self):
    pass

  def close(self):
    pass


class _EventFileWriter(_NoEventsWriter):
  """Scalars to a TensorBoard event file, written with the `tensorboard` package's record
  format alone. Not its `EventFileWriter` (nor clu's writer): they import TensorFlow where
  it is installed, seconds at every start, and JAX GPU images often lack it."""

  def __init__(self, workdir: str):
    # pylint: disable=g-import-not-at-top
    from tensorboard.compat.proto import event_pb2
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.summary.writer import record_writer
    # pylint: enable=g-import-not-at-top
    self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
    # TensorBoard's own file name: events.out.tfevents.<time>.<host>.<pid>.<n>.
    name = f'events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.0'
    self._writer = record_writer.RecordWriter(open(os.path.join(workdir, name), 'wb'))
    self._add(event_pb2.Event(wall_time=time.time(), file_version='brain.Event:2'))

  def _add(self, event):
    self._writer.write(event.SerializeToString())
    self._writer.flush()  # Visible to TensorBoard at once: one write per logged step.

  def write_scalars(self, step, scalars):
    summary = self._summary_pb2.Summary(value=[
        self._summary_pb2.Summary.Value(tag=tag, simple_value=float(value))
        for tag, value in scalars.items()])
    self._add(self._event_pb2.Event(step=int(step), wall_time=time.time(), summary=summary))

  def flush(self):
    self._writer.flush()

  def close(self):
    self._writer.close()


def write_config(workdir: str, config: ml_collections.ConfigDict) -> None:
  """`<workdir>/config.json`: what `api.load_config` and resume mismatch messages read."""
  write_atomically(os.path.join(workdir, 'config.json'), config.to_json_best_effort())


class RunLock:
  """One training run per workdir: `<workdir>/run.lock`, created atomically (O_EXCL) naming its
  holder, touched every LOCK_REFRESH_SECONDS. A second run raises a `WorkdirError` naming the
  holder, unless that is dead: then it takes the lock over."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, LOCK_NAME)
    self._stop = threading.Event()
    self._thread = None

  def __enter__(self):
    if jax.process_index() != 0:  # Process 0 holds it for the whole multi-process run.
      return self
    me = {'host': socket.gethostname(), 'pid': os.getpid(), 'started': time.time(),
          'started_at': datetime.datetime.now().isoformat(timespec='seconds')}
    while True:
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
      except FileExistsError:
        holder, age = self._holder()
        dead = self._dead(holder, age)
        if dead is None:
          raise WorkdirError(self._in_use(holder, age)) from None
        self._take_over(holder, dead)
        continue
      except OSError as e:
        raise WorkdirError(f'Cannot create {self.path} ({e.strerror or e}). Choose another '
                           '--workdir or make this one writable.') from None
      with os.fdopen(fd, 'w') as f:
        json.dump(me, f)
      break
    self._thread = threading.Thread(target=self._refresh, daemon=True, name='run-lock')
    self._thread.start()
    return self

  def __exit__(self, *exc):
    if self._thread is None:
      return
    self._stop.set()
    self._thread.join()
    holder, _ = self._holder()
    if holder.get('pid') == os.getpid() and holder.get('host') == socket.gethostname():
      os.remove(self.path)

  def _refresh(self):
    while not self._stop.wait(LOCK_REFRESH_SECONDS):
      try:
        os.utime(self.path)
      except OSError as e:  # The run goes on; a later run may then take the lock over.
        logging.warning('Cannot refresh %s: %s', self.path, e)

  def _holder(self) -> tuple[dict, float]:
    """(the holder's record, {} while being written; seconds since its last refresh)."""
    try:
      age = time.time() - os.stat(self.path).st_mtime
      with open(self.path) as f:
        return json.load(f), age
    except FileNotFoundError:
      return {}, 0.0
    except (OSError, ValueError):
      return {}, age

  @staticmethod
  def _dead(holder: dict, age: float) -> str | None:
    """Why the holder is dead, or None if it may be alive."""
    if age > STALE_LOCK_SECONDS:
      return f'no sign of life for {age:.0f} s'
    if holder.get('host') == socket.gethostname() and holder.get('pid'):
      try:
        os.kill(holder['pid'], 0)
      except ProcessLookupError:
        return f'process {holder["pid"]} is gone'
      except PermissionError:  # Alive, another user's.
        pass
    return None

  def _in_use(self, holder: dict, age: float) -> str:
    who = (f'host {holder.get("host", "?")}, process {holder.get("pid", "?")}, started '
           f'{holder.get("started_at", "?")}' if holder else 'a run that is just starting')
    return (f'{os.path.dirname(self.path)} is in use by another training run ({who}; its '
            f'lock {self.path} was refreshed {age:.0f} s ago). Wait for that run to end or '
            'stop it, or use another --workdir. If it is dead, its lock is taken over '
            f'{STALE_LOCK_SECONDS} s after its last refresh (or delete the file).')

  def _take_over(self, holder: dict, why: str) -> None:
    # Renamed to our own name first: of two runs taking over at once, one rename succeeds.
    stale = f'{self.path}.stale.{socket.gethostname()}.{os.getpid()}'
    try:
      os.rename(self.path, stale)
    except FileNotFoundError:
      return
    try:
      with open(stale) as f:
        renamed = json.load(f)
    except (OSError, ValueError):
      renamed = {}
    if renamed != holder:  # A live run's new lock: put it back (unless yet another is there).
      with contextlib.suppress(OSError):
        os.link(stale, self.path)
      os.remove(stale)
      return
    logging.warning('Taking over the lock of a dead run (%s): %s.', why, holder or 'unreadable')
    os.remove(stale)
