"""The workdir of a run: checked before anything is read, its lock, config record and metrics.

  <workdir>/run.lock        held by the training run using the workdir (`RunLock`)
  <workdir>/config.json     the config the run started with, never overwritten
  <workdir>/config_history.jsonl  one row per start: when, the step, the config, what changed
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


# ====== The run's record: the config it started with, and every start since ===========

CONFIG_NAME = 'config.json'
HISTORY_NAME = 'config_history.jsonl'

# Fields that cannot change what a run means: how long it runs, how often it logs,
# validates and checkpoints, where its data lie, how its math is computed. A resume
# applies them (and records them); any other change needs --accept_config_changes.
OPERATIONAL_FIELDS = frozenset({
    'train.num_steps', 'train.log_every_steps', 'train.checkpoint_every_steps',
    'train.keep_checkpoints', 'train.eval_every_steps', 'train.eval_episodes',
    'train.on_divergence', 'data.data_dir', 'data.manual_dir',
    'model.conv_impl', 'model.encoder_impl', 'model.vectorize', 'model.remat'})

# What a field added since meant to a run whose record predates it: the value that does
# what the code did before the field existed (the readers' `.get` defaults for an old
# config.json say the same). A field added later must be listed here, or older workdirs
# refuse to resume until told (`--accept_config_changes`).
BEFORE_THE_FIELD = {
    'method': 'cht', 'data.pipeline': 'device', 'data.images_per_class': 20,
    'data.binarize': False, 'data.augment.flip': False, 'data.augment.hue': 0.0,
    'data.augment.brightness': 0.0, 'data.augment.contrast': 0.0,
    'data.augment.crop_min_scale': 1.0, 'episode.unlabeled_per_class': 0,
    'episode.independent_draws': False, 'model.compute_dtype': 'float32',
    'model.head_scale': 0.0, 'model.learned_base': 0.0, 'model.feature_norm': False,
    'model.trained_layers': 0, 'optim.schedule': 'exponential', 'optim.end_fraction': 0.0,
    'optim.warmup_steps': 0, 'optim.weight_decay': 0.0, 'train.loss_spike_factor': 0.0}
# Fields that no run older than them read (other methods' and datasets'): this code's
# value stands for a record without them.
UNREAD_BEFORE = ('baseline.', 'constpn_ways_multiplier', 'data.check_class_counts',
                 'data.domains', 'data.domain_split')
# Fields since removed, with the value that does what this code does (they were off).
REMOVED_FIELDS = {'label_smoothing': 0.0, 'train.curriculum_steps': 0, 'optim.beta2': 0.999}


class ConfigChangeError(WorkdirError):
  """A resume would change what the workdir's run means."""


class _Absent:
  """The value of a field that one side lacks."""

  def __repr__(self):
    return '(absent)'


ABSENT = _Absent()


def _flat(tree: dict, prefix: str = '') -> dict[str, Any]:
  """{'a': {'b': 1}} -> {'a.b': 1}."""
  out = {}
  for key, value in tree.items():
    out.update(_flat(value, f'{prefix}{key}.') if isinstance(value, dict)
               else {f'{prefix}{key}': value})
  return out


