"""Baselines (ConstPN, Merged HT), the experiment configs and launch/sweep.py."""

import importlib
import importlib.util
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from cht_jax import config_validation
from cht_jax import continual
from cht_jax import evaluate
from cht_jax import losses
from cht_jax import methods
from cht_jax import optim
from cht_jax import reports
from cht_jax import train
from cht_jax.methods import merged_ht
from cht_jax.models import cnn as cnn_lib
from cht_jax.models import hypertransformer as ht_lib
from cht_jax.runtime import devices

from conftest import REPO_ROOT, make_episode, training_classes

sys.path.insert(0, str(REPO_ROOT / 'launch'))
import sweep  # pylint: disable=g-import-not-at-top,wrong-import-position

IMAGE_SHAPE = (16, 16, 1)


def load_config(name, arg):
  return importlib.import_module(f'configs.{name}').get_config(arg)


@pytest.fixture(scope='module')
def images():
  # 20 classes: ConstPN's tiny training tasks are 5 x 3 = 15-way; test_methods' ones, so
  # that each method's tiny step and init are cache hits.
  return training_classes()


def train_and_evaluate(config, images, steps=3):
  """A few training steps, then the evaluation protocol on a handful of episodes."""
  method = methods.build(config)
  optimizer = optim.make_optimizer(config.optim)
  mesh = devices.data_mesh()
  state = train.make_init(method, optimizer, mesh)(jax.random.key(0))
  step = train.make_train_step(method, optimizer, mesh)
  for i in range(steps):
    state, metrics = step(state, images, jax.random.key(i))
    assert not metrics['skipped'] and np.isfinite(float(metrics['loss']))
  protocol = evaluate.default_protocol(config, num_episodes=2, num_query_draws=2,
                                       batch_size=2)
  results = evaluate.evaluate(config, state.params, protocol, class_images=np.asarray(images))
  return state, results


# --------------------------------------------------------------------------
# Configs.
# --------------------------------------------------------------------------


@pytest.mark.parametrize('name,arg', [
    ('omniglot_channels', '16,5'), ('omniglot_channels', '4,2,tiny'),
    ('omniglot_channels', '32,3,smoke'), ('omniglot_constpn', '5'),
    ('omniglot_constpn', '2,tiny'), ('omniglot_merged_ht', '3'),
    ('omniglot_merged_ht', '2,tiny'), ('omniglot_ht_ce', '5'), ('omniglot_ht_ce', '2,tiny'),
    ('omniglot_task_incremental', '5'), ('omniglot_task_incremental', '2,tiny'),
] + [('omniglot_minibatch', f'{arm},{v}') for arm in
     ('all_at_once', 'two_plus_two', 'one_at_a_time', 'ht_one', 'ht_two') for v in ('', 'tiny')])
def test_experiment_configs_validate(name, arg):
  config = config_validation.validate(load_config(name, arg), num_devices=1)
  if name == 'omniglot_channels':
    channels, num_tasks = map(int, arg.split(',')[:2])
    assert (config.model.channels, config.model.activation_features,
            config.episode.num_tasks) == (channels, channels, num_tasks)
    assert config.optim.learning_rate == (
        1e-3 if ',' in arg[arg.index(',') + 1:] else 5e-5 if num_tasks == 5 else 1e-4)
  if name == 'omniglot_minibatch':
    arm = arg.split(',')[0]
    assert (config.episode.num_tasks, config.episode.shots) == importlib.import_module(
        'configs.omniglot_minibatch').ARMS[arm]
    assert config.episode.task_classes == 'same' and config.loss == 'cross_entropy'
    assert config.model.cnn_embedding_dim == config.episode.ways


def test_channels_config_rejects_bad_arguments():
  with pytest.raises(ValueError, match='variant'):
    load_config('omniglot_channels', '8,2,huge')
  with pytest.raises(ValueError, match='at most 2'):
    load_config('omniglot_channels', '8,2,3')


def test_baseline_config_relations_are_checked():
  config = load_config('omniglot_merged_ht', '2,tiny')
  with config.unlocked():
    config.episode.task_classes = 'same'
  with pytest.raises(config_validation.ConfigError, match="task_classes must be 'disjoint'"):
    config_validation.validate(config, num_devices=1)
  config = load_config('omniglot_constpn', '2')
  with config.unlocked():
    config.constpn_ways_multiplier = 100
  with pytest.raises(config_validation.ConfigError, match='lower constpn_ways_multiplier'):
    config_validation.validate(config, num_devices=1)
  config = load_config('omniglot_constpn', '2,tiny')
  with config.unlocked():
    config.loss = 'task_incremental'
  with pytest.raises(config_validation.ConfigError, match="loss must be 'class_incremental'"):
    config_validation.validate(config, num_devices=1)


