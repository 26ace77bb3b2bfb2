"""Cluster habits (issue 21): double submission, Ctrl-C, group-readable files, config
paths, no --workdir, failed starts; each through the real CLI in a subprocess."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

from cht_jax import config_validation
from cht_jax.runtime import preemption
from cht_jax.runtime import workdir as workdir_lib
from conftest import REPO_ROOT, tiny_config
from test_reliability import complete_steps, env, error_line, finish, run, start  # pylint: disable=unused-import
from test_reliability import trained_steps, wait_for

STEPS = ('--config.train.checkpoint_every_steps=4', '--config.train.log_every_steps=1')


def rows(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def test_a_second_run_on_a_workdir_in_use_stops_at_once_and_ctrl_c_checkpoints(
    tmp_path, prepared_omniglot, env):
  """One run serves both: a second start on its workdir is refused while it trains, then
  Ctrl-C checkpoints the step it is at, and the lock goes with it."""
  workdir = str(tmp_path / 'work')
  # No save step before the signal, wherever it lands: the one checkpoint is the stop's. The
  # schedule is far longer than the test waits (a few hundred steps a second): on a loaded
  # machine this process may not run for a second, and a 400-step run finished before the
  # signal came.
  no_saves = ('--config.train.checkpoint_every_steps=1000000',
              '--config.train.log_every_steps=1')
  first = start(env, workdir, prepared_omniglot, *no_saves, '--config.train.num_steps=1000000')
  lock = os.path.join(workdir, workdir_lib.LOCK_NAME)
  assert wait_for(lambda: os.path.exists(lock), first), finish(first, workdir)[1][-3000:]
  began = time.time()
  rc, log = run(env, str(tmp_path / 'work'), prepared_omniglot, *no_saves,
                '--config.train.num_steps=12')
  assert rc == 1 and time.time() - began < 60
  line = error_line(log, 'WorkdirError')
  assert line.startswith(f'WorkdirError: {workdir} is in use by another training run (host ')
  assert f'process {first.pid}, started ' in line and 'use another --workdir' in line

  assert wait_for(lambda: len(trained_steps(workdir)) >= 5, first), finish(
      first, workdir)[1][-3000:]
  first.send_signal(signal.SIGINT)
  rc, log = finish(first, workdir)
  assert rc == preemption.INTERRUPTED_EXIT_CODE == 130, log[-3000:]
  assert 'Traceback' not in log and 'KeyboardInterrupt' not in log
  line = error_line(log, 'Interrupted')
  assert line.startswith('Interrupted: Stopped by SIGINT after step ')
  step = int(line.split('after step ')[1].split(',')[0])
  assert complete_steps(workdir) == [step]  # Saved although not a save step.
  steps = [r['step'] for r in rows(workdir) if r['split'] == 'train']
  assert steps == list(range(1, step + 1))  # Nothing twice, nothing lost.
  assert not os.path.exists(lock)


def test_no_workdir_config_path_dead_lock_and_umask(tmp_path, prepared_omniglot, env):
  """One short run through the CLI as a cluster job would start it: the config by absolute
  path from another directory, no --workdir, a lock left by a dead run in the workdir it
  picks, and umask 022 (files group- and world-readable)."""
  config = os.path.join(REPO_ROOT, 'configs', 'omniglot_t2.py')
  workdir = str(tmp_path / 'workdirs' / 'omniglot_t2_tiny')
  os.makedirs(workdir)
  dead = subprocess.Popen(['true'])
  dead.wait()
  with open(os.path.join(workdir, workdir_lib.LOCK_NAME), 'w') as f:
    json.dump({'host': os.uname().nodename, 'pid': dead.pid, 'started_at': 'earlier'}, f)
  argv = [sys.executable, '-m', 'cht_jax.main', f'--config={config}:tiny',
          f'--config.data.data_dir={prepared_omniglot}', '--config.train.num_steps=2',
          '--config.train.eval_every_steps=0']
  # Through a shell: preexec_fn would fork this multithreaded (JAX) process.
  result = subprocess.run(['/bin/sh', '-c', 'umask 022 && exec "$@"', 'sh', *argv],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert f'No --workdir given: using {workdir}' in result.stderr
  assert complete_steps(workdir) == [2]
  assert f'Taking over the lock of a dead run (process {dead.pid} is gone)' in result.stderr
  assert not os.path.exists(os.path.join(workdir, workdir_lib.LOCK_NAME))
  # Orbax's INFO chatter is off: the log's INFO lines are ours, TFDS's and JAX's.
  assert 'checkpoint_manager.py' not in result.stderr
  assert 'async_checkpointer' not in result.stderr

  for name in ('config.json', 'metrics.jsonl'):
    assert os.stat(os.path.join(workdir, name)).st_mode & 0o777 == 0o644, name
  saved = [p for p in glob.glob(os.path.join(workdir, 'checkpoints', '**'), recursive=True)
           if os.path.isfile(p)]
  assert saved and all(os.stat(p).st_mode & 0o044 == 0o044 for p in saved)  # Group, others read.
  # A resume that drops rows rewrites metrics.jsonl: still the umask's mode.
  old = os.umask(0o022)
  try:
    log = workdir_lib.MetricsLog(workdir)
    log.drop_after(1)
    log.close()
  finally:
    os.umask(old)
  assert os.stat(os.path.join(workdir, 'metrics.jsonl')).st_mode & 0o777 == 0o644


def test_a_failed_start_reports_evaluation_needs_and_leaves_no_folders(tmp_path, env):
  """What keeps the evaluation from running is said at the start, before data is read;
  a start that then fails (no archives) leaves no folders behind."""
  empty = tmp_path / 'no_archives'
  empty.mkdir()
  workdir = tmp_path / 'new' / 'work'
  # 3 ways x 150 tasks > 423 test classes: training could run, the evaluation could not.
  rc, log = run(env, str(workdir), str(tmp_path / 'tfds'),
                f'--config.data.manual_dir={empty}', '--config.episode.num_tasks=150')
  assert rc == 1 and error_line(log, 'DataError')
  assert not (tmp_path / 'new').exists()
  assert ('The evaluation protocol cannot run on this config as it is: episode.ways * '
          "episode.num_tasks = 3 * 150 = 450 distinct classes per episode") in log
  # A warning, not an error: the config is valid for training.
  config_validation.validate(tiny_config(**{'episode.num_tasks': 150}))


def test_orbax_info_and_tracebacks_are_filtered_unless_verbose():
  import logging  # pylint: disable=g-import-not-at-top
  from cht_jax.runtime import checkpoints  # pylint: disable=g-import-not-at-top
  quiet = checkpoints._QuietOrbax()  # pylint: disable=protected-access
  record = lambda path, level, exc=None: logging.LogRecord('absl', level, path, 1, 'm', (), exc)
  orbax = os.path.join(os.sep, 'site-packages', 'orbax', 'checkpoint', 'checkpoint_manager.py')
  assert not quiet.filter(record(orbax, logging.INFO))
  error = record(orbax, logging.ERROR, (ValueError, ValueError('x'), None))
  assert quiet.filter(error) and error.exc_info is None  # The line, not its traceback.
  ours = record(os.path.join(os.sep, 'cht_jax', 'train.py'), logging.INFO)
  assert quiet.filter(ours)


def tensorboard_points(workdir):
  """(tag, step) of every scalar in the workdir's event files."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  points = []
  for path in glob.glob(os.path.join(workdir, 'events.out.tfevents.*')):
    for event in tf.compat.v1.train.summary_iterator(path):
      points += [(value.tag, event.step) for value in event.summary.value]
  return points


def test_a_resume_leaves_tensorboard_with_each_step_once(tmp_path):
  workdir = str(tmp_path)
  log = workdir_lib.MetricsLog(workdir)  # A run that logged steps 1..8, killed after 4's save.
  for step in range(1, 9):
    log.write(step, 'train', {'loss': float(step)})
  log.close()
  log = workdir_lib.MetricsLog(workdir)  # The resumed run logs 5..8 again.
  log.drop_after(4)
  for step in range(5, 9):
    log.write(step, 'train', {'loss': 10.0 + step})
  log.close()
  points = tensorboard_points(workdir)
  assert sorted(points) == [('train/loss', s) for s in range(1, 9)]
  assert [r['train/loss'] for r in rows(workdir)] == [1, 2, 3, 4, 15, 16, 17, 18]
