"""Reliability (issue 7): kills, preemption, divergence and bad environments lose nothing.

The end-to-end tests run `python -m cht_jax.main` in subprocesses on real
Omniglot with the tiny config; they share a JAX compilation cache, so only
the first process of a given program compiles it. What they test is the one trainer's
(checkpoints, signals, the divergence guard), the same for every method: they train
ConstPN, whose step compiles and traces in a fraction of CHT's (every process traces
its programs anew; the cache keeps only the compiled ones). CHT's own step through
`main` is tests/test_main.py's.
"""

import glob
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

from conftest import REPO_ROOT, class_images, override, tiny_config
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from cht_jax import methods
from cht_jax import optim
from cht_jax import train
from cht_jax.data import omniglot
from cht_jax.runtime import checkpoints
from cht_jax.runtime import devices
from cht_jax.runtime import divergence
from cht_jax.runtime import preemption
from cht_jax.runtime import workdir as workdir_lib

TINY = ['--config=configs/omniglot_constpn.py:2,tiny', '--config.train.eval_every_steps=0']
TMP = '*.orbax-checkpoint-tmp*'


# 40 steps, a checkpoint every 4, the last 2 kept, every step's metrics logged.
OVERRIDES = ('--config.train.checkpoint_every_steps=4', '--config.train.log_every_steps=1',
             '--config.train.keep_checkpoints=2')


def constpn_config(**overrides):
  """TINY's config, as main builds it, with dotted overrides."""
  from configs import omniglot_constpn  # pylint: disable=g-import-not-at-top
  return override(omniglot_constpn.get_config('2,tiny'), overrides)


@pytest.fixture(scope='module')
def env():
  """Environment of the subprocesses: conftest's compilation cache, shared by all."""
  return dict(os.environ)


@pytest.fixture(scope='module')
def reference(tmp_path_factory, prepared_omniglot, env):
  """The workdir of an uninterrupted run of 40 steps (read only: copy it to change it)."""
  workdir = str(tmp_path_factory.mktemp('reference') / 'work')
  rc, log = run(env, workdir, prepared_omniglot, *OVERRIDES, '--config.train.num_steps=40')
  assert rc == 0, log[-3000:]
  assert complete_steps(workdir) == [36, 40]
  return workdir


def copy_of(workdir, tmp_path):
  copy = str(tmp_path / 'work')
  shutil.copytree(workdir, copy)
  return copy


def command(workdir, data_dir, *overrides):
  return [sys.executable, '-m', 'cht_jax.main', *TINY, f'--workdir={workdir}',
          f'--config.data.data_dir={data_dir}', *overrides]


def start(env, workdir, data_dir, *overrides):
  """Starts main; its stderr goes to `<workdir>.log`, to be watched."""
  with open(f'{workdir}.log', 'w') as log:
    return subprocess.Popen(command(workdir, data_dir, *overrides), cwd=REPO_ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=log)


def finish(process, workdir, timeout=300):
  process.wait(timeout=timeout)
  with open(f'{workdir}.log') as f:
    return process.returncode, f.read()


# Sets a limit on the size of written files, then becomes `python -m cht_jax.main ...`.
LIMITED = ('import os, resource, sys; '
           'resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]),) * 2); '
           'os.execv(sys.executable, [sys.executable] + sys.argv[2:])')


def run(env, workdir, data_dir, *overrides, limit_file_size=None):
  """Runs main to its end: (exit status, stderr)."""
  argv = command(workdir, data_dir, *overrides)
  if limit_file_size:  # Writes past this size fail (EFBIG), as on a full disk.
    argv = [sys.executable, '-c', LIMITED, str(limit_file_size)] + argv[1:]
  result = subprocess.run(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=300)
  return result.returncode, result.stderr


def complete_steps(workdir):
  folder = os.path.join(workdir, 'checkpoints')
  return sorted(int(d) for d in os.listdir(folder) if d.isdigit()) if os.path.isdir(folder) else []


def partial_saves(workdir):
  return glob.glob(os.path.join(workdir, 'checkpoints', TMP))


def metrics(workdir, drop=('steps_per_sec', 'episodes_per_sec')):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  return [{k: v for k, v in row.items() if not k.endswith(drop)} for row in rows]