# --------------------------------------------------------------------------
# ConstPN: the CNN the HyperTransformer fills, with trained parameters.
# --------------------------------------------------------------------------


def test_constpn_is_the_generated_cnn_with_trained_parameters():
  cht = methods.build(load_config('omniglot_t2', 'tiny'))
  constpn = methods.build(load_config('omniglot_constpn', '2,tiny'))
  assert type(constpn.cnn) is cnn_lib.CNN and constpn.cnn == cht.cnn  # One definition.
  params = constpn.init(jax.random.key(0))
  zeros = ht_lib.zeros_theta(cht.cnn, IMAGE_SHAPE)
  assert jax.tree.structure(params) == jax.tree.structure(zeros)
  jax.tree.map(lambda a, b: np.testing.assert_equal(a.shape, b.shape), params, zeros)

  # A generated theta_0 dropped into ConstPN gives CHT's prototypes of task 0.
  episode = make_episode(2, num_tasks=2, ways=3, shots=1)
  ht_params = cht.init(jax.random.key(1))
  thetas, prototypes = cht.thetas_and_prototypes(
      ht_params, episode['support_images'], episode['support_labels'])
  theta_0 = jax.tree.map(lambda x: x[0], thetas)
  const_thetas, const_prototypes = constpn.thetas_and_prototypes(
      theta_0, episode['support_images'], episode['support_labels'])
  np.testing.assert_allclose(const_prototypes[0], prototypes[0], rtol=1e-5, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[1], b), const_thetas, theta_0)


def test_constpn_trains_on_five_times_the_ways(images):
  config = load_config('omniglot_constpn', '2,tiny')
  spec = methods.build(config).training_spec()
  assert (spec.num_tasks, spec.ways) == (1, 5 * config.episode.ways)
  state, results = train_and_evaluate(config, images)
  assert results['num_tasks'] == 2 and len(results['table']['columns']) == 2
  # ConstPN has no memory: its task-incremental accuracy on a task does not depend
  # on t (the same theta and prototypes for every t).
  matrix = np.asarray(results['task_incremental']['mean'], float)
  np.testing.assert_allclose(matrix[1, 0], matrix[0, 0])
  assert jax.tree.structure(state.params) == jax.tree.structure(
      ht_lib.zeros_theta(methods.build(config).cnn, IMAGE_SHAPE))


# --------------------------------------------------------------------------
# Merged HT.
# --------------------------------------------------------------------------


def test_merge_tasks_labels_and_order():
  num_tasks, ways, shots = 3, 4, 2
  episode = make_episode(0, num_tasks=num_tasks, ways=ways, shots=shots)
  images, labels = merged_ht.merge_tasks(episode['support_images'], episode['support_labels'],
                                       ways)
  assert images.shape == (num_tasks * ways * shots, *IMAGE_SHAPE)
  expected = np.concatenate([tau * ways + np.repeat(np.arange(ways), shots)
                             for tau in range(num_tasks)])
  np.testing.assert_array_equal(labels, expected)
  np.testing.assert_array_equal(images[ways * shots:2 * ways * shots],
                                episode['support_images'][1])


def test_merged_ht_one_theta_and_merged_prototypes():
  config = load_config('omniglot_merged_ht', '2,tiny')
  merged = methods.build(config)
  assert merged.ht.num_ways == 2 * config.episode.ways
  params = merged.init(jax.random.key(0))
  episode = make_episode(3, num_tasks=2, ways=3, shots=1)
  thetas, prototypes = jax.jit(merged.thetas_and_prototypes)(
      params, episode['support_images'], episode['support_labels'])
  jax.tree.map(lambda x: np.testing.assert_array_equal(x[0], x[1]), thetas)
  images, labels = merged_ht.merge_tasks(episode['support_images'], episode['support_labels'], 3)
  theta = jax.tree.map(lambda x: x[0], thetas)
  embed = jax.jit(lambda images: merged.cnn.apply({'params': theta}, images))
  expected = losses.class_prototypes(embed(images), labels, 6)
  np.testing.assert_allclose(prototypes.reshape(6, -1), expected, rtol=1e-5, atol=1e-6)
  # The training loss: every task's queries over all K*T classes, under theta_{T-1}.
  loss, metrics = jax.jit(lambda p: merged.episode_loss(p, episode, 'class_incremental',
                                                        remat=False))(params)
  query_embeddings = jax.vmap(embed)(episode['query_images'])
  terms = [losses.cross_entropy_and_accuracy(
      losses.negative_squared_distances(query_embeddings[tau], expected),
      episode['query_labels'][tau] + 3 * tau)[0] for tau in range(2)]
  np.testing.assert_allclose(loss, sum(terms), rtol=1e-5)


