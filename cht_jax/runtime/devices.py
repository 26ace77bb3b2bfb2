"""Data parallelism: the devices a batch is split over and the mean gradient over them.

On CPU one device per core (`use_cpu_cores`): XLA:CPU runs this model's many small ops
one after another on few threads (docs/performance.md). Several processes
(`initialize_distributed`): a bounded wait for the coordinator, and a watch for a lost one.
"""

import atexit
import os
import subprocess
import sys
import threading
import time
from typing import Callable

from absl import logging
import jax
from jax import flatten_util
from jax._src import distributed  # The client: live processes, barriers.
import jax.numpy as jnp

_DEVICE_COUNT_FLAG = '--xla_force_host_platform_device_count'
# What XLA's errors say when a collective or barrier lost its peer.
_LOST_SIGNS = ('Gloo', 'heartbeat', 'Connection reset', 'UNAVAILABLE', 'connection closed',
               'Socket closed')
_WATCH_SECONDS = 1.0  # How often the watch asks the coordinator which processes live.
_EXIT_BARRIER_MS = 30 * 60 * 1000  # At the end, process 0 may still be writing results.
_SHUTTING_DOWN = threading.Event()  # Set at a normal exit: the watch then stands down.
# Where the coordinator, process 0, is lost, JAX's client aborts the others in C++ before
# any Python runs. So each of them starts this watcher: when its process ends without
# `stand_down` and the coordinator no longer answers, it writes the process's last line.
_OUTSIDE_WATCH = '''import signal, socket, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C and SIGTERM are the process's to answer.
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if sys.stdin.read() != 'done':
  try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10).close()
  except OSError:
    sys.stderr.write('\\n' + sys.argv[3] + '\\n')
'''
_outside_watch = []  # The watcher's process, while armed.


class CoordinatorError(RuntimeError):
  """The processes of a job did not all reach the coordinator in time."""


class LostProcessError(RuntimeError):
  """Another process of this job is gone (killed, out of memory, its host lost)."""


