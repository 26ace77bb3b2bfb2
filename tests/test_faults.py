"""Faults that used to lose work or explain themselves wrongly (issue 37).

A full disk while evaluation results are written, a lost process of a
two-process job, an unreachable coordinator, a config file that fails to load,
and the file modes of shared caches. Cheap by design: faults are injected in
process where they can be, and each end-to-end case is one short subprocess
(one two-process run for the lost process).
"""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time

from conftest import REPO_ROOT, class_images, tiny_config
import numpy as np
import pytest

from cht_jax import plots
from cht_jax import reports
from cht_jax.data import omniglot
from cht_jax.runtime import checkpoints
from cht_jax.runtime import devices
from cht_jax.runtime import workdir as workdir_lib

LAUNCHER = os.path.join(REPO_ROOT, 'launch', 'local_multiprocess.py')


@pytest.fixture(scope='module')
def env():
  """Environment of the subprocesses: conftest's compilation cache, shared by all."""
  return dict(os.environ)


def fake_results(num_tasks=2):
  """What `evaluate.evaluate` returns, as far as the JSON, CSV and Markdown read it."""
  matrix = {'mean': np.full((num_tasks, num_tasks), 0.5), 'ci95': np.full((num_tasks,) * 2, .1)}
  summary = {k: 0.5 for k in ('average_accuracy', 'average_incremental_accuracy',
                              'backward_transfer', 'forgetting')}
  return {
      'num_tasks': num_tasks, 'trained_tasks': num_tasks,
      'protocol': {'split': 'test', 'num_episodes': 4, 'num_query_draws': 2,
                   'queries_per_class': 2, 'seed': 0},
      'episode': {'ways': 3, 'shots': 1},
      'table': {'columns': reports.task_names(num_tasks, cumulative=True),
                **{name: {'mean': [0.5] * num_tasks, 'ci95': [0.1] * num_tasks}
                   for name in ('class_incremental', 'task_incremental')}},
      **{name: matrix for name in reports.MATRICES},
      'summaries': {'final': {'num_tasks': num_tasks, 'task_incremental': summary,
                              'class_incremental': summary}},
  }


class _FillingDisk:
  """`open` whose files take `room` bytes, then fail as a full disk does."""

  def __init__(self, room: int):
    self.room = room

  def __call__(self, path, mode='r', *args, **kwargs):
    f = open(path, mode, *args, **kwargs)  # pylint: disable=unspecified-encoding
    write, disk = f.write, self

    def limited(data):
      if len(data) > disk.room:
        write(data[:disk.room])
        f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
      disk.room -= len(data)
      return write(data)

    f.write = limited
    return f


def test_a_disk_that_fills_keeps_the_earlier_results_whole(tmp_path, monkeypatch):
  prefix = str(tmp_path / 'eval' / 'test_T2_step4')
  paths = reports.write_results(fake_results(), prefix, plot=False)
  before = {p: open(p).read() for p in paths}
  newer = fake_results()
  newer['protocol']['seed'] = 7
  monkeypatch.setattr(workdir_lib, 'open', _FillingDisk(room=512), raising=False)
  with pytest.raises(workdir_lib.WorkdirError) as error:
    reports.write_results(newer, prefix, plot=False)
  message = str(error.value)
  assert isinstance(error.value, reports.ReportError)
  assert f'in {tmp_path / "eval"} failed (No space left on device (errno 28))' in message
  assert 'Free disk space' in message and '\n' not in message
  # The JSON was cut at 512 bytes in its temporary file, which is gone: every file
  # under a final name is the earlier, complete one.
  assert sorted(os.listdir(tmp_path / 'eval')) == sorted(os.path.basename(p) for p in paths)
  assert {p: open(p).read() for p in paths} == before
  json.loads(before[paths[0]])


def _fake_figure(results, output):
  """plots.plot_results without Matplotlib: the figure's bytes name its episode seed."""
  workdir_lib.write_atomically(output, f'figure of seed {results[0]["protocol"]["seed"]}')
  return output


