"""Two local processes as one JAX job (jax.distributed over Gloo), started by
launch/local_multiprocess.py as a cluster would start them: training equals one
process with the same global batch, evaluation writes the same results,
SIGTERM stops both at one agreed step, and a lost process stops the other."""

import io
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

from conftest import REPO_ROOT
from test_reliability import complete_steps, env, wait_for  # pylint: disable=unused-import

LAUNCHER = os.path.join(REPO_ROOT, 'launch', 'local_multiprocess.py')
# ConstPN, a method of the one trainer: what is tested here (the job's collectives, data,
# checkpoints, signals, lost processes) is the same for every method, and process 1 compiles
# every program afresh in each launch (only process 0 writes JAX's persistent cache, and on
# CPU each process's cache key differs), so each launch pays a whole compile: ConstPN's is a
# small fraction of CHT's. CHT's steps on several devices are test_parallel.py's.
TINY = ['--config=configs/omniglot_constpn.py:2,tiny', '--config.train.episodes_per_step=2',
        '--config.train.eval_every_steps=0', '--config.train.log_every_steps=1',
        '--config.train.checkpoint_every_steps=2']


def launch(env, log_path, workdir, data_dir, *flags, num_processes=2):
  """The launcher, its own flags the defaults (or, for one process, main with 2 CPU
  devices) in the background."""
  main_flags = [*TINY, f'--workdir={workdir}', f'--config.data.data_dir={data_dir}', *flags]
  if num_processes == 1:
    argv = [sys.executable, '-m', 'cht_jax.main', *main_flags]
    env = dict(env, XLA_FLAGS=env.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=2')
  else:
    argv = [sys.executable, LAUNCHER, f'--num_processes={num_processes}',
            '--devices_per_process=1', '--', *main_flags]
  log = open(log_path, 'w')
  return subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=log,
                          start_new_session=True)


def finish(process, log_path, timeout=400):
  try:
    process.wait(timeout=timeout)
  finally:  # No process left behind, whatever happened.
    if process.poll() is None:
      os.killpg(process.pid, signal.SIGKILL)
      process.wait()
  with open(log_path) as f:
    return process.returncode, f.read()


def train_rows(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f if '"train"' in line]


def test_two_processes_train_and_evaluate_as_one(tmp_path, prepared_omniglot, env):
  two, one = str(tmp_path / 'two'), str(tmp_path / 'one')
  rc, log = finish(launch(env, f'{two}.log', two, prepared_omniglot,
                          '--config.train.num_steps=4'), f'{two}.log')
  assert rc == 0, log[-3000:]
  rc, log = finish(launch(env, f'{one}.log', one, prepared_omniglot,
                          '--config.train.num_steps=4', num_processes=1), f'{one}.log')
  assert rc == 0, log[-3000:]
  rows2, rows1 = train_rows(two), train_rows(one)
  assert [r['step'] for r in rows2] == [1, 2, 3, 4]  # Process 0 alone writes: once each.
  for key in ('train/loss', 'train/accuracy', 'train/grad_norm', 'train/theta_norm'):
    np.testing.assert_allclose([r[key] for r in rows2], [r[key] for r in rows1], rtol=1e-5,
                               err_msg=key)
  assert complete_steps(two) == complete_steps(one) == [2, 4]
  assert len([f for f in os.listdir(two) if f.startswith('events.out')]) == 1

  # A user error on one process (process 0 alone checks the results folder; here eval/ is
  # a file) ends the job at once in one line: no process waits for it in a collective.
  eval_flags = ('--mode=eval', '--eval_episodes=4', '--eval_query_draws=2',
                '--eval_batch_size=2')
  open(os.path.join(two, 'eval'), 'w').close()
  started = time.time()
  rc, log = finish(launch(env, f'{two}.bad.log', two, prepared_omniglot, *eval_flags),
                   f'{two}.bad.log', timeout=150)
  assert rc == 1 and time.time() - started < 120, log[-3000:]
  assert log.count('ReportError: Cannot write the evaluation results to') == 1, log[-3000:]
  os.remove(os.path.join(two, 'eval'))

  results = {}
  for name, count in (('two', 2), ('one', 1)):
    workdir = str(tmp_path / name)
    rc, log = finish(launch(env, f'{workdir}.eval.log', workdir, prepared_omniglot,
                            *eval_flags, num_processes=count), f'{workdir}.eval.log')
    assert rc == 0, log[-3000:]
    with open(os.path.join(workdir, 'eval', 'test_T2_step4.json')) as f:
      results[name] = json.load(f)
  for setting in ('class_incremental', 'task_incremental'):
    assert results['two']['table'][setting] == results['one']['table'][setting]


