r"""Runs `python -m cht_jax.main` as N processes of one JAX job on this machine.

  python launch/local_multiprocess.py --num_processes=2 -- \
      --config=configs/omniglot_t2.py:tiny --config.train.episodes_per_step=2 \
      --workdir=/tmp/two_processes

The same command in every process, as a cluster starts them (cf. launch/slurm.sbatch), with
--distributed, a coordinator on 127.0.0.1 and each its --process_id; Gloo CPU collectives,
--devices_per_process CPU devices each (default: the cores split evenly). SIGTERM and SIGINT
are forwarded; the first process to fail stops the others, and its exit status (128 + N when
killed by signal N) is this launcher's. A process that loses another ends by itself within
--heartbeat_timeout_seconds (10 s unless the flags after -- set it) with one LostProcessError
line; the launcher kills whatever still runs 20 s later (--grace_seconds). Their stderr is
copied to the launcher's, except JAX's abort of a process that lost process 0: its one line.
"""

import argparse
import os
import queue
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Iterable, Iterator, TextIO


# On one machine a process is lost only when it dies: the others may learn it soon. A process
# waiting in a barrier learns it only from the heartbeat (main's default, 100 s, is a cluster's).
HEARTBEAT_SECONDS = 10
# After the heartbeat, for a process that learnt of the loss to write its line and exit.
MARGIN_SECONDS = 20
# Where process 0, the coordinator, is lost, JAX's client aborts the others in C++: errors,
# this fatal one, a C++ stack trace, Python's fault dump. The line that matters comes after,
# from the process's watcher (cht_jax/runtime/devices.py).
_ABORT = 'Terminating process because the JAX distributed service detected fatal errors'
_CPP_LOG = re.compile(r'[WEF]\d{4} [\d:.]+ +\d+ \w+\.cc:\d+\] ')  # A C++ warning or error.
_HOLD_SECONDS = 1.0  # The abort's lines come within milliseconds of its first error.
_LAST_LINE = 'LostProcessError: '


def free_port() -> int:
  """A port nothing listens on now (the OS picks it; the coordinator binds it soon after)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def heartbeat_seconds(main_flags: list[str]) -> int:
  """The --heartbeat_timeout_seconds the flags for main give (the last), else HEARTBEAT_SECONDS."""
  parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
  parser.add_argument('--heartbeat_timeout_seconds', type=int, default=HEARTBEAT_SECONDS)
  return parser.parse_known_args(main_flags)[0].heartbeat_timeout_seconds


def commands(num_processes: int, port: int, main_flags: list[str]) -> list[list[str]]:
  return [[sys.executable, '-m', 'cht_jax.main', *main_flags, '--distributed',
           f'--heartbeat_timeout_seconds={heartbeat_seconds(main_flags)}',
           f'--coordinator_address=127.0.0.1:{port}', f'--num_processes={num_processes}',
           f'--process_id={i}'] for i in range(num_processes)]


def environment(devices_per_process: int) -> dict[str, str]:
  flags = os.environ.get('XLA_FLAGS', '')
  if '--xla_force_host_platform_device_count' not in flags:
    flags += f' --xla_force_host_platform_device_count={devices_per_process}'
  return dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS='cpu',
              JAX_CPU_COLLECTIVES_IMPLEMENTATION='gloo')


def shell_status(returncode: int) -> int:
  """Popen's -N (killed by signal N) as a shell reports it, 128 + N (not sys.exit's 247)."""
  return 128 - returncode if returncode < 0 else returncode


def describe(returncode: int) -> str:
  """'-9 (killed by SIGKILL)', or the status itself."""
  if returncode >= 0:
    return str(returncode)
  try:
    return f'{returncode} (killed by {signal.Signals(-returncode).name})'
  except ValueError:
    return f'{returncode} (killed by signal {-returncode})'


def read_lines(fd: int) -> Iterator[str | None]:
  """The lines of `fd` as they come, and None after each _HOLD_SECONDS without any."""
  rest = b''
  while True:
    if not select.select([fd], [], [], _HOLD_SECONDS)[0]:
      yield None
      continue
    chunk = os.read(fd, 1 << 16)
    if not chunk:
      break
    *lines, rest = (rest + chunk).split(b'\n')
    yield from (line.decode(errors='replace') + '\n' for line in lines)
  if rest:
    yield rest.decode(errors='replace')


def copy_stderr(lines: Iterable[str | None], out: TextIO, clock=time.monotonic) -> None:
  """Copies a process's stderr `lines` to `out`, except JAX's abort for a lost coordinator
  where the process's LostProcessError line follows it: that line alone."""
  held, since = [], 0.0  # From a C++ error on, for a moment: the abort's start, or not.
  for line in lines:
    aborting = any(_ABORT in h for h in held)
    if held and not aborting and clock() - since >= _HOLD_SECONDS:
      out.writelines(held)  # No abort followed.
      held = []
    if line is None:  # A quiet moment.
      pass
    elif aborting and line.startswith(_LAST_LINE):
      held = []
      out.write(line)
    elif held or _ABORT in line or _CPP_LOG.match(line):
      since = since if held else clock()
      held.append(line)
    else:
      out.write(line)
    out.flush()
  out.writelines(held)  # An abort without the line: all of it.
  out.flush()