@pytest.mark.parametrize('earlier', [True, False])
def test_the_result_files_appear_as_a_set_or_not_at_all(tmp_path, monkeypatch, earlier):
  """The figure, written last, fails: with an earlier set, none of it is replaced (the JSON
  and Markdown were, the CSV and figure not); with none, no file and no folder is left."""
  prefix = str(tmp_path / 'eval' / 'test_T2_step4')
  monkeypatch.setattr(plots, 'plot_results', _fake_figure)
  before = {}
  if earlier:
    before = {p: open(p).read() for p in reports.write_results(fake_results(), prefix)}
    assert sorted(before) == [prefix + ext for ext in ('.csv', '.json', '.md', '.png')]

  def full_disk(results, output):
    del results, output
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  monkeypatch.setattr(plots, 'plot_results', full_disk)
  newer = fake_results()
  newer['protocol']['seed'] = 7
  with pytest.raises(reports.ReportError, match=re.escape(
      'None of test_T2_step4.* was written or changed: the results of earlier evaluations '
      'there are kept whole')):
    reports.write_results(newer, prefix)
  if earlier:  # No temporary folder either.
    assert sorted(os.listdir(tmp_path / 'eval')) == sorted(os.path.basename(p) for p in before)
    assert {p: open(p).read() for p in before} == before
  else:
    assert os.listdir(tmp_path) == []


def test_a_figure_that_fails_midway_keeps_the_earlier_one(tmp_path, monkeypatch):
  """--eval_embeddings' figure (every figure goes through plots._save)."""
  path = str(tmp_path / 'embeddings.png')
  with open(path, 'wb') as f:
    f.write(b'the earlier figure')

  def savefig(fig, name, **kwargs):
    del fig, kwargs
    assert name.endswith('.png')  # Matplotlib picks the format from the name.
    with open(name, 'wb') as f:
      f.write(b'\x89PNG')
    raise OSError(errno.ENOSPC, 'No space left on device')
  monkeypatch.setattr(plots.figure_lib.Figure, 'savefig', savefig)
  rng = np.random.default_rng(0)
  with pytest.raises(OSError, match='No space'):
    plots.plot_embeddings(rng.normal(size=(2, 3, 4)), rng.normal(size=(3, 6, 4)),
                          np.tile(np.repeat(np.arange(3), 2), (2, 1)), path, projector='pca')
  assert os.listdir(tmp_path) == ['embeddings.png']
  assert open(path, 'rb').read() == b'the earlier figure'


def test_result_files_follow_the_umask(tmp_path):
  old = os.umask(0o027)
  try:
    path = str(tmp_path / 'r.json')
    workdir_lib.write_atomically(path, '{}')
    cache = str(tmp_path / 'cache' / 'omniglot.npz')
    omniglot._save_npz(cache, {'train': np.zeros(2)})  # pylint: disable=protected-access
  finally:
    os.umask(old)
  assert os.stat(path).st_mode & 0o777 == 0o640
  assert os.stat(cache).st_mode & 0o777 == 0o640  # Was 0600: unreadable to the group.


def test_an_unwritable_results_folder_fails_before_evaluating(tmp_path, monkeypatch):
  def denied(*args, **kwargs):
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
  monkeypatch.setattr(workdir_lib.tempfile, 'mkstemp', denied)
  with pytest.raises(reports.ReportError,
                     match=re.escape(f'Cannot write the evaluation results to '
                                     f'{tmp_path / "eval"} (Permission denied (errno 13))')):
    reports.check_writable(str(tmp_path))


def test_a_save_that_fails_for_a_lost_peer_is_not_called_a_disk_problem(monkeypatch):
  class Manager:
    directory = '/work/checkpoints'

    def save(self, *args, **kwargs):
      raise RuntimeError('Barrier failed: UNAVAILABLE: Task 1 heartbeat timeout.')

  monkeypatch.setattr(devices.jax, 'process_count', lambda: 2)
  monkeypatch.setattr(devices.jax, 'process_index', lambda: 0)
  with pytest.raises(devices.LostProcessError) as error:
    checkpoints.save(Manager(), 4, {}, wait=True)
  assert str(error.value).startswith('process 0 of 2 lost contact with process 1 of this job '
                                     '(a checkpoint save in /work/checkpoints failed')
  assert 'disk' not in str(error.value)

  class GlooManager(Manager):  # A killed peer breaks a save's all-gather.
    def save(self, *args, **kwargs):
      raise ValueError('UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/'
                       'pair.cc:538] Read error [127.0.0.1]:29320: Connection reset by peer')

  with pytest.raises(devices.LostProcessError) as error:
    checkpoints.save(GlooManager(), 4, {}, wait=True)
  # One line the user can act on: no C++ source location, read as an abort's noise.
  assert ('failed: ValueError: UNKNOWN: Gloo AllGather failed: Read error [127.0.0.1]:29320: '
          'Connection reset by peer)') in str(error.value)
  assert '.cc:' not in str(error.value)