def trained_steps(workdir):
  """Steps the latest start has trained (its 'step N/M: loss' log lines)."""
  with open(f'{workdir}.log') as f:
    return [int(s) for s in re.findall(r'step (\d+)/\d+: loss', f.read())]


def error_line(log, name):
  # From the name on: a line of its own, unless another thread's output got in front.
  lines = [line[line.index(f'{name}: '):] for line in log.splitlines() if f'{name}: ' in line]
  # Not found: show the first traceback or error, not the shutdown noise after it.
  first = next((i for i, line in enumerate(log.splitlines())
                if line.startswith('Traceback') or 'Error' in line.split(':')[0]), 0)
  assert lines, '\n'.join(log.splitlines()[first:first + 60])
  return lines[-1]


def wait_for(condition, process, timeout=300):
  deadline = time.time() + timeout
  while process.poll() is None and time.time() < deadline:
    if condition():
      return True
    time.sleep(0.002)
  return False


# --------------------------------------------------------------------------
# 1 and 5: SIGKILL at any moment (also mid-save), SIGTERM, exact resume.
# --------------------------------------------------------------------------


def kill_during_a_save(env, workdir, data_dir, overrides, rng, attempts=4):
  """SIGKILLs runs at random moments of saves until one dies with a save half done."""
  for _ in range(attempts):
    process = start(env, workdir, data_dir, *overrides)
    saving = lambda: partial_saves(workdir) and complete_steps(workdir)
    if not wait_for(saving, process):
      continue  # The run ended before a second save began.
    time.sleep(rng.uniform(0, 0.05))
    process.send_signal(signal.SIGKILL)
    process.wait()
    if partial_saves(workdir):
      return
  pytest.fail(f'No SIGKILL landed during a save in {attempts} attempts.')


def test_kill_mid_save_then_preempt_then_resume_bit_for_bit(tmp_path, prepared_omniglot, env,
                                                             reference):
  overrides = [*OVERRIDES, '--config.train.num_steps=40']
  workdir = str(tmp_path / 'work')

  # SIGKILL in the middle of a save: the half-written step is never taken as complete.
  kill_during_a_save(env, workdir, prepared_omniglot, overrides, random.Random(0))
  partial = partial_saves(workdir)
  complete = complete_steps(workdir)
  partial_step = int(os.path.basename(partial[0]).split('.')[0])
  manager = ocp.CheckpointManager(os.path.join(workdir, 'checkpoints'),
                                  options=ocp.CheckpointManagerOptions(read_only=True))
  assert manager.latest_step() == max(complete) < partial_step
  manager.close()

  # Restart, then SIGTERM (preemption) a few steps later: a checkpoint of that step first.
  process = start(env, workdir, prepared_omniglot, *overrides)
  assert wait_for(lambda: len(trained_steps(workdir)) >= 3, process), finish(
      process, workdir)[1][-3000:]
  process.send_signal(signal.SIGTERM)
  rc, log = finish(process, workdir)
  assert rc == preemption.EXIT_CODE, log[-3000:]
  assert f'Resuming from the checkpoint of step {max(complete)}' in log
  preempted_step = int(error_line(log, 'Preempted').split('after step ')[1].split(',')[0])
  assert preempted_step in complete_steps(workdir)
  assert not partial_saves(workdir)  # The partial save was removed at the restart.

  rc, log = run(env, workdir, prepared_omniglot, *overrides)
  assert rc == 0, log[-3000:]
  assert f'Resuming from the checkpoint of step {preempted_step}' in log
  # Same losses, accuracies and norms at every step as the uninterrupted run: bit for bit.
  assert metrics(workdir) == metrics(reference)
  assert complete_steps(workdir) == complete_steps(reference) == [36, 40]
  assert not partial_saves(workdir)


# --------------------------------------------------------------------------
# 2: divergence.
# --------------------------------------------------------------------------


# Batch normalisation makes ConstPN's CNN nearly scale-invariant: its loss turns non-finite
# where the norm of its weights (its 'generated' weights, the same for every task) overflows.
BLOW_UP = 1e20


