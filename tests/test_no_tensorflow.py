"""Training and evaluation from a prepared Omniglot cache with neither TensorFlow nor
TFDS importable, through the one-command launcher (issue 16: GPU images often lack them)."""

import json
import os
import subprocess
import sys

import numpy as np

from cht_jax.data import omniglot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fake_cache(data_dir: str, size: int = 16) -> None:
  """What an earlier run that read the real data leaves: one .npz of the three splits."""
  rng = np.random.default_rng(0)
  splits = {'train': 1150, 'validation': 50, 'test': 423}
  arrays = {s: rng.integers(0, 256, (n, 20, size, size, 1), dtype=np.uint8)
            for s, n in splits.items()}
  omniglot._save_npz(omniglot._cache_path(data_dir, 'ht', 2022, size), arrays)


def test_launcher_trains_and_evaluates_without_tensorflow(tmp_path):
  data_dir, workdir, block = tmp_path / 'tfds', tmp_path / 'run', tmp_path / 'block'
  _fake_cache(str(data_dir))
  block.mkdir()
  # Every Python process of the run (the launcher and the two it starts) sees these
  # packages as missing, as on a GPU image without them.
  (block / 'sitecustomize.py').write_text(
      "import sys\nfor name in ('tensorflow', 'tensorflow_datasets'):\n"
      "  sys.modules[name] = None\n")
  # CHT_COMMIT: the commit to record where the tree was copied without its history.
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(block), REPO]),
             CHT_COMMIT='abc1234+test')
  probe = subprocess.run([sys.executable, '-c', 'import tensorflow_datasets'], env=env,
                         capture_output=True, text=True)
  assert probe.returncode != 0  # The block works.
  run = subprocess.run(
      [sys.executable, 'launch/fast_table1.py', f'--workdir={workdir}', '--',
       '--config=configs/omniglot_t2.py:tiny', f'--config.data.data_dir={data_dir}',
       '--eval_episodes=4', '--eval_query_draws=1'],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  results = json.load(open(workdir / 'results.json'))
  row = results['table1']
  assert row['columns'] == ['0', '0-1'] and results['step'] == 4
  assert results['commit'] == 'abc1234+test'
  assert all(0 <= a <= 100 for a in row['class_incremental']['mean'])
  assert results['validation_curve']['step'] == [4]  # eval_every_steps of the tiny run.
  assert (workdir / 'curve.png').stat().st_size > 0 and (workdir / 'results.md').exists()
  # TensorBoard events written by the `tensorboard` package alone.
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
  events = event_accumulator.EventAccumulator(str(workdir))
  events.Reload()
  assert [e.step for e in events.Scalars('train/loss')] == [2, 4]