def test_the_launcher_returns_a_signalled_process_status_as_a_shell_does():
  sys.path.insert(0, os.path.dirname(LAUNCHER))
  try:
    import local_multiprocess  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.pop(0)
  assert local_multiprocess.shell_status(-signal.SIGKILL) == 137
  assert local_multiprocess.shell_status(1) == 1
  assert local_multiprocess.describe(-9) == '-9 (killed by SIGKILL)'


def run_main(env, *flags, timeout=120):
  return subprocess.run([sys.executable, '-m', 'cht_jax.main', *flags], cwd=REPO_ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def last_lines(stderr):
  return [line for line in stderr.splitlines() if line.strip()][-1:]


@pytest.mark.parametrize('source, line', [
    ('def get_config():\n  x = 1\n  raise RuntimeError("no such experiment")\n', 3),
    ('def get_config(:\n  pass\n', 1),
])
def test_a_config_file_that_fails_to_load_is_one_line(tmp_path, source, line, env):
  path = tmp_path / 'broken.py'
  path.write_text(source)
  # In a process of its own: cht_jax.main defines absl flags that cht_jax.tools.bench, imported
  # by other tests, defines too.
  code = ('import sys\nfrom cht_jax import main\ntry:\n'
          '  main.FLAGS["config"].parser.parse(sys.argv[1])\n'
          'except main.ConfigFileError as e:\n  print(e)\n')
  result = subprocess.run([sys.executable, '-c', code, str(path)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
  kind = 'RuntimeError: no such experiment' if line == 3 else 'SyntaxError: invalid syntax'
  assert result.stdout.strip() == (f'The config file {path}, line {line}, failed to load: '
                                   f'{kind} (--verbosity=1 for the full traceback)'), result.stderr


def test_main_says_a_broken_config_file_in_one_line(tmp_path, env):
  path = tmp_path / 'broken.py'
  path.write_text('def get_config(:\n  pass\n')
  result = run_main(env, f'--config={path}', f'--workdir={tmp_path / "w"}')
  assert result.returncode == 1
  assert result.stderr.strip() == (f'ConfigError: The config file {path}, line 1, failed to '
                                   'load: SyntaxError: invalid syntax (--verbosity=1 for the '
                                   'full traceback)'), result.stderr[-3000:]
  assert not os.path.exists(tmp_path / 'w')
  verbose = run_main(env, f'--config={path}', '--verbosity', '1')  # absl's space form.
  assert 'Traceback' in verbose.stderr and last_lines(verbose.stderr) == [
      result.stderr.strip()], verbose.stderr[-3000:]


def test_an_unreachable_coordinator_is_named_after_the_timeout(tmp_path, env):
  port = devices_free_port()
  start = time.time()
  result = run_main(env, '--config=configs/omniglot_t2.py:tiny', f'--workdir={tmp_path / "w"}',
                    '--distributed', f'--coordinator_address=127.0.0.1:{port}',
                    '--num_processes=2', '--process_id=1', '--coordinator_timeout_seconds=2')
  assert time.time() - start < 60
  assert result.returncode == 1, result.stderr[-3000:]
  assert last_lines(result.stderr) == [
      f'CoordinatorError: process 1 of 2 could not join the job at the coordinator '
      f'127.0.0.1:{port} within 2 s (--coordinator_timeout_seconds). Check that process 0 '
      'runs on that host and listens on that port (--coordinator_address=host:port of '
      'process 0), that no firewall blocks it, and that all processes of the job were '
      'started.'], result.stderr[-3000:]


def devices_free_port():
  """A port nobody listens on (the OS's pick, released at once)."""
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def docstring_example():
  """The flags of cht_jax.main in the launcher's docstring example."""
  sys.path.insert(0, os.path.dirname(LAUNCHER))
  try:
    import local_multiprocess  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.pop(0)
  example = local_multiprocess.__doc__.split('\n\n')[1].replace('\\\n', ' ')
  launcher_flags, main_flags = example.split(' -- ')
  assert launcher_flags.split()[-1] == '--num_processes=2'
  return [f for f in main_flags.split() if not f.startswith('--workdir=')]


def fake_omniglot(data_dir):
  """A cache of generated images with Omniglot's split sizes (what main reads first):
  the same compiled programs as on the real data."""
  path = omniglot._cache_path(str(data_dir), 'ht', 2022, 16)  # pylint: disable=protected-access
  os.makedirs(os.path.dirname(path))
  np.savez(path, train=class_images(1150), validation=class_images(50, seed=1),
           test=class_images(423, seed=2))


def test_the_launcher_docstring_example_passes_validation():
  """Its flags were rejected (one episode per step on 2 devices) before any work."""
  from cht_jax import config_validation  # pylint: disable=g-import-not-at-top
  flags = docstring_example()
  assert flags[0] == '--config=configs/omniglot_t2.py:tiny'
  overrides = dict(f[len('--config.'):].split('=', 1) for f in flags[1:])
  config = tiny_config(**{k: int(v) for k, v in overrides.items()})
  config_validation.validate(config, num_devices=2)  # One CPU device per process.


def test_a_killed_process_is_named_by_the_survivor_and_the_launcher(tmp_path, env):
  """The launcher's docstring example, with process 1 killed once both have joined the
  job: process 0, busy outside any collective (loading, compiling), says which process
  it lost and how to resume within the heartbeat timeout, and the launcher exits with
  the killed process's status. (Killed at a training step, which costs a compilation
  of the step: tests/test_multiprocess.py.)"""
  fake_omniglot(tmp_path / 'data')
  workdir, log_path = tmp_path / 'work', tmp_path / 'work.log'
  flags = [*docstring_example(), f'--workdir={workdir}',
           f'--config.data.data_dir={tmp_path / "data"}', '--heartbeat_timeout_seconds=10']
  with open(log_path, 'w') as log:
    launcher = subprocess.Popen(
        [sys.executable, LAUNCHER, '--num_processes=2', '--devices_per_process=1',
         '--grace_seconds=120', '--', *flags],
        cwd=REPO_ROOT, env=env, stdout=log, stderr=log, start_new_session=True)
  try:
    joined = lambda: all(f'process {i}/2, devices' in log_path.read_text() for i in (0, 1))
    deadline = time.time() + 120
    while launcher.poll() is None and time.time() < deadline and not joined():
      time.sleep(0.05)
    assert launcher.poll() is None and joined(), log_path.read_text()[-3000:]
    child = subprocess.run(['pgrep', '-P', str(launcher.pid), '-f', 'process_id=1'],
                           capture_output=True, text=True).stdout.split()
    os.kill(int(child[0]), signal.SIGKILL)
    killed = time.time()
    launcher.wait(timeout=120)
    took = time.time() - killed
  finally:
    if launcher.poll() is None:
      os.killpg(launcher.pid, signal.SIGKILL)
      launcher.wait()
  log = log_path.read_text()
  assert launcher.returncode == 137, log[-3000:]
  assert ('local_multiprocess: process 1 exited with -9 (killed by SIGKILL); stopping the '
          'others within 120 s; exit status 137.') in log
  lost = [l for l in log.splitlines() if l.startswith('LostProcessError')]
  assert len(lost) == 1, log[-3000:]
  # The cause in brackets: the missed heartbeats, or, on a loaded machine where process 0
  # had reached its first collective by the kill, the collective that broke.
  head, cause = lost[0].split(' (', 1)
  assert head == 'LostProcessError: process 0 of 2 lost contact with process 1 of this job'
  assert cause.startswith(('the coordinator has not heard from it within '
                           '--heartbeat_timeout_seconds).', 'UNKNOWN: Gloo')), lost[0]
  assert lost[0].endswith(
      f'). Stopping; the complete checkpoints in {workdir}/checkpoints are kept: restart all '
      '2 processes with the same command to resume from the latest.'), lost[0]
  assert 'Fatal Python error' not in log and 'Traceback' not in log, log[-3000:]
  assert took < 10 + 20, log[-3000:]  # The heartbeat timeout, and a loaded machine's slack.
