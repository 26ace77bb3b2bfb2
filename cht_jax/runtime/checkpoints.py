"""Orbax checkpoints of a workdir: the manager, save, restore, and what a mismatch says.

Every failure here is a `CheckpointError` naming the folder, the cause and what to do.
"""

import logging as std_logging
import os
import re
from typing import Any

from absl import logging
from etils import epath
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from cht_jax.runtime import devices
from cht_jax.runtime import workdir as workdir_lib


class CheckpointError(RuntimeError):
  """A checkpoint could not be written, read, or does not fit the config."""


class _QuietOrbax(std_logging.Filter):
  """Drops Orbax's INFO lines (they drown the progress) and its ERROR lines' tracebacks
  (the `CheckpointError` that follows says what to do)."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    if f'{os.sep}orbax{os.sep}' not in record.pathname:
      return True
    record.exc_info, record.exc_text = None, None
    return record.levelno >= std_logging.WARNING


def quiet_orbax_logs(verbose: bool = False) -> None:
  """Orbax's INFO chatter off (`verbose`, e.g. --verbosity=1, keeps it)."""
  if not verbose:
    # Orbax logs through absl, i.e. the standard 'absl' logger: filter there.
    std_logging.getLogger('absl').addFilter(_QuietOrbax())


def manager(workdir: str, config, remove_partial: bool = False) -> ocp.CheckpointManager:
  """The Orbax manager of `<workdir>/checkpoints` (keeps `train.keep_checkpoints`);
  `remove_partial` (the trainer only: it would delete a live run's save) drops partial saves."""
  return ocp.CheckpointManager(
      os.path.join(os.path.abspath(workdir), 'checkpoints'),
      item_handlers=ocp.StandardCheckpointHandler(),
      options=ocp.CheckpointManagerOptions(
          max_to_keep=config.train.keep_checkpoints, create=True,
          cleanup_tmp_directories=remove_partial))


def _flat_shapes(tree) -> dict[str, tuple[tuple[int, ...], str]]:
  """'params/block_0/kernel'-style path -> (shape, dtype) of every array leaf."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(path, simple=True, separator='/'):
          (tuple(leaf.shape), str(np.dtype(leaf.dtype))) for path, leaf in leaves}


def mismatches(metadata, abstract) -> list[str]:
  """How the arrays of a checkpoint (its `item_metadata`) differ from `abstract`'s."""
  found = _flat_shapes(metadata)
  if not found:
    raise ValueError('its metadata lists no arrays (_METADATA missing or unreadable)')
  expected = _flat_shapes(abstract)
  problems = {k: f'{k} has shape {found[k][0]} {found[k][1]} in the checkpoint but '
                 f'{expected[k][0]} {expected[k][1]} in this config'
              for k in found.keys() & expected.keys() if found[k] != expected[k]}
  problems.update({k: f'{k} is in this config but not in the checkpoint'
                   for k in expected.keys() - found.keys()})
  problems.update({k: f'{k} is in the checkpoint but not in this config'
                   for k in found.keys() - expected.keys()})
  # Parameters first: the optimiser state only mirrors them.
  return [problems[k] for k in sorted(problems, key=lambda k: (not k.startswith('params'), k))]


def _config_changes(workdir: str, config) -> str:
  """' Fields that differ from ...: model.channels 8 -> 16.' where `config` differs from
  the workdir's record (`workdir.config_changes`), or ''."""
  recorded = workdir_lib.recorded_config(workdir)
  if recorded is None or config is None:  # No record of the run's config: nothing to compare.
    return ''
  changes = workdir_lib.config_changes(recorded, config)
  return (' Fields that differ from the config of the run in this workdir: '
          + workdir_lib.describe(changes) + '.') if changes else ''


def root_cause(error: BaseException) -> str:
  """The innermost error of a chain in one line, e.g. 'No space left on device (errno 28)'."""
  seen = []
  while error is not None and error not in seen:
    seen.append(error)
    error = error.__cause__ or error.__context__
  for e in reversed(seen):  # Prefer the innermost OS error, the actionable one.
    if isinstance(e, OSError) and e.errno:
      return f'{e.strerror} (errno {e.errno})'
    # TensorStore (Orbax's array writer) reports OS errors inside its message.
    code = re.search(r"os_error_code='?(\d+)", str(e))
    if code:
      return f'{os.strerror(int(code.group(1)))} (errno {code.group(1)})'
  e = seen[-1]
  # C++ source locations ('[external/gloo/.../pair.cc:538] ') name the library's code, not
  # anything the user can act on, and read as an abort's noise in a one-line error.
  message = re.sub(r'\[[^\]\s]+\.(?:cc|cpp|h):\d+\]\s*', '', str(e))
  return f'{type(e).__name__}: {" ".join(message.split())}'[:300]


def check_fits(manager, step: int, abstract, config) -> None:
  """Raises CheckpointError if the checkpoint of `step` does not fit `abstract`."""
  try:
    problems = mismatches(manager.item_metadata(step), abstract)
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(
        f'Cannot read the checkpoint of step {step} in {manager.directory} '
        f'({root_cause(e)}). It is left untouched; to resume from an earlier checkpoint, '
        f'move {manager.directory}/{step} out of that folder, or use a new --workdir.'
    ) from None
  if problems:
    shown = '; '.join(problems[:3]) + ('; ...' if len(problems) > 3 else '')
    raise CheckpointError(
        f'The checkpoint of step {step} in {manager.directory} was written by a '
        f'different config: {len(problems)} arrays differ ({shown}).'
        + _config_changes(os.path.dirname(os.fspath(manager.directory)), config)
        + ' Resume with the config (and --config.* overrides) it was trained with, or '
        'start afresh with a new --workdir; the checkpoints are left untouched.')


