r"""Runs `python -m cht_jax.main` as N processes of one JAX job on this machine.

  python launch/local_multiprocess.py --num_processes=2 -- \
      --config=configs/omniglot_t2.py:tiny --config.train.episodes_per_step=2 \
      --workdir=/tmp/two_processes

The same command in every process, as a cluster starts them (cf. launch/slurm.sbatch), with
--distributed, a coordinator on 127.0.0.1 and each its --process_id; Gloo CPU collectives,
--devices_per_process CPU devices each (default: the cores split evenly). SIGTERM and SIGINT
are forwarded; the first process to fail stops the others (after --grace_seconds), and its
exit status (128 + N when killed by signal N) is this launcher's.
"""

import argparse
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
  """A port nothing listens on now (the OS picks it; the coordinator binds it soon after)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def commands(num_processes: int, port: int, main_flags: list[str]) -> list[list[str]]:
  return [[sys.executable, '-m', 'cht_jax.main', *main_flags, '--distributed',
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


def run(num_processes: int, main_flags: list[str], devices_per_process: int,
        grace_seconds: float = 30.0, poll_seconds: float = 0.2) -> int:
  """Starts the processes, waits for them; the first failure's exit status, else 0."""
  env = environment(devices_per_process)
  processes = [subprocess.Popen(c, env=env) for c in commands(num_processes, free_port(),
                                                                main_flags)]

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
        for p in processes:
          if p.poll() is None:
            p.kill()
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
  parser.add_argument('--grace_seconds', type=float, default=30.0)
  parser.add_argument('main_flags', nargs=argparse.REMAINDER,
                      help='-- then the flags of python -m cht_jax.main')
  args = parser.parse_args(argv)
  flags = args.main_flags[1:] if args.main_flags[:1] == ['--'] else args.main_flags
  per_process = args.devices_per_process or max(1, (os.cpu_count() or 1) // args.num_processes)
  return run(args.num_processes, flags, per_process, args.grace_seconds)


if __name__ == '__main__':
  sys.exit(main())