def blow_up_checkpoint(workdir, step, factor=BLOW_UP):
  """Multiplies the parameters of a checkpoint by `factor`: the next step diverges.

  (A learning rate of 1e10 does the same, but is another program to compile.)
  """
  path = os.path.join(workdir, 'checkpoints', str(step), 'default')
  state = ocp.StandardCheckpointer().restore(path)
  state['params'] = jax.tree.map(lambda p: p * np.float32(factor), state['params'])
  shutil.rmtree(os.path.join(workdir, 'checkpoints'))
  manager = checkpoints.manager(workdir, constpn_config())
  manager.save(step, args=ocp.args.StandardSave(state))
  manager.close()


def test_divergence_stops_at_the_step_and_keeps_the_last_good_checkpoint(
    tmp_path, prepared_omniglot, env, reference):
  workdir = copy_of(reference, tmp_path)
  blow_up_checkpoint(workdir, 40)
  overrides = [*OVERRIDES, '--config.train.num_steps=80', '--config.train.checkpoint_every_steps=1']
  rc, log = run(env, workdir, prepared_omniglot, *overrides)
  assert rc == 1, log[-3000:]
  line = error_line(log, 'DivergenceError')
  assert line.startswith('DivergenceError: Training diverged at step 41: the loss (nan)'), line
  assert 'the norm of the generated weights (inf)' in line
  assert f'The last good checkpoint, step 40 in {workdir}/checkpoints, is kept' in line
  assert complete_steps(workdir) == [40] and not partial_saves(workdir)
  assert max(row['step'] for row in metrics(workdir)) == 40

  # on_divergence=skip: such steps change nothing, up to MAX_CONSECUTIVE_SKIPS in a row.
  overrides[-1] = '--config.train.checkpoint_every_steps=5'
  rc, log = run(env, workdir, prepared_omniglot, *overrides, '--config.train.on_divergence=skip')
  assert rc == 1, log[-3000:]
  last = 40 + divergence.MAX_CONSECUTIVE_SKIPS + 1
  assert (f'the {last - 40} steps 41..{last} were all skipped'
          in error_line(log, 'DivergenceError'))
  rows = [row for row in metrics(workdir) if row['step'] > 40]
  assert [row['train/skipped_steps'] for row in rows] == [1.0] * (last - 41)
  assert complete_steps(workdir) == [55, 60]
  before = ocp.StandardCheckpointer().restore(os.path.join(reference, 'checkpoints', '40',
                                                           'default'))
  for step in (55, 60):  # The parameters of step 40, untouched by the skipped steps.
    kept = ocp.StandardCheckpointer().restore(os.path.join(workdir, 'checkpoints', str(step),
                                                           'default'))
    assert int(kept['step']) == step
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b * np.float32(BLOW_UP)),
                 kept['params'], before['params'])


class TestDivergenceGuard:

  def row(self, skipped=False, **values):
    finite = dict(loss=1.0, grad_norm=1.0, theta_norm=1.0, update_norm=1.0)
    return {**finite, **values, 'skipped': float(skipped)}

  def test_stop_names_the_step_and_what_went_wrong(self):
    guard = divergence.Guard('stop')
    assert guard.check([(1, self.row()), (2, self.row())]) is None
    reason = guard.check([(3, self.row()), (4, self.row(True, theta_norm=np.inf))])
    assert reason == ('Training diverged at step 4: the norm of the generated weights (inf) '
                      'became non-finite.')

  def test_skip_goes_on_until_too_many_in_a_row(self):
    guard = divergence.Guard('skip')
    bad = self.row(True, loss=np.nan)
    limit = divergence.MAX_CONSECUTIVE_SKIPS
    assert guard.check([(s, bad) for s in range(1, limit + 1)]) is None
    assert guard.check([(limit + 1, self.row())]) is None  # A good step resets the count.
    assert guard.check([(s, bad) for s in range(limit + 2, 2 * limit + 2)]) is None
    reason = guard.check([(2 * limit + 2, bad)])
    assert f'the {limit + 1} steps {limit + 2}..{2 * limit + 2} were all skipped' in reason
    assert 'the loss (nan)' in reason