def restore_or_init(manager: ocp.CheckpointManager, state: Any,
                    config: ml_collections.ConfigDict | None = None) -> Any:
  """The latest complete checkpoint of the workdir if any, else `state`. Raises CheckpointError,
  deleting nothing, if it cannot be read or does not fit (naming changed `config` fields)."""
  step = manager.latest_step()
  if step is None:
    return state
  logging.info('Resuming from the checkpoint of step %d in %s.', step, manager.directory)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  check_fits(manager, step, abstract, config)
  try:
    return manager.restore(step, args=ocp.args.StandardRestore(abstract))
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(
        f'Cannot restore the checkpoint of step {step} in {manager.directory} '
        f'({root_cause(e)}). It is left untouched; to resume from an earlier one, move '
        f'{manager.directory}/{step} out of that folder, or use a new --workdir.') from None


def save(manager: ocp.CheckpointManager, step: int, state: Any, wait: bool) -> None:
  """Saves asynchronously (or not, if `wait`); errors become CheckpointError, or
  devices.LostProcessError where another process of the job is gone. A failed
  asynchronous save raises at the next save or wait."""
  try:
    manager.save(step, args=ocp.args.StandardSave(state))
    if wait:
      manager.wait_until_finished()
  except Exception as e:  # pylint: disable=broad-except
    if devices.lost_process(e):  # Not the disk's fault: a peer of its barrier is gone.
      raise devices.lost_process_error(
          f'a checkpoint save in {manager.directory} failed: {root_cause(e)}') from None
    try:
      manager.reload()
      kept = manager.all_steps()
    except Exception:  # pylint: disable=broad-except
      # Orbax may not read a folder mid-failure: complete steps are bare numbers.
      kept = sorted(int(p.name) for p in epath.Path(manager.directory).iterdir()
                    if p.name.isdigit())
    raise CheckpointError(
        f'Saving a checkpoint in {manager.directory} failed ({root_cause(e)}). The '
        f'complete checkpoints there (steps {", ".join(map(str, kept)) or "none"}) are '
        'kept, and a partial one is removed when training restarts. Free disk space or '
        'fix the permissions, then rerun the same command to resume'
        + (f' from step {max(kept)}.' if kept else ' from the start.')) from None


def close(manager: ocp.CheckpointManager) -> None:
  """Waits for an asynchronous save in flight; its failure is only logged here."""
  try:
    manager.close()
  except Exception as e:  # pylint: disable=broad-except
    logging.error('Closing the checkpoint manager of %s: %s', manager.directory,
                  root_cause(e))


def _replicated(metadata) -> Any:
  """ShapeDtypeStructs of a checkpoint's arrays, replicated over this job's devices
  (without a target Orbax uses the saving devices: fails on a GPU's checkpoint on CPU)."""
  replicated = jax.sharding.NamedSharding(
      jax.sharding.Mesh(np.array(jax.devices()), ('data',)), jax.sharding.PartitionSpec())
  return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=replicated),
                      metadata)


def restore_params(workdir: str, abstract_params: Any, step: int | None = None) -> tuple[Any, int]:
  """(params, step) of a training checkpoint of `workdir` (`step` None: the latest), replicated
  over this job's devices. Only the parameters must fit `abstract_params`: the optimiser state
  is dropped. Raises CheckpointError where there is none, or the parameters do not fit."""
  train_first = ('Pass the --workdir of a trained model, or train one first (python -m '
                 f'cht_jax.main --config=... --workdir={workdir}).')
  if not os.path.isdir(os.path.join(workdir, 'checkpoints')):
    raise CheckpointError(f'No checkpoint in {os.path.abspath(workdir)}: it has no '
                          'checkpoints/ folder. ' + train_first)
  # keep_checkpoints is irrelevant to a reader: it never saves.
  reader = ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), 'checkpoints'),
                                 item_handlers=ocp.StandardCheckpointHandler())
  try:
    steps = sorted(reader.all_steps())
    if not steps:
      raise CheckpointError(f'No complete checkpoint in {reader.directory}. ' + train_first)
    if step is None:
      step = steps[-1]
    elif step not in steps:
      raise CheckpointError(
          f'No checkpoint of step {step} in {reader.directory}; it has steps {steps}. '
          'Pass one of them as --checkpoint_step, or leave it out for the latest.')
    try:
      metadata = reader.item_metadata(step)
      problems = [p for p in mismatches(metadata, {'params': abstract_params})
                  if p.startswith('params/')]
      restored = None if problems else reader.restore(
          step, args=ocp.args.StandardRestore(_replicated(metadata)))
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(
          f'Cannot read the checkpoint of step {step} in {reader.directory} '
          f'({type(e).__name__}: {" ".join(str(e).split())[:300]}). Pass another '
          f'--checkpoint_step (steps there: {steps}).') from None
    if problems:
      raise CheckpointError(
          f'The checkpoint of step {step} in {reader.directory} does not fit this '
          f'config: {len(problems)} parameter arrays differ ({"; ".join(problems[:3])}'
          f'{"; ..." if len(problems) > 3 else ""}). Evaluate with the config (and '
          '--config.* overrides) the model was trained with; training saved it as '
          f'{os.path.join(os.path.abspath(workdir), "config.json")}.')
  finally:
    reader.close()
  params = jax.tree.map(jnp.asarray, restored['params'])
  logging.info('Restored the parameters of step %d from %s.', step, reader.directory)
  return params, step