def start_then_lose(env, log_path, workdir, data_dir, process_id, after_step):
  """Starts the job again, the launcher's own flags at their defaults, and SIGKILLs process
  `process_id` once two checkpoints past `after_step` are complete. The survivor ends by
  itself before the launcher's grace: from the kill on, the log holds the launcher's line,
  the survivor's one LostProcessError line, and nothing of JAX's abort. (Where process 0 is
  lost, process 1 writes its line itself where a save or a collective broke first, else its
  watcher writes it after JAX's abort, which the launcher leaves out: the test below.)"""
  process = launch(env, log_path, workdir, data_dir, '--config.train.num_steps=100000')
  saved = lambda: len([s for s in complete_steps(workdir) if s > after_step]) >= 2
  assert wait_for(saved, process, timeout=300), finish(process, log_path)[1][-3000:]
  with open(log_path) as f:
    assert f.read().count(f'Resuming from the checkpoint of step {after_step}') == 2
  children = subprocess.run(['pgrep', '-P', str(process.pid), '-f', f'process_id={process_id}'],
                            capture_output=True, text=True).stdout.split()
  assert len(children) == 1
  with open(log_path) as f:  # Before the kill: the launcher may log it at once.
    start = len(f.read())
  killed = time.time()
  os.kill(int(children[0]), signal.SIGKILL)
  rc, log = finish(process, log_path, timeout=240)
  after = log[start:]
  assert rc == 137 and time.time() - killed < 60, log[-3000:]
  assert (f'local_multiprocess: process {process_id} exited with -9 (killed by SIGKILL); '
          'stopping the others within 30 s; exit status 137.') in after, log[-3000:]
  # Not a line of JAX's abort (C++ errors, a stack trace, Python's fault dump), nor a kill.
  for noise in ('.cc:', 'Fatal Python error', 'Traceback', 'did not stop'):
    assert noise not in after, log[-3000:]
  survivor = 1 - process_id
  lost = [l for l in after.splitlines() if l.startswith('LostProcessError')]
  assert len(lost) == 1, after
  assert lost[0].startswith(f'LostProcessError: process {survivor} of 2 lost contact with '
                            f'process {process_id} of this job ('), lost[0]
  assert lost[0].endswith(
      f'Stopping; the complete checkpoints in {workdir}/checkpoints are kept: restart all 2 '
      'processes with the same command to resume from the latest.'), lost[0]


def test_sigterm_then_a_lost_process_then_resume(tmp_path, prepared_omniglot, env):
  """One job through four lives: SIGTERM stops both processes at one agreed step; the
  resumed job loses process 1 to SIGKILL and process 0 stops by itself, naming it; then it
  loses process 0, the coordinator, and process 1's end is its one line naming it (JAX's
  abort in C++ left out by the launcher); the job restarted once more resumes from the
  latest complete checkpoint, nothing lost. All with the launcher's default flags."""
  workdir, log_path = str(tmp_path / 'work'), str(tmp_path / 'work.log')
  process = launch(env, log_path, workdir, prepared_omniglot, '--config.train.num_steps=100000')
  logged = lambda: os.path.exists(os.path.join(workdir, 'metrics.jsonl')) and len(
      train_rows(workdir)) >= 3
  assert wait_for(logged, process, timeout=300), finish(process, log_path)[1][-3000:]
  process.send_signal(signal.SIGTERM)  # The launcher forwards it to both.
  rc, log = finish(process, log_path)
  assert rc == 143, log[-3000:]
  lines = [l for l in log.splitlines() if l.startswith('Preempted: Stopped by SIGTERM after step')]
  assert len(lines) == 2 and lines[0] == lines[1], log[-3000:]  # The same step in both.
  step = int(lines[0].split('after step ')[1].split(',')[0])
  assert complete_steps(workdir)[-1] == step

  start_then_lose(env, log_path, workdir, prepared_omniglot, 1, step)
  steps = complete_steps(workdir)
  assert steps  # The complete checkpoints are intact: Orbax lists them as finalised.
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  manager = ocp.CheckpointManager(os.path.join(workdir, 'checkpoints'),
                                  options=ocp.CheckpointManagerOptions(read_only=True))
  assert manager.latest_step() == steps[-1]
  manager.close()

  start_then_lose(env, log_path, workdir, prepared_omniglot, 0, steps[-1])
  steps = complete_steps(workdir)
  # Both gone now: restarted, both resume from the latest complete checkpoint.
  rc, log = finish(launch(env, log_path, workdir, prepared_omniglot,
                          f'--config.train.num_steps={steps[-1] + 2}'), log_path)
  assert rc == 0, log[-3000:]
  assert log.count(f'Resuming from the checkpoint of step {steps[-1]}') == 2
  assert 'LostProcessError' not in log  # A normal end: the watcher outside stays silent.
  assert [r['step'] for r in train_rows(workdir)] == list(range(1, steps[-1] + 3))


