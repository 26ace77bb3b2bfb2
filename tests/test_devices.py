"""CPU cores as JAX devices, and how many devices a batch is split over."""

import json
import os
import socket
import subprocess
import sys

from conftest import REPO_ROOT

_PROBE = '''
import json, sys
from cht_jax.runtime import devices
set_count = devices.use_cpu_cores()
import jax
print(json.dumps({
    'set': set_count, 'cores': devices.cpu_cores(), 'devices': jax.device_count(),
    'split': {b: devices.num_data_devices(int(b)) for b in sys.argv[1:]},
    'mesh': {b: devices.data_mesh(int(b)).shape['data'] for b in sys.argv[1:]}}))
'''


def _last_line(code: str, *args: str, env: dict | None = None) -> str:
  """Runs `code` in a fresh Python (its own JAX backend); the last line it prints."""
  out = subprocess.run([sys.executable, '-c', code, *args], env=env, cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout.strip().splitlines()[-1]


def _probe(xla_flags: str | None, *batch_sizes: int) -> dict:
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  if xla_flags:
    env['XLA_FLAGS'] = xla_flags
  env['JAX_PLATFORMS'] = 'cpu'
  return json.loads(_last_line(_PROBE, *map(str, batch_sizes), env=env))


def test_each_core_becomes_a_device():
  result = _probe(None, 1)
  assert result['set'] and result['devices'] == result['cores']


def test_an_explicit_device_count_wins_and_the_batch_takes_the_devices_that_divide_it():
  result = _probe('--xla_force_host_platform_device_count=4', 1, 2, 6, 8, 7)
  assert result['set'] is False and result['devices'] == 4
  expected = {'1': 1, '2': 2, '6': 3, '8': 4, '7': 1}
  assert result['split'] == expected
  assert result['mesh'] == expected


def test_importing_the_entry_points_starts_no_backend():
  # main sets the CPU device count and may call jax.distributed.initialize():
  # both need a backend that has not started, so no import may create an array.
  for module in ('cht_jax.main', 'cht_jax.tools.bench'):
    code = (f'import {module}\n'
            'from jax._src import xla_bridge\n'
            'print(xla_bridge.backends_are_initialized())')
    assert _last_line(code) == 'False', module


def test_the_watcher_outside_a_process_speaks_only_where_it_must():
  """Where its process ends without `stand_down` ('done') and the coordinator's port does
  not answer, the watcher writes the process's last line; else it stays silent."""
  from cht_jax.runtime import devices  # pylint: disable=g-import-not-at-top
  line = 'LostProcessError: process 1 of 2 lost contact with process 0 of this job (...).'

  def watcher_says(port, ending):
    watcher = subprocess.Popen([sys.executable, '-I', '-c', devices._OUTSIDE_WATCH, '127.0.0.1',
                                str(port), line], stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    return watcher.communicate(ending, timeout=60)[1]  # Then stdin closes, as at an exit.

  with socket.socket() as coordinator:
    coordinator.bind(('127.0.0.1', 0))
    coordinator.listen()
    port = coordinator.getsockname()[1]
    assert watcher_says(port, '') == ''  # The coordinator answers: another cause.
  assert watcher_says(port, '') == f'\n{line}\n'  # Gone (its port closed) and no word.
  assert watcher_says(port, 'done') == ''  # The process said its own last line.