def test_merged_ht_trains_and_evaluates(images):
  config = load_config('omniglot_merged_ht', '2,tiny')
  _, results = train_and_evaluate(config, images, steps=2)
  assert 'note' in results and results['num_tasks'] == 2
  protocol = evaluate.default_protocol(config, num_tasks=3, num_episodes=2)
  with pytest.raises(evaluate.EvaluationError, match='--eval_tasks <= 2'):
    evaluate.evaluate(config, None, protocol, class_images=np.asarray(images))


# --------------------------------------------------------------------------
# Cross-entropy (HT-CE, mini-batch arms): the head's logits score the task-incremental setting.
# --------------------------------------------------------------------------


def test_cross_entropy_arm_trains_and_scores_with_the_head(images):
  config = load_config('omniglot_minibatch', 'two_plus_two,tiny')
  config.model.num_blocks = 2  # The head's scores, not the depth: a faster compile.
  method = methods.build(config)
  assert method.task_incremental_score == 'cross_entropy'
  state, results = train_and_evaluate(config, images, steps=2)
  # Task specificity swaps the layers below the head: the head's labels are the task's own.
  assert results['task_specificity']['swap'].startswith('the layers below the head')
  # Reference: the head's argmax of theta_t on the queries of tau, for one episode.
  spec = evaluate.evaluation_spec(config, evaluate.default_protocol(config))
  from cht_jax.data import episodes  # pylint: disable=g-import-not-at-top
  # Each piece jitted: one program each, not one per operation.
  episode = jax.jit(lambda key: episodes.sample_evaluation_episode(key, images, spec, 1))(
      jax.random.key(5))
  pairs = continual.TaskPairs.lower_triangle(2)
  task_inc, _ = jax.jit(lambda p: method.episode_accuracies(p, episode, pairs))(state.params)
  thetas, _ = jax.jit(method.thetas_and_prototypes)(
      state.params, episode['support_images'], episode['support_labels'])
  head = jax.jit(lambda theta, images: method.cnn.apply({'params': theta}, images))
  for p, (t, tau) in enumerate(zip(pairs.t, pairs.tau)):
    logits = head(jax.tree.map(lambda x: x[t], thetas), episode['query_images'][0, tau])
    expected = np.mean(np.argmax(logits, -1) == episode['query_labels'][tau])
    np.testing.assert_allclose(task_inc[p], expected, atol=1e-6)
  assert results['table']['task_incremental']['mean'][0] is not None


# --------------------------------------------------------------------------
# launch/sweep.py
# --------------------------------------------------------------------------


def fake_result(workdir, method, step, trained_tasks=2, values=(0.9, 0.8)):
  """A result file shaped like reports.write_results'."""
  matrix = {'mean': [[values[0], None], [values[1], values[1]]],
            'ci95': [[0.01, None], [0.02, 0.02]]}
  result = {'method': method, 'num_tasks': 2, 'trained_tasks': trained_tasks, 'step': step,
            'episode': {'ways': 20, 'shots': 1},
            'protocol': {'num_episodes': 64},
            'config': {'data': {'dataset': 'omniglot'}, 'loss': 'class_incremental',
                       'model': {'channels': 8}},
            'task_incremental': matrix, 'class_incremental': matrix,
            'class_incremental_cumulative': matrix,
            'table': {'columns': ['0', '0-1'],
                      'class_incremental': {'mean': list(values), 'ci95': [0.01, 0.02]},
                      'task_incremental': {'mean': list(values), 'ci95': [0.01, 0.02]}}}
  os.makedirs(os.path.join(workdir, 'eval'), exist_ok=True)
  with open(os.path.join(workdir, 'eval', f'test_T2_step{step}.json'), 'w') as f:
    json.dump(result, f)


