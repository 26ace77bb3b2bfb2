"""`python -m cht_jax.main` end to end on real Omniglot with a tiny config, and resume."""

import json
import os
import re
import subprocess
import sys

from conftest import REPO_ROOT


def start_main(workdir, data_dir, *overrides, config='configs/omniglot_t2.py:tiny'):
  command = [sys.executable, '-m', 'cht_jax.main', f'--config={config}',
             f'--workdir={workdir}', f'--config.data.data_dir={data_dir}', *overrides]
  return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)


def run_main(workdir, data_dir, *overrides, config='configs/omniglot_t2.py:tiny'):
  result = start_main(workdir, data_dir, *overrides, config=config)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stderr


def read_history(workdir):
  with open(os.path.join(workdir, 'config_history.jsonl')) as f:
    return [json.loads(line) for line in f]


def read_metrics(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def test_main_trains_checkpoints_and_resumes(tmp_path, prepared_omniglot):
  workdir = str(tmp_path / 'work')
  log = run_main(workdir, prepared_omniglot)
  # Progress a person can follow: the first step at once, then speed and time left.
  assert 'step 1/4: the first step took ' in log
  assert re.search(r'step 4/4: loss [0-9.]+, .* steps/s, [0-9]+ s left', log), log[-3000:]
  steps = sorted(int(s) for s in os.listdir(os.path.join(workdir, 'checkpoints')))
  assert steps == [2, 4]  # checkpoint_every_steps=2, num_steps=4.
  metrics = read_metrics(workdir)
  train_rows = [m for m in metrics if m['split'] == 'train']
  assert [m['step'] for m in train_rows] == [2, 4]
  assert all(m['train/steps_per_sec'] > 0 for m in train_rows)
  assert any(m['split'] == 'validation' for m in metrics)
  assert any(name.startswith('events.out.tfevents') for name in os.listdir(workdir))

  # Same command, more steps: resumes from step 4 instead of starting over.
  log = run_main(workdir, prepared_omniglot, '--config.train.num_steps=6')
  assert 'Resuming from the checkpoint of step 4' in log
  train_steps = [m['step'] for m in read_metrics(workdir) if m['split'] == 'train']
  assert train_steps == [2, 4, 6]
  assert sorted(int(s) for s in os.listdir(os.path.join(workdir, 'checkpoints'))) == [2, 4, 6]


def test_main_runs_a_table1_baseline(tmp_path, prepared_omniglot):
  """--config.method='finetune' (configs/baselines_table1.py) goes to the baselines' trainer
  and evaluator through the same command."""
  workdir = str(tmp_path / 'finetune')
  config = 'configs/baselines_table1.py:finetune,2,tiny'
  run_main(workdir, prepared_omniglot, '--config.train.eval_every_steps=0', config=config)
  assert sorted(int(s) for s in os.listdir(os.path.join(workdir, 'checkpoints'))) == [2, 4]
  # Evaluated with the config of another T: the workdir's record says what was trained,
  # and the evaluation's T defaults to it (issue 56).
  log = run_main(workdir, prepared_omniglot, '--mode=eval', '--eval_episodes=2',
                 '--eval_query_draws=1', config='configs/baselines_table1.py:finetune,3,tiny')
  assert (f'Evaluating the model trained in {workdir} as its record says: finetune, T=2 '
          'tasks of 3-way 1-shot') in log
  assert 'over the config given: episode.num_tasks 2 (the config given: 3)' in log
  with open(os.path.join(workdir, 'eval', 'test_T2_step4.json')) as f:
    saved = json.load(f)
  assert saved['method'] == 'Pretraining + fine-tuning'
  assert saved['num_tasks'] == saved['trained_tasks'] == 2
  assert not os.path.exists(os.path.join(workdir, 'eval', 'test_T3_step4.json'))
