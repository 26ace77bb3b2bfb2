"""Two local processes as one JAX job (jax.distributed over Gloo), started by
launch/local_multiprocess.py as a cluster would start them: training equals one
process with the same global batch, evaluation writes the same results,
SIGTERM stops both at one agreed step, and a lost process stops the other."""

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


def launch(env, log_path, workdir, data_dir, *flags, num_processes=2, grace_seconds=60):
  """The launcher (or, for one process, main with 2 CPU devices) in the background."""
  main_flags = [*TINY, f'--workdir={workdir}', f'--config.data.data_dir={data_dir}', *flags]
  if num_processes == 1:
    argv = [sys.executable, '-m', 'cht_jax.main', *main_flags]
    env = dict(env, XLA_FLAGS=env.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=2')
  else:
    argv = [sys.executable, LAUNCHER, f'--num_processes={num_processes}',
            '--devices_per_process=1', f'--grace_seconds={grace_seconds}', '--', *main_flags]
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
  rc, log = finish(launch(env, f'{two}.bad.log', two, prepared_omniglot, *eval_flags,
                          '--heartbeat_timeout_seconds=10'), f'{two}.bad.log', timeout=150)
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
  """Starts the job again and SIGKILLs process `process_id` once two checkpoints past
  `after_step` are complete; the launcher would stop the survivor after 300 s, so it must
  stop by itself before. Returns the launcher's (exit status, log)."""
  process = launch(env, log_path, workdir, data_dir, '--config.train.num_steps=100000',
                   '--heartbeat_timeout_seconds=10', grace_seconds=300)
  saved = lambda: len([s for s in complete_steps(workdir) if s > after_step]) >= 2
  assert wait_for(saved, process, timeout=300), finish(process, log_path)[1][-3000:]
  with open(log_path) as f:
    assert f.read().count(f'Resuming from the checkpoint of step {after_step}') == 2
  children = subprocess.run(['pgrep', '-P', str(process.pid), '-f', f'process_id={process_id}'],
                            capture_output=True, text=True).stdout.split()
  assert len(children) == 1
  os.kill(int(children[0]), signal.SIGKILL)
  killed = time.time()
  rc, log = finish(process, log_path, timeout=240)
  assert time.time() - killed < 60 and rc != 0, log[-3000:]
  assert f'local_multiprocess: process {process_id} exited with -9' in log
  return rc, log


def test_sigterm_then_a_lost_process_then_resume(tmp_path, prepared_omniglot, env):
  """One job through four lives: SIGTERM stops both processes at one agreed step; the
  resumed job loses process 1 to SIGKILL and process 0 stops by itself, naming it; then it
  loses process 0, the coordinator, and process 1 names it; the job restarted once more
  resumes from the latest complete checkpoint, nothing lost."""
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

  rc, log = start_then_lose(env, log_path, workdir, prepared_omniglot, 1, step)
  # Process 0 names the lost one: our line where a collective broke, JAX's where it
  # waited elsewhere (a checkpoint's barrier) until the heartbeat timeout.
  ours = [l for l in log.splitlines() if l.startswith('LostProcessError')]
  assert (ours and ours[0].startswith('LostProcessError: process 0 of 2 lost contact with '
                                      'process 1')) or (
      'stopped sending heartbeats):\n1\n' in log), log[-3000:]
  steps = complete_steps(workdir)
  assert steps  # The complete checkpoints are intact: Orbax lists them as finalised.
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  manager = ocp.CheckpointManager(os.path.join(workdir, 'checkpoints'),
                                  options=ocp.CheckpointManagerOptions(read_only=True))
  assert manager.latest_step() == steps[-1]
  manager.close()

  # The coordinator lost: process 1 says so itself where a save or collective broke first;
  # where JAX aborts it in C++, its watcher outside says it.
  start_then_lose(env, log_path, workdir, prepared_omniglot, 0, steps[-1])
  line = '\nLostProcessError: process 1 of 2 lost contact with process 0 of this job ('
  deadline = time.time() + 20  # The watcher writes once process 1 has ended.
  while line not in open(log_path).read() and time.time() < deadline:
    time.sleep(0.1)
  log = open(log_path).read()
  assert log.count(line) == 1, log[-3000:]
  assert 'restart all 2 processes with the same command to resume' in log.split(line)[1]
  steps = complete_steps(workdir)
  # Both gone now: restarted, both resume from the latest complete checkpoint.
  rc, log = finish(launch(env, log_path, workdir, prepared_omniglot,
                          f'--config.train.num_steps={steps[-1] + 2}'), log_path)
  assert rc == 0, log[-3000:]
  assert log.count(f'Resuming from the checkpoint of step {steps[-1]}') == 2
  assert 'LostProcessError' not in log  # A normal end: the watcher outside stays silent.
  assert [r['step'] for r in train_rows(workdir)] == list(range(1, steps[-1] + 3))


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