# JAX's abort of process 1 when process 0 is gone (cut short), and the line of its watcher.
ABORT = """W1205 11:21:33.070032   11421 preemption_sync_manager.cc:147] Failed to retrieve preemption notice from coordination service: UNAVAILABLE: Socket closed
Additional GRPC error information from remote target coordination_service while calling /xla.coordination.CoordinationService/GetKeyValue:
E1205 11:21:33.070137   11421 coordination_service_agent.cc:289] Polled an error from coordination service (this can be an error from this or another task).
F1205 11:21:33.070143   11421 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died
*** Check failure stack trace: ***
    @     0x7f473a1040ee  xla::CoordinationServiceAgent::SetError()
Fatal Python error: Aborted

Thread 0x00007f474623db80 (most recent call first):
  File "/work/cht_jax/train.py", line 10 in train_and_evaluate
Extension modules: jaxlib.cpu_feature_guard, numpy._core._multiarray_umath (total: 2)
"""
LOST = ('LostProcessError: process 1 of 2 lost contact with process 0 of this job (the '
        'coordinator is unreachable). Stopping; ...\n')


def test_the_launcher_outwaits_the_heartbeat_and_shows_a_lost_process_in_one_line():
  """The cheap half of the test above: the heartbeat the launcher gives its processes
  unless told (with it, the test above sees their line before the launcher's grace ends),
  and its copy of their stderr, JAX's abort left out where the process's line follows."""
  sys.path.insert(0, os.path.dirname(LAUNCHER))
  try:
    import local_multiprocess  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.pop(0)
  heartbeat = local_multiprocess.heartbeat_seconds
  assert heartbeat(['--config=c.py']) == local_multiprocess.HEARTBEAT_SECONDS == 10
  assert heartbeat(['--heartbeat_timeout_seconds=40', '--heartbeat_timeout_seconds', '50']) == 50
  assert '--heartbeat_timeout_seconds=10' in local_multiprocess.commands(2, 1234, [])[1]

  def copy(lines, times=(0.0,) * 99):
    out = io.StringIO()
    local_multiprocess.copy_stderr(lines, out, clock=iter(times).__next__)
    return out.getvalue()

  step = 'I1205 11:21:32.760966 1399440 train.py:172] step 3\n'
  abort = ABORT.splitlines(keepends=True)
  assert copy([step, *abort, None, '\n', LOST]) == step + LOST
  assert copy([step, *abort]) == step + ABORT  # Without the line that replaces it: all of it.
  warning = ABORT.split('E1205')[0]  # C++ errors that no abort follows within a second.
  assert copy([*warning.splitlines(keepends=True), step], [0.0, 0.5, 2.0]) == warning + step
  assert copy([warning, None, step], [0.0, 1.5]) == warning + step
  read, write = os.pipe()  # The lines of a process's stderr, as they come.
  os.write(write, b'a\nb')
  os.close(write)
  assert list(local_multiprocess.read_lines(read)) == ['a\n', 'b']
  os.close(read)


STUB = '''#!/bin/bash
# Records what each of $SLURM_NTASKS tasks would run, with its environment.
for ((i = 0; i < ${SLURM_NTASKS:-1}; i++)); do
  echo "$(basename "$0") task=$i SLURM_PROCID=$i SLURM_NTASKS=$SLURM_NTASKS cwd=$PWD args=$*" >> "$RECORD"
done
'''


def test_slurm_and_tpu_launchers_start_the_same_command(tmp_path):
  stubs = tmp_path / 'bin'
  stubs.mkdir()
  for name in ('srun', 'gcloud'):
    (stubs / name).write_text(STUB)
    (stubs / name).chmod(0o755)
  record = tmp_path / 'record.txt'
  env = dict(os.environ, PATH=f'{stubs}:{os.environ["PATH"]}', RECORD=str(record),
             SLURM_SUBMIT_DIR=str(REPO_ROOT), SLURM_NTASKS='2')
  subprocess.run(['bash', os.path.join(REPO_ROOT, 'launch', 'slurm.sbatch'),
                  'configs/omniglot_t5.py', '/shared/t5', '--config.train.episodes_per_step=128'],
                 env=env, check=True, timeout=60)
  subprocess.run(['bash', os.path.join(REPO_ROOT, 'launch', 'tpu_vm.sh'), 'my-tpu', 'zone-b',
                  'configs/omniglot_t5.py', 'gs://b/t5', '--config.train.episodes_per_step=256'],
                 env=dict(env, SLURM_NTASKS='1'), check=True, timeout=60)
  lines = record.read_text().splitlines()
  main = ('python -m cht_jax.main --config=configs/omniglot_t5.py --workdir=/shared/t5 '
          '--distributed --config.train.episodes_per_step=128')
  assert lines[:2] == [f'srun task={i} SLURM_PROCID={i} SLURM_NTASKS=2 cwd={REPO_ROOT} '
                       f'args=--kill-on-bad-exit=1 {main}' for i in range(2)]
  tpu = ' '.join(record.read_text().split('gcloud task=0', 1)[1].split())  # One line.
  assert '--worker=all' in tpu
  assert ('python -m cht_jax.main --config=configs/omniglot_t5.py --workdir=gs://b/t5 '
          '--distributed --config.train.episodes_per_step=256') in tpu