class TestLossSpikes:

  def test_a_jump_over_the_lowest_of_the_windows_before(self):
    spikes = divergence.LossSpikes(2.0)
    for step, loss in [(10, 9.0), (20, 5.0)]:  # Too few windows to judge: never a spike.
      assert spikes.check(step, loss * 10) is None
    assert spikes.check(30, 4.0) is None  # Falling: healthy.
    reason = spikes.check(40, 8.1)  # The lowest of 90, 50, 4 is 4: over 2 x 4.
    assert reason == ('the mean training loss of the steps up to 40 is 8.1, over 2 x 4 '
                      '(the lowest of the 3 windows before)')
    assert spikes.check(50, 7.9) is None  # The spike is not a reference: 7.9 < 2 x 4.
    assert spikes.check(60, 7.0) is None  # Nor 7.9: the lowest is still 4.
    spikes.forget_after(30)
    assert spikes.check(40, 3.9) is None

  def test_off_never_spikes(self):
    off = divergence.LossSpikes(0.0)
    assert all(off.check(step, loss) is None for step, loss in [(1, 1), (2, 1), (3, 1), (4, 1e9)])


def _spiking_steps(spikes_at):
  """`train.make_train_step` whose steps report 100x the loss where `spikes_at(step)`
  (the step count after the update) is true; the state is the real step's."""
  real_step = train.make_train_step

  def make_train_step(*args, **kwargs):
    step_fn = real_step(*args, **kwargs)

    def step(state, *step_args, **step_kwargs):
      state, metrics = step_fn(state, *step_args, **step_kwargs)
      if spikes_at(int(state.step)):
        metrics = dict(metrics, loss=metrics['loss'] * 100)
      return state, metrics
    return step
  return make_train_step


def test_a_loss_spike_rolls_back_and_lowers_the_learning_rate(tmp_path, monkeypatch):
  """A spike injected into the loss of the window ending at step 16: training goes
  back to step 12 (two healthy windows earlier) and goes on at half the rate."""
  # The CHT configs' rate, which the assertions below name (ConstPN's own is 1e-4).
  settings = {'optim.learning_rate': 1e-3, 'train.num_steps': 24, 'train.log_every_steps': 2,
              'train.checkpoint_every_steps': 4, 'train.keep_checkpoints': 10,
              'train.eval_every_steps': 0}
  dataset = {'train': class_images(20), 'validation': class_images(12, seed=1)}
  real_step, spiked = train.make_train_step, []

  def first_run_of_step_16(step):  # Only the first time step 16 runs.
    if step == 16 and not spiked:
      spiked.append(16)
      return True
    return False

  monkeypatch.setattr(train, 'make_train_step', _spiking_steps(first_run_of_step_16))
  workdir = str(tmp_path / 'spiked')
  train.train_and_evaluate(constpn_config(**settings, **{'train.loss_spike_factor': 3.0}),
                           workdir, dataset)
  rows = metrics(workdir)
  rollbacks = [row for row in rows if row['split'] == 'rollback']
  assert rollbacks == [{'step': 12, 'split': 'rollback', 'rollback/from_step': 16.0,
                        'rollback/learning_rate_scale': 0.5}]
  train_rows = [row for row in rows if row['split'] == 'train']
  assert [row['step'] for row in train_rows] == list(range(2, 25, 2))  # Step 16's row dropped.
  rate = {row['step']: row['train/learning_rate'] for row in train_rows}
  # The paper's schedule decays continuously (0.97 per 100k steps): a few 1e-6 here.
  assert all(rate[s] == pytest.approx(1e-3, rel=1e-5) for s in range(2, 13, 2))
  assert all(rate[s] == pytest.approx(5e-4, rel=1e-5) for s in range(14, 25, 2))
  assert complete_steps(workdir) == [4, 8, 12, 16, 20, 24]  # 16 rewritten after the rollback.

  # Up to the step rolled back to, the run is an unspiked one, bit for bit (the same
  # program at scale 1). After it the two programs round the update differently, and
  # Adam's near-sign steps make a comparison with a run at 5e-4 loose; the rows above
  # check the rate instead.
  monkeypatch.setattr(train, 'make_train_step', real_step)
  reference = str(tmp_path / 'reference')
  train.train_and_evaluate(constpn_config(**{**settings, 'train.num_steps': 12}), reference,
                           dataset)
  assert [row for row in metrics(reference) if row['split'] == 'train'] == train_rows[:6]
  restore = lambda w: ocp.StandardCheckpointer().restore(
      os.path.join(w, 'checkpoints', '12', 'default'))['params']
  jax.tree.map(np.testing.assert_array_equal, restore(workdir), restore(reference))

  # Resumed, the run keeps the lower rate.
  train.train_and_evaluate(constpn_config(**{**settings, 'train.num_steps': 28,
                                             'train.loss_spike_factor': 3.0}), workdir, dataset)
  resumed = [row for row in metrics(workdir) if row['split'] == 'train' and row['step'] > 24]
  assert [row['train/learning_rate'] for row in resumed] == pytest.approx([5e-4, 5e-4], rel=1e-5)