def test_sweep_collects_the_latest_results_into_one_table(tmp_path):
  fake_result(str(tmp_path / 'cht'), 'CHT', 10, values=(0.5, 0.4))
  fake_result(str(tmp_path / 'cht'), 'CHT', 200, values=(0.9, 0.8))  # The latest step wins.
  fake_result(str(tmp_path / 'constpn'), 'ConstPN', 100, values=(0.7, 0.6))
  fake_result(str(tmp_path / 'merged'), 'Merged HT', 100, values=(0.8, 0.7))
  records = sweep.collect([('cht', str(tmp_path / 'cht')), ('constpn', str(tmp_path / 'constpn')),
                           ('merged', str(tmp_path / 'merged')),
                           ('missing', str(tmp_path / 'missing'))])
  assert [r['run'] for r in records] == ['cht', 'constpn', 'merged'] and records[0]['step'] == 200
  star = reports.as_baseline(records[2]['result'])['table']
  assert star['class_incremental']['mean'] == [None, 0.7] and 'task_incremental' not in star
  paths = reports.write_sweep(records, str(tmp_path / 'table'))
  markdown = open(paths[0]).read()
  assert '| cht | CHT |' in markdown and '90.0 ± 1.0' in markdown and '60.0 ± 2.0' in markdown
  rows = open(paths[1]).read().splitlines()
  assert len(rows) == 4 and rows[0].startswith('run,method')
  assert os.path.getsize(str(tmp_path / 'table_omniglot.png')) > 0


def test_sweep_slurm_script_and_print(tmp_path, capsys):
  assert sweep.main(['--sweep=baselines', '--launcher=slurm', f'--root={tmp_path}',
                     '--only=cht,constpn', '--override=--config.train.num_steps=7',
                     '--eval_flag=--eval_episodes=64']) == 0
  script = open(tmp_path / 'submit_baselines.sh').read()
  assert script.count('launch/slurm.sbatch') == 4 and '--dependency=afterok:${job_cht}' in script
  assert 'configs/omniglot_constpn.py:2' in script and '--eval_episodes=64' in script
  assert sweep.main(['--sweep=minibatch', '--launcher=print', '--variant=tiny']) == 0
  out = capsys.readouterr().out
  assert 'configs/omniglot_minibatch.py:one_at_a_time,tiny' in out


def test_sweep_end_to_end_one_tiny_run(tmp_path, prepared_omniglot):
  """Trains and evaluates ConstPN (tiny, 2 steps) through main, then the table. One run
  proves the launcher: a table of several runs is tested on fake results above, and
  each method's training and evaluation in test_methods. ConstPN: its config takes an
  argument (T), which the launcher joins to the variant, and its processes compile in a
  fraction of CHT's time."""
  command = [sys.executable, 'launch/sweep.py', '--sweep=baselines', '--variant=tiny',
             '--only=constpn', f'--root={tmp_path}',
             f'--override=--config.data.data_dir={prepared_omniglot}',
             '--override=--config.train.num_steps=2', '--override=--config.train.eval_every_steps=0',
             '--eval_flag=--eval_episodes=2', '--eval_flag=--eval_query_draws=1',
             '--eval_flag=--eval_batch_size=2']
  result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  table = json.load(open(tmp_path / 'sweep_baselines.json'))
  assert [(r['run'], r['method'], r['step']) for r in table] == [('constpn', 'ConstPN', 2)]
  assert (tmp_path / 'sweep_baselines.md').exists()
  assert (tmp_path / 'sweep_baselines_omniglot.png').exists()


# --------------------------------------------------------------------------
# The tables of launch/fast_table1.py, launch/gpu_figure3.sh and launch/recipe_levers.sh.
# --------------------------------------------------------------------------