def run(num_processes: int, main_flags: list[str], devices_per_process: int,
        grace_seconds: float | None = None, poll_seconds: float = 0.2) -> int:
  """Starts the processes, waits for them; the first failure's exit status, else 0. The
  others are killed `grace_seconds` after it (default: the heartbeat timeout + a margin)."""
  env = environment(devices_per_process)
  grace_seconds = grace_seconds or heartbeat_seconds(main_flags) + MARGIN_SECONDS
  processes = [subprocess.Popen(c, env=env, stderr=subprocess.PIPE)
               for c in commands(num_processes, free_port(), main_flags)]
  # Read to their end, when the process and its watcher (devices.py) are gone.
  copies = [threading.Thread(target=copy_stderr, args=(read_lines(p.stderr.fileno()), sys.stderr),
                             daemon=True) for p in processes]
  for copy in copies:
    copy.start()

  def forward(signum, frame):
    del frame
    for p in processes:
      if p.poll() is None:
        p.send_signal(signum)

  previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
  # (index, status) in the order the processes end: where a peer's loss ends the others
  # within one poll, the first to end is still the one named.
  exits = queue.Queue()
  for index, process in enumerate(processes):
    threading.Thread(target=lambda i=index, p=process: exits.put((i, p.wait())),
                     daemon=True).start()
  try:
    failure, deadline, running = None, None, len(processes)
    while running:
      try:
        index, returncode = exits.get(timeout=poll_seconds)
        running -= 1
        if failure is None and returncode != 0:
          failure, deadline = shell_status(returncode), time.time() + grace_seconds
          print(f'local_multiprocess: process {index} exited with {describe(returncode)}; '
                f'stopping the others within {grace_seconds:.0f} s; exit status {failure}.',
                file=sys.stderr, flush=True)
      except queue.Empty:
        pass
      if deadline is not None and time.time() > deadline:
        for index, p in enumerate(processes):
          if p.poll() is None:
            print(f'local_multiprocess: process {index} did not stop within '
                  f'{grace_seconds:.0f} s; killing it.', file=sys.stderr, flush=True)
            p.kill()
        deadline = None
    for copy in copies:  # A process's watcher answers within seconds of its end.
      copy.join(timeout=MARGIN_SECONDS)
    return failure or 0
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
    for p in processes:  # Never leave one behind.
      if p.poll() is None:
        p.kill()
        p.wait()


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--num_processes', type=int, default=2)
  parser.add_argument('--devices_per_process', type=int, default=None)
  parser.add_argument('--grace_seconds', type=float, default=None,
                      help='How long the others may take to stop once one failed (default: '
                      'their --heartbeat_timeout_seconds + 20 s).')
  parser.add_argument('main_flags', nargs=argparse.REMAINDER,
                      help='-- then the flags of python -m cht_jax.main')
  args = parser.parse_args(argv)
  flags = args.main_flags[1:] if args.main_flags[:1] == ['--'] else args.main_flags
  per_process = args.devices_per_process or max(1, (os.cpu_count() or 1) // args.num_processes)
  return run(args.num_processes, flags, per_process, args.grace_seconds)


if __name__ == '__main__':
  sys.exit(main())