def test_a_stop_at_a_loss_spike_keeps_the_rolled_back_state(tmp_path, monkeypatch):
  """SIGTERM arrives at the step whose window is a spike: the run rolls back to step
  12 (already checkpointed), keeps it and stops, as after any other step."""
  def stop_at(self, step):
    if step == 16:
      self.signum = signal.SIGTERM
    return step == 16

  monkeypatch.setattr(train, 'make_train_step', _spiking_steps(lambda step: step == 16))
  monkeypatch.setattr(preemption.SignalFlag, 'stop_at', stop_at)
  workdir = str(tmp_path / 'work')
  config = constpn_config(**{'train.num_steps': 24, 'train.log_every_steps': 2,
                             'train.checkpoint_every_steps': 4, 'train.keep_checkpoints': 10,
                             'train.eval_every_steps': 0, 'train.loss_spike_factor': 3.0})
  with pytest.raises(preemption.Preempted, match='Stopped by SIGTERM after step 12, '):
    train.train_and_evaluate(config, workdir, {'train': class_images(20),
                                               'validation': class_images(12, seed=1)})
  assert complete_steps(workdir) == [4, 8, 12]
  rows = metrics(workdir)
  assert max(row['step'] for row in rows) == 12
  assert [row['step'] for row in rows if row['split'] == 'rollback'] == [12]


def test_too_many_loss_spikes_stop_the_run(tmp_path, monkeypatch):
  monkeypatch.setattr(train, 'make_train_step', _spiking_steps(lambda step: step > 8))
  config = constpn_config(**{'train.num_steps': 20, 'train.log_every_steps': 2,
                             'train.checkpoint_every_steps': 4, 'train.eval_every_steps': 0,
                             'train.loss_spike_factor': 3.0})
  with pytest.raises(divergence.DivergenceError, match=(
      r'Training collapsed at step 10: .* after 4 rollbacks \(train.loss_spike_factor\)\. '
      r'The last good checkpoint, step 8')):
    train.train_and_evaluate(config, str(tmp_path / 'work'),
                             {'train': class_images(20), 'validation': class_images(12, seed=1)})


# --------------------------------------------------------------------------
# 4: environment errors.
# --------------------------------------------------------------------------


def test_full_disk_during_save_keeps_the_earlier_checkpoints(tmp_path, prepared_omniglot, env,
                                                             reference):
  workdir = copy_of(reference, tmp_path)
  # Writes past `full` bytes fail, as on a full disk: the checkpoint's largest files pass
  # it, the resumed run's log files stay below it (its metrics log is rewritten at the
  # restart: the reference's every-step rows, but the last, are dropped first).
  full = 8 * 1024
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    last_row = f.readlines()[-1]
  with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
    f.write(last_row)
  largest = max(os.path.getsize(p) for p in glob.glob(
      os.path.join(reference, 'checkpoints', '40', '**'), recursive=True) if os.path.isfile(p))
  assert largest > full, f'No file of a checkpoint is over {full} bytes: lower `full`.'
  rc, log = run(env, workdir, prepared_omniglot, *OVERRIDES, '--config.train.num_steps=44',
                limit_file_size=full)
  assert rc == 1, log[-3000:]
  line = error_line(log, 'CheckpointError')
  assert line.startswith(f'CheckpointError: Saving a checkpoint in {workdir}/checkpoints '
                         'failed (File too large (errno 27)). The complete checkpoints there '
                         '(steps 36, 40) are kept'), line
  assert complete_steps(workdir) == [36, 40]  # keep_checkpoints=2 deleted neither.
  restored = ocp.StandardCheckpointer().restore(os.path.join(workdir, 'checkpoints', '40',
                                                             'default'))
  assert int(restored['step']) == 40