def _as_json(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """`config` flat, as its record would hold it (tuples as lists)."""
  return _flat(json.loads(config.to_json_best_effort()))


def recorded_config_tree(workdir: str) -> dict[str, Any] | None:
  """The config of the run in `workdir` as its last start recorded it (the original
  config.json plus what starts since accepted), nested; None where there is no record."""
  try:
    with open(os.path.join(workdir, HISTORY_NAME)) as f:
      rows = [row for row in map(_parse_row, f) if row and 'config' in row]
    if rows:
      return rows[-1]['config']
  except OSError:  # No history: config.json alone (a first start, or older code's).
    pass
  try:
    with open(os.path.join(workdir, CONFIG_NAME)) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def recorded_config(workdir: str) -> dict[str, Any] | None:
  """`recorded_config_tree`, flat ('model.channels': 8)."""
  tree = recorded_config_tree(workdir)
  return None if tree is None else _flat(tree)


def _recorded_value(recorded: dict[str, Any], field: str, now: dict[str, Any]) -> Any:
  if field in recorded:
    return recorded[field]
  if field in BEFORE_THE_FIELD:
    return BEFORE_THE_FIELD[field]
  if field.startswith(UNREAD_BEFORE):
    return now[field]
  return ABSENT


def config_changes(recorded: dict[str, Any],
                   config: ml_collections.ConfigDict) -> dict[str, tuple[Any, Any]]:
  """field -> (the record's value, `config`'s) where they differ; ABSENT where a side
  lacks the field (a record older than it, with no known value then; a removed field)."""
  now = _as_json(config)
  changes = {}
  for field in sorted(recorded.keys() | now.keys()):
    old = _recorded_value(recorded, field, now)
    new = now.get(field, REMOVED_FIELDS.get(field, ABSENT))
    if old is ABSENT or new is ABSENT or old != new:
      changes[field] = (old, new)
  return changes


def describe(changes: dict[str, tuple[Any, Any]]) -> str:
  """'model.channels 8 -> 16, ...'."""
  return ', '.join(f'{field} {old!r} -> {new!r}' for field, (old, new) in changes.items())


def run_config(workdir: str, config: ml_collections.ConfigDict, mode: str,
               overridden=(), accept: bool = False) -> ml_collections.ConfigDict:
  """The config to run `mode` ('train' or 'eval') with in `workdir`: `config` where the
  workdir holds no record, else the record's, the workdir's run being its truth.

  Training applies the OPERATIONAL_FIELDS of `config` and keeps the record's value of any
  other field where `config` differs by its defaults or file; a field `overridden` on the
  command line that differs (or one the record cannot tell) raises ConfigChangeError,
  unless `accept`: then `config` is taken whole. Evaluation takes every field but the
  operational ones from the record, and says so. Reads only: a start records itself
  (`record_start`).
  """
  recorded = recorded_config(workdir)
  if recorded is None:
    if mode == 'eval':
      logging.info('%s has no %s: evaluating with the config given.', workdir, CONFIG_NAME)
    return config
  changes = {field: change for field, change in config_changes(recorded, config).items()
             if field not in OPERATIONAL_FIELDS}
  if mode == 'eval':
    return _evaluated_config(workdir, config, changes)
  return _resumed_config(workdir, config, changes, overridden, accept)


def _resumed_config(workdir, config, changes, overridden, accept):
  """`run_config` for training."""
  if accept:  # The config given, whole: a field derived from an override changes with it.
    if changes:
      logging.warning('Changing the run of %s from here on (--accept_config_changes): %s.',
                      workdir, describe(changes))
    return config
  by_user = lambda field: any(field == o or field.startswith(o + '.') for o in overridden)
  refused = {field: (old, new) for field, (old, new) in changes.items()
             if by_user(field) or ABSENT in (old, new)}
  kept = {field: change for field, change in changes.items() if field not in refused}
  if refused:
    also = f' (it would also change {describe(kept)})' if kept else ''
    raise ConfigChangeError(
        f'{os.path.abspath(workdir)} holds a run that started with other settings: '
        f'{_refused(refused)}. A resume changes only train.num_steps, logging, validation '
        'and checkpoint cadence, data paths and compute options: drop those --config '
        'overrides to go on as the run started, use a new --workdir for a new run, or pass '
        f'--accept_config_changes to change this run from here on{also}, recorded in its '
        f'{HISTORY_NAME}. Nothing was changed.')
  if kept:
    logging.warning('Resuming the run of %s with its recorded settings where this config '
                    'differs: %s.', workdir, _recorded_over_given(kept))
  return _with_values(config, {field: old for field, (old, _) in kept.items()})


def _refused(changes: dict[str, tuple[Any, Any]]) -> str:
  """'optim.learning_rate 0.0001 -> 5e-05, data.x (absent) -> 1 (the record predates the
  field)'."""
  why = lambda old, new: (' (the record predates the field)' if old is ABSENT else
                          ' (this code has no such field)' if new is ABSENT else '')
  return ', '.join(f'{field} {old!r} -> {new!r}{why(old, new)}'
                   for field, (old, new) in changes.items())


def _evaluated_config(workdir, config, changes):
  """`run_config` for evaluation: the record's settings, said in one line (and one more
  where the config given differs)."""
  taken = {field: change for field, change in changes.items() if ABSENT not in change}
  config = _with_values(config, {field: old for field, (old, _) in taken.items()})
  logging.info('Evaluating the model trained in %s as its record says: %s.', workdir,
               _summary(config))
  if changes:
    untold = {field: change for field, change in changes.items() if field not in taken}
    logging.warning('Taken from the record of %s over the config given: %s.%s', workdir,
                    _recorded_over_given(taken) or 'nothing',
                    f' Left as given (one side lacks the field): {describe(untold)}.'
                    if untold else '')
  return config


def _recorded_over_given(changes: dict[str, tuple[Any, Any]]) -> str:
  """'episode.num_tasks 2 (the config given: 3), ...'."""
  return ', '.join(f'{field} {old!r} (the config given: {new!r})'
                   for field, (old, new) in changes.items())


def _summary(config: ml_collections.ConfigDict) -> str:
  """'cht, T=2 tasks of 3-way 1-shot, model.channels=8, omniglot 16x16 binarised, ...'."""
  ep, data = config.episode, config.data
  return (f'{config.get("method", "cht")}, T={ep.num_tasks} tasks of {ep.ways}-way '
          f'{ep.shots}-shot, model.channels={config.model.channels}, {data.dataset} '
          f'{data.image_size}x{data.image_size}'
          + (' binarised' if data.get('binarize') else '')
          + (', independent draws' if ep.get('independent_draws') else ''))


def _with_values(config: ml_collections.ConfigDict,
                 values: dict[str, Any]) -> ml_collections.ConfigDict:
  """A copy of `config` with the dotted fields of `values` (JSON lists as tuples where
  `config` has a tuple)."""
  if not values:
    return config
  config = config.copy_and_resolve_references()
  with config.unlocked():
    for dotted, value in values.items():
      *path, leaf = dotted.split('.')
      node = config
      for name in path:
        node = node[name]
      if isinstance(node[leaf], tuple) and isinstance(value, list):
        value = tuple(value)
      node[leaf] = value
  return config


def record_start(workdir: str, config: ml_collections.ConfigDict, step: int) -> None:
  """Appends this start (time, host, the step it starts from, the config, what changed
  since the last start) to config_history.jsonl; writes config.json, the config the run
  started with, at its first start only."""
  if jax.process_index() != 0:
    return
  recorded = recorded_config(workdir)
  changes = {} if recorded is None else config_changes(recorded, config)
  path = os.path.join(workdir, CONFIG_NAME)
  if not os.path.exists(path):
    write_atomically(path, config.to_json_best_effort())
  row = {'started_at': datetime.datetime.now().isoformat(timespec='seconds'),
         'host': socket.gethostname(), 'step': step,
         'changes': {field: [repr(old) if old is ABSENT else old,
                             repr(new) if new is ABSENT else new]
                     for field, (old, new) in changes.items()},
         'config': json.loads(config.to_json_best_effort())}
  history = os.path.join(workdir, HISTORY_NAME)
  try:
    with open(history, 'a') as f:
      f.write(json.dumps(row) + '\n')
  except OSError as e:
    raise WorkdirError(f'Cannot append to {history} ({e}). Free disk space or fix the '
                       'permissions, then rerun the same command.') from None


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
