"""The workdir of a run: checked before anything is read, its config record and metrics log.

  <workdir>/config.json     the config of the last run (written atomically)
  <workdir>/metrics.jsonl   one JSON row per logged step and split, for scripts
  <workdir>/events.out.*    the same scalars for TensorBoard
  <workdir>/checkpoints/    Orbax (cht_jax/checkpoints.py)
"""

import json
import os
import tempfile

from absl import logging
import jax
import ml_collections


class WorkdirError(RuntimeError):
  """The workdir cannot be written."""


def check_workdir(workdir: str) -> str:
  """Creates `workdir` (and its checkpoints folder) and checks both are writable.

  Returns:
    The absolute path of the workdir.

  Raises:
    WorkdirError: naming the folder and the reason.
  """
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


def write_json_atomically(path: str, text: str) -> None:
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix='.tmp')
  try:
    with os.fdopen(fd, 'w') as f:
      f.write(text)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


class MetricsLog:
  """TensorBoard summaries and a JSON-lines copy (`metrics.jsonl`) for scripts."""

  TRAINING_SPLITS = ('train', 'validation')  # The rows the training loop writes.

  def __init__(self, workdir: str):
    # Imported here: clu's writers pull in TensorFlow, which the training step,
    # the benchmark and the API do not need (a GPU image may not have it).
    from clu import metric_writers  # pylint: disable=g-import-not-at-top
    self._is_main = jax.process_index() == 0
    self._writer = metric_writers.create_default_writer(
        workdir, just_logging=not self._is_main)
    self._path = os.path.join(workdir, 'metrics.jsonl')

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

  def drop_after(self, step: int) -> None:
    """Drops training rows after `step` and a torn last line, before resuming from `step`.

    A run killed after its last checkpoint has logged steps that the resumed
    run logs again; without this they would appear twice.
    """
    if not self._is_main or not os.path.exists(self._path):
      return
    with open(self._path) as f:
      lines = f.readlines()
    kept = [line for line in lines if self._keep(line, step)]
    if len(kept) != len(lines):
      logging.info('Dropping %d rows after step %d from %s.', len(lines) - len(kept),
                   step, self._path)
      write_json_atomically(self._path, ''.join(kept))

  def _keep(self, line: str, step: int) -> bool:
    if not line.endswith('\n'):
      return False
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      return False
    return row.get('split') not in self.TRAINING_SPLITS or row.get('step', 0) <= step

  def close(self):
    self._writer.flush()
    self._writer.close()


def write_config(workdir: str, config: ml_collections.ConfigDict) -> None:
  """`<workdir>/config.json`: what `api.load_config` and resume mismatch messages read."""
  write_json_atomically(os.path.join(workdir, 'config.json'), config.to_json_best_effort())