def test_checkpoint_of_another_config_is_refused_before_any_work(tmp_path):
  workdir = str(tmp_path / 'work')
  saved = tiny_config()
  state = train.make_init(methods.build(saved), optim.make_optimizer(saved.optim),
                         devices.data_mesh()).eval_shape(jax.random.key(0))
  state = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), state)
  manager = checkpoints.manager(workdir, saved)
  manager.save(2, args=ocp.args.StandardSave(state))
  manager.close()
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(saved.to_json_best_effort())
  before = sorted(os.listdir(os.path.join(workdir, 'checkpoints', '2', 'default')))

  # data_dir does not exist: the check comes before any data is read.
  changed = tiny_config(**{'model.channels': 16, 'data.data_dir': str(tmp_path / 'none')})
  with pytest.raises(checkpoints.CheckpointError) as error:
    train.train_and_evaluate(changed, workdir)
  message = str(error.value)
  assert message.startswith(f'The checkpoint of step 2 in {workdir}/checkpoints was written '
                            'by a different config: ')
  assert ('params/block_0_activation_features/conv_0/bias has shape (8,) float32 in the '
          'checkpoint but (16,) float32 in this config') in message
  assert 'model.channels 8 -> 16' in message
  assert 'the checkpoints are left untouched' in message
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints', '2', 'default'))) == before
  assert not (tmp_path / 'none').exists()


def test_a_resume_runs_the_recorded_config(tmp_path, caplog):
  """Issue 56: the workdir's record is the run's config. A new default keeps its recorded
  value, an override that changes the run is refused naming it (unless accepted), steps
  and cadences apply; config.json stays the first start's, each start a history row."""
  workdir = str(tmp_path)
  workdir_lib.record_start(workdir, tiny_config(**{'data.binarize': False}), 0)
  started_with = (tmp_path / 'config.json').read_text()
  now = tiny_config(**{'train.num_steps': 6})  # binarize: True, the configs' default now.
  resumed = workdir_lib.run_config(workdir, now, 'train', {'train.num_steps': 6})
  assert resumed.data.binarize is False and resumed.train.num_steps == 6
  assert 'data.binarize False (the config given: True)' in caplog.text

  with pytest.raises(workdir_lib.ConfigChangeError) as error:
    workdir_lib.run_config(workdir, now, 'train', {'data.binarize': True})
  assert str(error.value).startswith(f'{workdir} holds a run that started with other '
                                     'settings: data.binarize False -> True. ')
  accepted = workdir_lib.run_config(workdir, now, 'train', {'data.binarize': True}, True)
  assert accepted.data.binarize is True
  workdir_lib.record_start(workdir, accepted, 4)
  assert (tmp_path / 'config.json').read_text() == started_with
  rows = [json.loads(line) for line in open(tmp_path / 'config_history.jsonl')]
  assert [(row['step'], row['changes']) for row in rows] == [
      (0, {}), (4, {'data.binarize': [False, True], 'train.num_steps': [4, 6]})]
  # The record now holds the accepted change: the same command resumes without a word.
  assert workdir_lib.run_config(workdir, now, 'train', {'data.binarize': True}) == accepted

  # A record older than a field: the value that did what the code did then, else refused.
  old = json.loads(started_with)
  del old['episode']['independent_draws'], old['optim']['decay_rate']
  (tmp_path / 'config_history.jsonl').unlink()
  (tmp_path / 'config.json').write_text(json.dumps(old))
  now = tiny_config(**{'data.binarize': False, 'episode.independent_draws': True})
  with pytest.raises(workdir_lib.ConfigChangeError, match=re.escape(
      'settings: optim.decay_rate (absent) -> 0.97 (the record predates the field). ')) as error:
    workdir_lib.run_config(workdir, now, 'train')
  assert ('--accept_config_changes to change this run from here on (it would also change '
          'episode.independent_draws False -> True), recorded in') in str(error.value)
  old['optim']['decay_rate'] = 0.97
  (tmp_path / 'config.json').write_text(json.dumps(old))
  assert workdir_lib.run_config(workdir, now, 'train').episode.independent_draws is False