def cpu_cores() -> int:
  """Cores this process may run on."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # Not on Linux.
    return os.cpu_count() or 1


def use_cpu_cores() -> bool:
  """Makes the CPU backend one device per core, unless XLA_FLAGS sets the count; returns
  whether it did. Call before any JAX operation. The default backend is unchanged."""
  if _DEVICE_COUNT_FLAG in os.environ.get('XLA_FLAGS', ''):
    return False
  try:
    jax.config.update('jax_num_cpu_devices', cpu_cores())
  except RuntimeError:  # Backends already initialised (e.g. called in-process twice).
    return False
  return True


def num_data_devices(batch_size: int | None = None) -> int:
  """Devices a batch of `batch_size` episodes is split over: all of them on accelerators
  and across processes; on one CPU process, the most that divide the batch."""
  count = jax.device_count()
  if batch_size is None or jax.default_backend() != 'cpu' or jax.process_count() > 1:
    return count
  return max(n for n in range(1, count + 1) if batch_size % n == 0)


def data_mesh(batch_size: int | None = None) -> jax.sharding.Mesh:
  """A 1-D mesh over `num_data_devices(batch_size)` devices; batches split along 'data'."""
  devices = jax.devices()[:num_data_devices(batch_size)]
  return jax.make_mesh((len(devices),), ('data',), devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,))


def batch_grads(loss_fn, params, episodes, mesh: jax.sharding.Mesh, vectorize: bool):
  """Mean gradient and metrics of `loss_fn(params, episode) -> (loss, metrics)` over a batch
  [B, ...] split over `mesh` by `shard_map` (a sharded vmap would gather it around the
  'fused_cpu' custom calls). A device vmaps its episodes when `vectorize`, else scans them
  (on CPU one episode at a time stays in cache, docs/performance.md)."""
  def device_grads(params, row):
    size = jax.tree.leaves(row)[0].shape[0]
    if vectorize:
      def mean_loss(p):
        _, metrics = jax.vmap(lambda episode: loss_fn(p, episode))(row)
        metrics = jax.tree.map(jnp.mean, metrics)
        return metrics['loss'], metrics
      grads, metrics = jax.grad(mean_loss, has_aux=True)(params)
    else:
      grad_fn = jax.grad(loss_fn, has_aux=True)
      def accumulate(total, episode):
        return jax.tree.map(jnp.add, total, grad_fn(params, episode)), None
      first = jax.tree.map(lambda x: x[0], row)
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                           jax.eval_shape(grad_fn, params, first))
      total, _ = jax.lax.scan(accumulate, zeros, row)
      grads, metrics = jax.tree.map(lambda x: x / size, total)
    # One all-reduce of one vector: several in flight can hang XLA:CPU (each holds a
    # pool thread while it waits for the other devices).
    flat, unravel = flatten_util.ravel_pytree((grads, metrics))
    return unravel(jax.lax.pmean(flat, 'data'))

  return jax.shard_map(device_grads, mesh=mesh, in_specs=(jax.P(), jax.P('data')),
                       out_specs=jax.P(), check_vma=False)(params, episodes)


def initialize_distributed(coordinator_address: str | None, num_processes: int | None,
                           process_id: int | None, heartbeat_timeout_seconds: int,
                           coordinator_timeout_seconds: int,
                           stop: Callable[[Exception], None],
                           last_line: Callable[[Exception], str]) -> None:
  """`jax.distributed.initialize`, then a watch on the other processes. `stop(error)`, called
  from a thread (the main one may wait in XLA), must end the process: a CoordinatorError if
  this one has not joined in time, a LostProcessError once another is silent for
  `heartbeat_timeout_seconds` or the coordinator is gone; `stand_down` first.
  `last_line(error)` is what `stop` would write, for a watcher outside this process."""
  # Recoverable: a lost process is reported to the others instead of aborting them in C++.
  jax.config.update('jax_enable_recoverability', True)
  address = coordinator_address or os.environ.get('JAX_COORDINATOR_ADDRESS')
  timer = threading.Timer(coordinator_timeout_seconds, lambda: stop(CoordinatorError(
      _coordinator_message(address, num_processes, process_id, coordinator_timeout_seconds))))
  timer.daemon = True
  timer.start()
  try:
    # JAX's own deadline, later than the timer's, would abort without the address.
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               initialization_timeout=coordinator_timeout_seconds + 60,
                               heartbeat_timeout_seconds=heartbeat_timeout_seconds)
  finally:
    timer.cancel()
  watch = threading.Thread(target=_watch_processes, args=(stop,), daemon=True,
                           name='lost_process_watch')
  watch.start()
  atexit.register(_leave_together)
  found = distributed.global_state.coordinator_address  # JAX's, where the cluster gave it.
  if jax.process_index() != 0 and found:
    host, port = found.rsplit(':', 1)
    line = last_line(lost_process_error('the coordinator is unreachable', [0]))
    _outside_watch.append(subprocess.Popen(
        [sys.executable, '-I', '-c', _OUTSIDE_WATCH, host.strip('[]'), port, line],
        stdin=subprocess.PIPE, text=True))


def stand_down() -> None:
  """This process ends by its own decision: the watcher outside it stays silent."""
  while _outside_watch:
    try:
      with _outside_watch.pop().stdin as pipe:
        pipe.write('done')
    except OSError:  # It is gone already.
      pass


def _leave_together() -> None:
  """At a normal exit, waits for the other processes (recoverable mode's shutdown does
  not): an early leaver looks lost, and process 0, the coordinator, must leave last."""
  _SHUTTING_DOWN.set()
  stand_down()
  client = distributed.global_state.client
  if client is None:
    return
  try:
    client.wait_at_barrier('cht_jax_exit', _EXIT_BARRIER_MS)
    if jax.process_index() == 0:
      everyone, deadline = list(range(jax.process_count())), time.monotonic() + 60
      while list(client.get_live_nodes(everyone)) != [0] and time.monotonic() < deadline:
        time.sleep(0.05)
  except Exception as e:  # pylint: disable=broad-except
    logging.warning('Not all processes of the job reached its end: %s',
                    ' '.join(str(e).split())[:300])


def _coordinator_message(address, num_processes, process_id, seconds) -> str:
  who = f'process {process_id} of {num_processes}' if process_id is not None else 'this process'
  where = address or 'the address of the cluster environment'
  return (f'{who} could not join the job at the coordinator {where} within {seconds} s '
          '(--coordinator_timeout_seconds). Check that process 0 runs on that host and '
          'listens on that port (--coordinator_address=host:port of process 0), that no '
          'firewall blocks it, and that all processes of the job were started.')


def _watch_processes(stop: Callable[[Exception], None]) -> None:
  """Polls the coordinator for the live processes; stops this one when one is gone."""
  everyone = list(range(jax.process_count()))
  while not _SHUTTING_DOWN.wait(_WATCH_SECONDS):
    try:
      live = distributed.global_state.client.get_live_nodes(everyone)
      lost = [i for i in everyone if i not in live]
      detail = 'the coordinator has not heard from it within --heartbeat_timeout_seconds'
    except Exception as e:  # pylint: disable=broad-except
      if jax.process_index() == 0:  # The coordinator is this process: a passing fault.
        continue
      lost, detail = [0], f'the coordinator is unreachable: {" ".join(str(e).split())[:150]}'
    if lost and not _SHUTTING_DOWN.is_set():
      stop(lost_process_error(detail, lost))
      return


def lost_process(error: BaseException) -> bool:
  """Whether `error` says another process of this job is gone (False with one process)."""
  if jax.process_count() == 1:
    return False
  text = str(error)
  return isinstance(error, LostProcessError) or any(s in text for s in _LOST_SIGNS)


def lost_process_error(detail: str, lost: list[int] | None = None) -> LostProcessError:
  """A LostProcessError naming the lost process(es); `lost` None: the other one of two."""
  me, count = jax.process_index(), jax.process_count()
  if lost is None and count == 2:
    lost = [1 - me]
  other = (f'process {", ".join(map(str, lost))}' if lost else 'another process')
  return LostProcessError(f'process {me} of {count} lost contact with {other} of this job '
                          f'({" ".join(detail.split())[:300]}).')