def test_fast_table1_records_the_commit_that_trained(tmp_path, monkeypatch):
  """A commit landing while the launcher trains is not the one its results.json names."""
  spec = importlib.util.spec_from_file_location(
      'fast_table1', os.path.join(os.path.dirname(os.path.dirname(__file__)),
                                  'launch', 'fast_table1.py'))
  launcher = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(launcher)
  workdir = tmp_path / 'run'
  table = {'columns': ['0'], 'class_incremental': {'mean': [0.5], 'ci95': [0.01]},
           'task_incremental': {'mean': [0.5], 'ci95': [0.01]}}

  def fake_run(command, timeout):
    if '--mode=eval' in command:
      os.makedirs(workdir / 'eval')
      json.dump({'step': 3, 'table': table, 'timing': {'device': 'cpu'}},
                open(workdir / 'eval' / 'test_T1_step3.json', 'w'))
    else:
      monkeypatch.setenv('CHT_COMMIT', 'landed-during-training')
    return 0, 1.0

  monkeypatch.setenv('CHT_COMMIT', 'trained')
  monkeypatch.setattr(launcher, '_run', fake_run)
  monkeypatch.setattr(sys, 'argv', ['fast_table1.py', f'--workdir={workdir}', '--',
                                    '--config=configs/omniglot_t2.py:tiny'])
  launcher.main()
  results = json.load(open(workdir / 'results.json'))
  assert (results['commit'], results['step']) == ('trained', 3)


def test_fast_table1_results_and_the_runs_table(tmp_path, capsys):
  summary = {'config': 'configs/omniglot_t2.py:fast', 'step': 2200, 'device': 'H200',
             'jax': '0.4.35', 'commit': 'abc1234', 'train_wall_seconds': 301.4,
             'eval_wall_seconds': 29.6,
             'table1': {'columns': ['0', '0-1'],
                        'class_incremental': {'mean': [95.04, 80.25], 'ci95': [0.31, 0.44]},
                        'task_incremental': {'mean': [95.04, 93.5], 'ci95': [0.31, 0.2]}},
             'task_specificity': {'own': 0.9504, 'swapped': 0.9502, 'difference': 0.0002,
                                  'ci95': 0.0014, 'num_pairs': 256}}
  os.makedirs(tmp_path / 't2')
  reports.write_fast_table1(str(tmp_path / 't2'), summary)
  assert open(tmp_path / 't2' / 'results.md').read().splitlines() == [
      'configs/omniglot_t2.py:fast, step 2200, H200, JAX 0.4.35, commit abc1234', '',
      '| accuracy (%) | 0 | 0-1 |', '|---|---|---|',
      '| class-incremental | 95.0 ± 0.3 | 80.2 ± 0.4 |',
      '| task-incremental | 95.0 ± 0.3 | 93.5 ± 0.2 |', '',
      'training 301 s, evaluation 30 s (wall clock, compilation and data loading included)',
      '', 'Task specificity (256 pairs of test tasks): own 95.0, swapped 95.0, own - swapped '
      '+0.02 ± 0.14 points']
  assert json.load(open(tmp_path / 't2' / 'results.json')) == summary
  # launch/gpu_figure3.sh's table.md: a run without results.json keeps its row.
  output = str(tmp_path / 'table.md')
  reports.main(['runs_table', f'--work={tmp_path}', '--runs=t1 t2', f'--output={output}'])
  expected = [
      '| run | steps | training s | evaluation s | class-incremental on 0 / 0-1 / ... |',
      '|---|---|---|---|---|',
      '| t1 | (no results) |  |  |  |',
      '| configs/omniglot_t2.py:fast | 2200 | 301 | 30 | 95.0 / 80.2 |']
  assert open(output).read() == '\n'.join(expected) + '\n'
  assert capsys.readouterr().out == '\n'.join(expected) + '\n'


def test_levers_table_and_figure_from_metrics(tmp_path):
  def metrics(name, validation, loss=3.14):
    os.makedirs(tmp_path / name)
    rows = [{'step': 1, 'split': 'train', 'train/loss': loss}]
    rows += [{'step': s, 'split': 'validation', 'validation/accuracy': a} for s, a in validation]
    with open(tmp_path / name / 'metrics.jsonl', 'w') as f:
      f.write(''.join(json.dumps(r) + '\n' for r in rows))
  metrics('fast', [(200, 0.25), (400, 0.5), (600, 0.6255)])
  metrics('adamw', [(200, 0.3), (400, 0.4)], loss=2.96)
  metrics('no_validation', [])  # Skipped: no validation accuracy yet.
  reports.main(['levers', f'--root={tmp_path}'])
  assert open(tmp_path / 'levers.md').read().splitlines() == [
      '| run | first logged loss | validation accuracy half way | at the end (step) |',
      '|---|---|---|---|',
      '| adamw | 3.0 | 0.400 | 0.400 (400) |',
      '| fast | 3.1 | 0.500 | 0.625 (600) |']
  assert os.path.getsize(tmp_path / 'levers.png') > 0