def test_evaluation_takes_the_trained_settings_from_the_record(tmp_path, caplog):
  """Issue 56: a config of another T (or width, or data) evaluates the recorded model."""
  from configs import omniglot_t3  # pylint: disable=g-import-not-at-top
  caplog.set_level('INFO', logger='absl')
  workdir = str(tmp_path)
  workdir_lib.record_start(workdir, tiny_config(), 0)
  given = override(omniglot_t3.get_config('tiny'), {'data.data_dir': '/elsewhere'})
  config = workdir_lib.run_config(workdir, given, 'eval')
  assert config.episode.num_tasks == 2 and config.episode.independent_draws is False
  assert config.data.data_dir == '/elsewhere'  # Where the data lie now: the config's.
  assert (f'Evaluating the model trained in {workdir} as its record says: cht, T=2 tasks of '
          '3-way 1-shot, model.channels=8, omniglot 16x16 binarised.') in caplog.text
  assert ('over the config given: episode.independent_draws False (the config given: '
          'True), episode.num_tasks 2 (the config given: 3).') in caplog.text


def test_unwritable_workdir(tmp_path):
  blocker = tmp_path / 'a_file'
  blocker.write_text('')
  config = tiny_config(**{'data.data_dir': str(tmp_path / 'none')})
  with pytest.raises(workdir_lib.WorkdirError, match=re.escape(
      f'Cannot write to {blocker}/work (NotADirectoryError: Not a directory). Choose '
      'another --workdir')):
    train.train_and_evaluate(config, str(blocker / 'work'))
  if os.geteuid() != 0:  # root may write anywhere.
    read_only = tmp_path / 'read_only'
    read_only.mkdir(mode=0o500)
    with pytest.raises(workdir_lib.WorkdirError, match='Permission denied'):
      train.train_and_evaluate(config, str(read_only))
  assert not (tmp_path / 'none').exists()


def test_no_archives_and_no_network_fails_at_once(tmp_path, monkeypatch):
  monkeypatch.setattr(omniglot, '_unreachable', lambda urls: 'no route to host')
  start_time = time.time()
  with pytest.raises(omniglot.DataError, match='No Omniglot archives in .*, and no network '
                     r'to download them \(no route to host\). Put the four Omniglot archives'):
    omniglot.prepare_omniglot(str(tmp_path / 'tfds'), None)
  assert time.time() - start_time < 30


def test_network_probe(monkeypatch):
  import urllib.error  # pylint: disable=g-import-not-at-top
  import urllib.request  # pylint: disable=g-import-not-at-top

  def offline(request, timeout):
    raise urllib.error.URLError('Name or service not known')
  monkeypatch.setattr(urllib.request, 'urlopen', offline)
  assert omniglot._unreachable(['https://a', 'https://b']) == (
      'https://a: Name or service not known; https://b: Name or service not known')

  def not_found(request, timeout):
    raise urllib.error.HTTPError(request.full_url, 404, 'Not Found', None, None)
  monkeypatch.setattr(urllib.request, 'urlopen', not_found)
  assert omniglot._unreachable(['https://a']) is None  # A server answered.


def test_corrupt_prepared_dataset(tmp_path, prepared_omniglot):
  data_dir = tmp_path / 'tfds'
  shutil.copytree(os.path.join(prepared_omniglot, 'omniglot'), data_dir / 'omniglot')
  (record,) = glob.glob(str(data_dir / 'omniglot' / '*' / 'omniglot-train.tfrecord*'))
  with open(record, 'r+b') as f:
    f.seek(1000)
    f.write(b'\0' * 64)
  with pytest.raises(omniglot.DataError, match=r"cannot be read \(split 'train': "
                     r'DataLossError.*Delete that folder and run again'):
    omniglot.load_omniglot(str(data_dir), None, image_size=16)


# --------------------------------------------------------------------------
# Metrics log.
# --------------------------------------------------------------------------


def test_metrics_log_drops_what_the_resumed_run_logs_again(tmp_path):
  rows = [{'step': 2, 'split': 'train'}, {'step': 4, 'split': 'validation'},
          {'step': 4, 'split': 'test'}, {'step': 6, 'split': 'train'}]
  path = tmp_path / 'metrics.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows) + '{"step": 8, "spl')
  log = workdir_lib.MetricsLog(str(tmp_path))
  log.drop_after(4)
  log.close()
  assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:3]
