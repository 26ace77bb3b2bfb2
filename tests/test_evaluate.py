"""Evaluation protocol, checkpoint restore, result files, figures and the library API."""

import csv
import functools
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from cht_jax import api
from cht_jax import continual
from cht_jax import evaluate
from cht_jax import methods
from cht_jax import optim
from cht_jax import plots
from cht_jax import reports
from cht_jax import train
from cht_jax.data import datasets
from cht_jax.data import episodes
from cht_jax.models import hypertransformer as ht_lib
from cht_jax.runtime import checkpoints
from cht_jax.runtime import devices
from cht_jax.runtime import preemption

from conftest import REPO_ROOT, class_images, tiny_config


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """A tiny model's TrainState, checkpointed with training's own manager at step 3.

  (Parameters from initialisation: compiling a training step would double the
  time of this file, and test_main covers the checkpoints training writes.)
  """
  config = tiny_config()
  optimizer = optim.make_optimizer(config.optim)
  state = train.make_init(methods.build(config), optimizer,
                          devices.data_mesh())(jax.random.key(0))
  state = state.replace(step=jnp.asarray(3, jnp.int32))
  workdir = str(tmp_path_factory.mktemp('trained'))
  save_checkpoint(workdir, config, state)
  return config, workdir, state.params


def save_checkpoint(workdir, config, state):
  manager = checkpoints.manager(workdir, config)
  manager.save(int(state.step), args=ocp.args.StandardSave(state))
  manager.wait_until_finished()
  manager.close()


def small_protocol(config, **overrides):
  # The same shapes everywhere: the compiled protocol is cached across tests.
  values = dict(num_episodes=4, num_query_draws=2, batch_size=2, num_tasks=3,
                specificity_pairs=4)
  values.update(overrides)
  return evaluate.default_protocol(config, **values)


# --------------------------------------------------------------------------
# Episodes of the protocol.
# --------------------------------------------------------------------------


def test_query_draws_never_touch_the_support_set():
  # Image m of class c is the constant c * 10 + m: its value names it.
  num_classes, num_images = 20, 10
  ids = np.arange(num_classes)[:, None] * 10 + np.arange(num_images)
  images = np.broadcast_to(ids[:, :, None, None, None], (num_classes, num_images, 2, 2, 1))
  spec = episodes.EpisodeSpec(num_tasks=3, ways=4, shots=2, queries_per_class=5)
  episode = jax.jit(lambda k: episodes.sample_evaluation_episode(
      k, jnp.asarray(images, jnp.uint8), spec, 6))(jax.random.key(0))
  decode = lambda x: np.rint((np.asarray(x)[..., 0, 0, 0] + 1) * 128).astype(int)
  support = decode(episode['support_images']).reshape(3, 4, 2)
  queries = decode(episode['query_images']).reshape(6, 3, 4, 5)
  assert episode['query_labels'].shape == (3, 20)
  np.testing.assert_array_equal(episode['query_labels'][0], np.repeat(np.arange(4), 5))
  class_ids = np.asarray(episode['class_ids'])
  assert len(np.unique(class_ids)) == 12  # Disjoint tasks.
  np.testing.assert_array_equal(support // 10, np.repeat(class_ids[..., None], 2, -1))
  np.testing.assert_array_equal(queries // 10, np.broadcast_to(class_ids[..., None], queries.shape))
  for t in range(3):
    for k in range(4):
      for r in range(6):
        assert len(set(queries[r, t, k])) == 5  # Distinct within a draw...
        assert not set(queries[r, t, k]) & set(support[t, k])  # ...never a support image.
  assert len({tuple(queries[r].ravel()) for r in range(6)}) == 6  # The draws differ.


# --------------------------------------------------------------------------
# The protocol.
# --------------------------------------------------------------------------


def test_episode_accuracies_match_the_training_computation(trained):
  config, _, params = trained
  method = methods.build(config)
  ht = method.ht
  spec = evaluate.evaluation_spec(config, small_protocol(config))
  episode = episodes.sample_evaluation_episode(
      jax.random.key(4), jnp.asarray(class_images(images_per_class=8)), spec, 2)
  pairs = continual.TaskPairs.lower_triangle(3)
  accuracies = jax.jit(
      lambda p, e, v: method.episode_accuracies(p, e, pairs, v), static_argnums=2)
  task_inc, class_inc = accuracies(params, episode, False)
  vec_task, vec_class = accuracies(params, episode, True)

  @jax.jit
  def reference(params, episode):  # The functions training uses, draw by draw.
    thetas, prototypes = continual.generate_thetas(
        ht, params, episode['support_images'], episode['support_labels'])
    expected = {'task_incremental': [], 'class_incremental': []}
    for r in range(2):
      embeddings = continual.embed_queries(ht.cnn, thetas, episode['query_images'][r], pairs)
      for loss in expected:
        expected[loss].append(continual.pair_losses(
            loss, embeddings, episode['query_labels'], prototypes, pairs)[1])
    return expected
  expected = reference(params, episode)
  for got, loss in ((task_inc, 'task_incremental'), (class_inc, 'class_incremental'),
                    (vec_task, 'task_incremental'), (vec_class, 'class_incremental')):
    np.testing.assert_allclose(got, np.mean(expected[loss], axis=0), atol=1e-6)
  assert task_inc.shape == (6,)


def test_task_specificity_own_is_the_protocols_task_0_and_a_fixed_cnn_scores_0(trained):
  config, _, params = trained
  images = class_images(images_per_class=8)
  protocol = small_protocol(config, num_tasks=2, num_episodes=6, specificity_pairs=8)
  method = methods.build(config)
  per_pair = evaluate.run_specificity(method, params, images, protocol)
  # Pair i is episode i of a T=2 protocol: A is task 0, written from its support alone.
  per_episode = evaluate.run_protocol(method, params, images, protocol)
  np.testing.assert_allclose(per_pair['own'], per_episode['task_incremental'][:, 0, 0],
                             atol=0.51 / (3 * config.episode.queries_per_class))
  summary = evaluate.summarize_specificity(per_pair)
  assert summary['num_pairs'] == 6 and summary['difference'] == pytest.approx(
      summary['own'] - summary['swapped'])
  assert summary['spread']['block_0/kernel'] > 0  # Written: different in every task.
  assert summary['spread']['block_0/scale'] == 0  # Trained, shared by every task.

  constpn = methods.build(tiny_config(method='constpn'))
  fixed = evaluate.summarize_specificity(evaluate.run_specificity(
      constpn, constpn.init(jax.random.key(0)), images, protocol))
  assert fixed['own'] == fixed['swapped'] and fixed['difference'] == 0.0
  assert set(fixed['spread'].values()) == {0.0}


def test_episode_i_depends_only_on_the_seed_and_i(trained):
  config, _, params = trained
  method = methods.build(config)
  images = class_images(images_per_class=8)
  results = []
  for num_episodes in (4, 3):  # The last batch of the second is padded.
    protocol = small_protocol(config, num_episodes=num_episodes)
    spec = evaluate.evaluation_spec(config, protocol)
    results.append(evaluate.run_protocol(method, params, images, protocol, spec))
  for name in ('task_incremental', 'class_incremental'):
    a, b = results[0][name], results[1][name]
    assert a.shape == (4, 3, 3) and b.shape == (3, 3, 3)
    np.testing.assert_array_equal(a[:3], b)
    assert not np.array_equal(a[0], a[1])
    assert np.isnan(a[:, 0, 1]).all() and np.isfinite(a[:, 1, 0]).all()
    assert ((a[:, 1, 0] >= 0) & (a[:, 1, 0] <= 1)).all()
  assert results[0]['timing']['episodes_per_second'] > 0
  # Task-incremental (K classes) is never harder than class-incremental (K*(t+1)).
  ti, ci = results[0]['task_incremental'], results[0]['class_incremental']
  assert (np.nan_to_num(ti) >= np.nan_to_num(ci)).all()


def test_too_few_classes_is_a_clear_error(trained):
  config, _, params = trained
  protocol = small_protocol(config, num_tasks=5)  # 15 classes, 12 in the split.
  with pytest.raises(evaluate.EvaluationError, match='--eval_tasks'):
    evaluate.evaluate(config, params, protocol, class_images=class_images(images_per_class=8))
  with pytest.raises(evaluate.EvaluationError, match='num_episodes'):
    small_protocol(config, num_episodes=0)


def test_training_classes_not_in_memory_is_a_clear_error(trained, monkeypatch):
  # The host pipeline (tieredImageNet's default) keeps only validation and test in memory.
  config, _, params = trained
  images = class_images(images_per_class=8)
  monkeypatch.setattr(datasets, 'load_dataset',
                      lambda config: {'validation': images, 'test': images})
  with pytest.raises(evaluate.EvaluationError, match='pipeline=device'):
    evaluate.evaluate(config, params, small_protocol(config, split='train'))


# --------------------------------------------------------------------------
# Checkpoints.
# --------------------------------------------------------------------------


def test_restore_reproduces_predictions_bit_for_bit(trained):
  config, workdir, params = trained
  restored, step = evaluate.restore_params(workdir, config)
  assert step == 3
  jax.tree.map(np.testing.assert_array_equal, restored, params)
  method = methods.build(config)
  protocol = small_protocol(config)
  spec = evaluate.evaluation_spec(config, protocol)
  images = class_images(images_per_class=8)
  before = evaluate.run_protocol(method, params, images, protocol, spec)
  after = evaluate.run_protocol(method, restored, images, protocol, spec)
  for name in ('task_incremental', 'class_incremental'):
    np.testing.assert_array_equal(before[name], after[name])
  # And through the library API: weights, prototypes, embeddings, labels.
  support = images[:3, 0]
  live = api.learn_task(api.model_from_params(config, params), support, np.arange(3))
  model = api.load_model(workdir, config)
  loaded = api.learn_task(model, support, np.arange(3))
  jax.tree.map(np.testing.assert_array_equal, loaded, live)
  queries = images[:3, 1:4].reshape(-1, 16, 16, 1)
  np.testing.assert_array_equal(api.embed(model, loaded.theta, queries),
                                api.embed(model, live.theta, queries))


def test_checkpoint_errors_are_clear(tmp_path, trained):
  config, workdir, _ = trained
  with pytest.raises(checkpoints.CheckpointError, match='No checkpoint.*--workdir'):
    evaluate.restore_params(str(tmp_path / 'empty'), config)
  with pytest.raises(checkpoints.CheckpointError, match=r'step 7.*\[3\]'):
    evaluate.restore_params(workdir, config, step=7)
  wider = tiny_config(**{'model.channels': 6})
  with pytest.raises(checkpoints.CheckpointError, match=r'does not fit.*params/.*config\.json'):
    evaluate.restore_params(workdir, wider)
  # Only the parameters must fit: another optimiser restores.
  params, _ = evaluate.restore_params(workdir, tiny_config(**{'optim.name': 'sgd'}))
  assert params is not None


def test_ctrl_c_stops_an_evaluation_between_batches_without_writing(trained, monkeypatch):
  """SIGINT (as SIGTERM: the same handler) after the first batch of two: one line about the
  evaluation, exit status 130, and no eval/ folder, result file or metrics row."""
  if threading.current_thread() is not threading.main_thread():
    pytest.skip('Signal handlers are installed from the main thread only.')
  config, workdir, _ = trained
  fetch = evaluate._fetch  # pylint: disable=protected-access

  def fetch_then_interrupt(outputs):
    signal.raise_signal(signal.SIGINT)  # Handled as the batch ends: Ctrl-C mid-batch.
    return fetch(outputs)
  monkeypatch.setattr(evaluate, '_fetch', fetch_then_interrupt)
  images = class_images(images_per_class=8)
  handler = signal.getsignal(signal.SIGINT)  # pytest-xdist's workers ignore SIGINT.
  with pytest.raises(preemption.Preempted) as stopped:
    evaluate.evaluate_checkpoint(  # small_protocol's shapes: compiled already.
        config, workdir, plot=False, dataset={'train': images, 'test': images},
        num_episodes=4, num_query_draws=2, batch_size=2, num_tasks=3)
  assert (stopped.value.label, stopped.value.exit_code) == ('Interrupted', 130)
  assert str(stopped.value) == ('Stopped by SIGINT during the evaluation, after 2 of 4 episodes; '
                                'no result file was written or changed. Rerun the same command '
                                'to evaluate.')
  assert not {'eval', 'metrics.jsonl'} & set(os.listdir(workdir))
  assert signal.getsignal(signal.SIGINT) is handler


_SAVE_ON_OTHER_DEVICES = """
import sys
import jax, numpy as np
from cht_jax import methods, optim, train
from conftest import tiny_config
from test_evaluate import save_checkpoint
config = tiny_config()
mesh = jax.sharding.Mesh(np.array(jax.devices()), ('data',))
state = train.make_init(methods.build(config), optim.make_optimizer(config.optim),
                        mesh)(jax.random.key(1))
save_checkpoint(sys.argv[1], config, state)
np.savez(sys.argv[2], *jax.tree.leaves(jax.device_get(state.params)))
print(len(jax.tree.leaves(state.params)[0].sharding.device_set))
"""


def test_a_checkpoint_of_other_devices_restores_on_these(tmp_path):
  # Saved replicated over one device more than this process has (as training on 8
  # GPUs, or on 2 CPU devices, and evaluating in a 1-device process).
  others = jax.device_count() + 1
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=f'{REPO_ROOT}:{REPO_ROOT / "tests"}',
             XLA_FLAGS=os.environ.get('XLA_FLAGS', '') +
             f' --xla_force_host_platform_device_count={others}')
  workdir, saved = tmp_path / 'run', tmp_path / 'params.npz'
  result = subprocess.run([sys.executable, '-c', _SAVE_ON_OTHER_DEVICES, str(workdir), str(saved)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert int(result.stdout.split()[-1]) == others
  params, step = evaluate.restore_params(str(workdir), tiny_config())
  assert step == 0
  expected = np.load(saved)
  for i, leaf in enumerate(jax.tree.leaves(params)):
    np.testing.assert_array_equal(leaf, expected[f'arr_{i}'])
    assert leaf.sharding.device_set == set(jax.devices())
  model = api.load_model(str(workdir), tiny_config())
  api.learn_task(model, class_images(images_per_class=1)[:3, 0], np.arange(3))


# --------------------------------------------------------------------------
# Result files and figures.
# --------------------------------------------------------------------------


def test_every_report_file_for_a_tiny_model(tmp_path, trained):
  config, workdir, params = trained
  protocol = small_protocol(config)
  results = evaluate.evaluate(config, params, protocol, class_images=class_images(images_per_class=8))
  results.update(method='CHT', workdir=workdir, step=3)
  prefix = reports.result_prefix(str(tmp_path), protocol, 3)
  assert prefix.endswith(os.path.join('eval', 'test_T3_step3'))
  paths = reports.write_results(results, prefix)
  assert [os.path.splitext(p)[1] for p in paths] == ['.json', '.csv', '.md', '.png']
  assert all(os.path.getsize(p) > 0 for p in paths)

  with open(paths[0]) as f:
    saved = json.load(f)
  assert saved['num_tasks'] == 3 and saved['trained_tasks'] == 2
  assert saved['protocol']['num_query_draws'] == 2
  assert saved['task_incremental']['mean'][0][1] is None  # Above the diagonal.
  assert saved['table']['columns'] == ['0', '0-1', '0-2']
  ci_table = saved['table']['class_incremental']['mean']
  cumulative = saved['class_incremental_cumulative']['mean']
  assert ci_table == pytest.approx([cumulative[t][t] for t in range(3)])
  summaries = saved['summaries']
  assert summaries['evaluated']['num_tasks'] == 3 and summaries['trained']['num_tasks'] == 2
  assert summaries['evaluated']['class_incremental']['average_accuracy'] == pytest.approx(
      ci_table[2])

  with open(paths[1]) as f:
    rows = list(csv.DictReader(f))
  assert len(rows) == 3 * 6  # Three matrices, T(T+1)/2 entries each.
  extrapolated = {(r['matrix'], r['theta'], r['task']): r['extrapolated'] for r in rows}
  assert extrapolated[('task_incremental', '2', '0')] == '1'
  assert extrapolated[('task_incremental', '1', '1')] == '0'
  assert {r['task_name'] for r in rows if r['matrix'].endswith('cumulative')} == {
      '0', '0-1', '0-2'}

  with open(paths[2]) as f:
    markdown = f.read()
  assert '| Method | 0 | 0-1 | 0-2 |' in markdown
  assert '| CHT (T=2) |' in markdown and '†' in markdown
  assert 'Forgetting' in markdown
  specificity = saved['task_specificity']
  assert specificity['num_pairs'] == 4 and {'own', 'swapped', 'difference', 'ci95'} <= set(
      specificity)
  assert '## Task specificity' in markdown and '| own - swapped |' in markdown[
      markdown.index('## Task specificity'):]


def test_figure_from_several_results_with_baselines(tmp_path, trained):
  config, _, params = trained
  files = []
  for trained_tasks in (1, 2):
    results = evaluate.evaluate(tiny_config(**{'episode.num_tasks': trained_tasks}), params,
                                small_protocol(config),
                                class_images=class_images(images_per_class=8))
    files.append(reports.write_results(results, str(tmp_path / f't{trained_tasks}'),
                                        plot=False)[0])
  baseline = tmp_path / 'constpn.json'
  baseline.write_text(json.dumps({'method': 'ConstPN', 'table': {
      'task_incremental': {'mean': [0.5, 0.5, 0.5]},
      'class_incremental': {'mean': [0.5, 0.3, 0.2]}}}))
  output = tmp_path / 'figure.png'
  command = [sys.executable, '-m', 'cht_jax.plots', f'--results={",".join(files)}',
             f'--baselines={baseline}', f'--output={output}']
  result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert output.stat().st_size > 10_000


def test_embedding_report(tmp_path, trained):
  config, _, params = trained
  protocol = small_protocol(config)
  path = evaluate.embedding_report(config, params, protocol, str(tmp_path / 'pca.png'), 'pca',
                                   class_images=class_images(images_per_class=8))
  assert os.path.getsize(path) > 10_000
  umap_path = evaluate.embedding_report(config, params, protocol, str(tmp_path / 'umap.png'),
                                        'umap', class_images=class_images(images_per_class=8))
  try:
    import umap  # pylint: disable=g-import-not-at-top,unused-import
    assert umap_path and os.path.exists(umap_path)
  except ImportError:
    assert umap_path is None  # Skipped with a warning: umap-learn is optional.


def test_procrustes_alignment_undoes_a_similarity_map():
  rng = np.random.default_rng(0)
  target = rng.normal(size=(10, 2))
  angle = 0.7
  rotation = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
  moved = 2.5 * target @ rotation + np.array([3.0, -1.0])
  aligned = plots.procrustes_align(moved, moved[:4], target[:4])  # Four anchors suffice.
  np.testing.assert_allclose(aligned, target, atol=1e-9)


# --------------------------------------------------------------------------
# Library API.
# --------------------------------------------------------------------------


def test_api_learns_task_by_task_like_the_scan(trained):
  config, _, params = trained
  model = api.model_from_params(config, params)
  spec = evaluate.evaluation_spec(config, small_protocol(config))
  episode = episodes.sample_evaluation_episode(
      jax.random.key(2), jnp.asarray(class_images(images_per_class=8)), spec, 1)
  thetas, prototypes = continual.generate_thetas(
      model.ht, params, episode['support_images'], episode['support_labels'])
  theta, protos = None, None
  for t in range(3):
    theta, protos = api.learn_task(model, episode['support_images'][t],
                                   episode['support_labels'][t], theta, protos)
  assert protos.shape == prototypes.shape
  np.testing.assert_allclose(protos, prototypes, rtol=1e-5, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b[-1], rtol=1e-5, atol=1e-5),
               theta, thetas)

  queries = episode['query_images'][0, 1]  # Task 1, labels 0..K-1.
  labels = api.classify(model, theta, protos, queries, task=1)
  assert labels.shape == (6,) and labels.dtype == jnp.int32
  tasks, labels = api.classify(model, theta, protos, queries)
  assert tasks.shape == labels.shape == (6,)
  assert int(tasks.max()) <= 2 and int(labels.max()) <= 2


def test_api_generator_compiles_the_parameters_in(trained):
  config, _, params = trained
  model = api.model_from_params(config, params)
  images = jnp.asarray(class_images(images_per_class=8)[:3, :2].reshape(6, 16, 16, 1),
                       jnp.float32) / 128 - 1
  labels = jnp.arange(6) // 2
  theta_prev = jax.tree.map(lambda leaf: leaf + 0.1, ht_lib.zeros_theta(model.ht.cnn, (16, 16, 1)))
  stablehlo = model.generate.lower(images, labels, theta_prev).as_text()
  signature = stablehlo[stablehlo.index('@main('):]
  num_arguments = signature[:signature.index('{')].count('%arg')
  # The support set and theta_{t-1}'s leaves (those used), not the parameters.
  assert 2 <= num_arguments <= 2 + len(jax.tree.leaves(theta_prev)) < len(jax.tree.leaves(params))
  theta, prototypes = model.generate(images, labels, theta_prev)
  expected_theta, expected_prototypes = jax.jit(functools.partial(
      continual.generate_task, model.ht))(params, images, labels, theta_prev)
  np.testing.assert_allclose(prototypes, expected_prototypes, rtol=1e-5, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
               theta, expected_theta)


def test_api_errors_name_the_problem(trained):
  config, _, params = trained
  model = api.model_from_params(config, params)
  images = class_images(images_per_class=8)[:3, 0]
  with pytest.raises(ValueError, match=r'\[N, 16, 16, 1\]'):
    api.learn_task(model, np.zeros((3, 28, 28, 1), np.uint8), np.arange(3))
  with pytest.raises(ValueError, match=r'0\.\.2'):
    api.learn_task(model, images, np.array([0, 1, 5]))
  theta, protos = api.learn_task(model, images, np.arange(3))
  with pytest.raises(ValueError, match='both'):
    api.learn_task(model, images, np.arange(3), theta=theta)
  with pytest.raises(ValueError, match='task must be in 0..0'):
    api.classify(model, theta, protos, images, task=1)


# --------------------------------------------------------------------------
# End to end: python -m cht_jax.main --mode=eval on real Omniglot.
# --------------------------------------------------------------------------


def eval_command(workdir, data_dir, *flags):
  return [sys.executable, '-m', 'cht_jax.main', '--mode=eval',
          '--config=configs/omniglot_t2.py:tiny', f'--workdir={workdir}',
          f'--config.data.data_dir={data_dir}', *flags]


def run_eval(workdir, data_dir, *flags):
  return subprocess.run(eval_command(workdir, data_dir, *flags), cwd=REPO_ROOT,
                        capture_output=True, text=True, timeout=600)


def signal_eval(signum, workdir, data_dir, *flags):
  """(exit status, stderr) of an evaluation sent `signum` once it logs that it evaluates."""
  process = subprocess.Popen(eval_command(workdir, data_dir, *flags), cwd=REPO_ROOT,
                             stderr=subprocess.PIPE, text=True)
  lines = []
  for line in process.stderr:
    lines.append(line)
    if 'Evaluating ' in line:
      process.send_signal(signum)
      break
  lines.append(process.communicate(timeout=600)[1])
  return process.returncode, ''.join(lines)


def _example(name):
  """The module examples/<name>.py or diagnostics/<name>.py (scripts, not packages)."""
  path = REPO_ROOT / 'examples' / f'{name}.py'
  path = path if path.exists() else REPO_ROOT / 'diagnostics' / f'{name}.py'
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_main_eval_end_to_end(tmp_path, prepared_omniglot, trained):
  config, _, params = trained
  workdir = str(tmp_path / 'work')
  # A bad flag is named as the flags are parsed, before anything is restored or made.
  result = run_eval(workdir, prepared_omniglot, '--eval_episodes=-1', '--eval_queries_per_class=0')
  assert result.returncode == 1
  assert 'flag --eval_episodes=-1: -1 is not a positive integer' in result.stderr
  assert 'Traceback' not in result.stderr
  assert not os.path.exists(workdir)
  # No checkpoint is one line too (its message: test_checkpoint_errors_are_clear).
  assert issubclass(checkpoints.CheckpointError, train.USER_ERRORS)

  optimizer = optim.make_optimizer(config.optim)
  for step in (2, 4):
    save_checkpoint(workdir, config, train.TrainState(
        step=jnp.asarray(step, jnp.int32), params=params, opt_state=optimizer.init(params)))
  flags = ('--eval_tasks=3', '--eval_episodes=6', '--eval_query_draws=2', '--eval_batch_size=4',
           '--checkpoint_step=2')
  # SIGTERM (a preemption) stops it in one line, without results or an empty eval/.
  status, stderr = signal_eval(signal.SIGTERM, workdir, prepared_omniglot, *flags)
  assert status == 143, stderr[-3000:]
  assert re.search(r'\nPreempted: Stopped by SIGTERM during the evaluation, after [0-9] of 6 '
                   r'episodes; no result file was written or changed\. Rerun the same command '
                   r'to evaluate\.\n$', stderr), stderr[-3000:]
  assert sorted(os.listdir(workdir)) == ['checkpoints']
  result = run_eval(workdir, prepared_omniglot, *flags)  # The same command.
  assert result.returncode == 0, result.stderr[-3000:]
  assert re.search(r'Evaluated 6/6 episodes, [0-9.]+ s, [0-9.e+-]+ episodes/s, 0 s left',
                   result.stderr), result.stderr[-3000:]
  prefix = os.path.join(workdir, 'eval', 'test_T3_step2')
  for ext in ('.json', '.csv', '.md', '.png'):
    assert os.path.getsize(prefix + ext) > 0
  with open(prefix + '.json') as f:
    saved = json.load(f)
  assert saved['step'] == 2 and saved['num_episodes'] == 6
  assert saved['episode']['ways'] == 3 and saved['episode']['num_tasks'] == 3
  assert saved['config']['episode']['num_tasks'] == 2
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  assert any(r['split'] == 'eval_test_T3' and r['step'] == 2 for r in rows)
  # The same protocol on the training classes (the generalisation gap; in this process,
  # as main passes --eval_split on).
  evaluate.evaluate_checkpoint(tiny_config(**{'data.data_dir': prepared_omniglot}), workdir,
                               step=2, plot=False, num_tasks=3, num_episodes=6,
                               num_query_draws=2, batch_size=4, split='train')
  with open(os.path.join(workdir, 'eval', 'train_T3_step2.json')) as f:
    on_train = json.load(f)
  assert on_train['protocol']['split'] == 'train'
  assert on_train['class_incremental'] != saved['class_incremental']

  # The example script on Omniglot test classes, with the config training saves.
  with pytest.raises(FileNotFoundError, match='config.json'):
    api.load_model(workdir)
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(tiny_config(**{'data.data_dir': prepared_omniglot}).to_json_best_effort())
  model = api.load_model(workdir)
  assert model.step == 4 and model.num_ways == 3
  example = _example('generate_weights')
  test_images = datasets.load_dataset(api.load_config(workdir))['test']
  lines = []
  history = example.run(model, test_images, shots=1, num_tasks=3, queries_per_class=4,
                        seed=0, log=lines.append)
  assert len(history) == 3 and set(history[2]) >= {'task_0', 'task_2', 'class_incremental'}
  assert all(0 <= v <= 1 for v in history[2].values() if v != history[2]['seconds'])
  assert 'class-incremental on tasks 0..2' in lines[-1]

  # The task-specificity diagnostic on the same model.
  diagnostic = _example('task_specificity')
  result = diagnostic.run(api.load_config(workdir), model.params, test_images, num_pairs=3,
                          queries_per_class=4, seed=0)
  assert result['num_pairs'] == 3 and 0 <= result['own'] <= 1 and 0 <= result['swapped'] <= 1
  np.testing.assert_allclose(result['difference'], result['own'] - result['swapped'], atol=1e-12)
  # BatchNorm's scale is a parameter, not generated: the same for every task. The
  # kernels are generated from the support set.
  assert result['spread']['block_0/scale'] == 0
  assert result['spread']['block_0/kernel'] > 0
  # Its prototypes are those learn_task returns: the own accuracy is the usual one.
  (support, labels, queries, query_labels), = example.make_tasks(test_images, 1, 3, 1, 4, 5)
  theta, prototypes = api.learn_task(model, support, labels)
  usual = np.mean(np.asarray(api.classify(model, theta, prototypes, queries, task=0))
                  == query_labels)
  assert diagnostic.accuracy_with(model, theta, support, labels, queries, query_labels) == usual
  # Where the weight tokens look: one row per generated layer and encoder layer.
  stats = diagnostic.attention(model, test_images, shots=1, num_tasks=4, seed=0)
  assert set(stats) == {f'{layer}/layer_0' for layer in
                        ('block_0', 'block_1', 'block_2', 'block_3', 'head')}
  for s in stats.values():
    assert 0 < s['on_support'] < 1 and 0 < s['entropy'] <= 1
    assert 1 / 3 <= s['top'] <= 1 and 1 / 3 <= s['same_label'] <= 1  # S = K = 3.
    assert 1 / 3 < s['same_label_chance'] < 1


def test_adaptation_headroom_trains_only_the_named_arrays(trained):
  config, _, params = trained
  headroom = _example('adaptation_headroom')
  model = api.model_from_params(config, params)
  test_images = class_images()
  (support, labels, _, _), = headroom.generate_weights.make_tasks(test_images, 1, 3, 1, 1, 0)
  theta = api.learn_task(model, support, labels).theta
  images = api.preprocess(model, test_images[:3, :4].reshape(12, 16, 16, 1)).reshape(
      3, 4, 16, 16, 1)  # [K, N, H, W, C]
  adapted, losses = headroom.adapt(model, theta, images, headroom.PARTS['head'], steps=10,
                                   learning_rate=1e-2)
  assert losses[-1] < losses[0]
  for path, before in jax.tree_util.tree_flatten_with_path(theta)[0]:
    after = adapted
    for key in path:
      after = after[key.key]
    changed = not np.array_equal(np.asarray(before), np.asarray(after))
    assert changed == jax.tree_util.keystr(path, simple=True, separator='/').startswith('head/')
  result = headroom.run(model, test_images, num_tasks=2, adapt_shots=3, queries_per_class=2,
                        adapt_steps=2, learning_rate=1e-3, seed=0)
  assert set(result) == {'generated', 'generated_n_shot', 'adapted_all', 'adapted_head',
                         'adapted_conv_kernels'}
  assert all(0 <= r['mean'] <= 1 for r in result.values())
  assert result['generated_n_shot']['gain'] == 0
  # One compilation per part (plus the 10-step one above), not one per task.
  assert headroom._adapt._cache_size() == 1 + len(headroom.PARTS)  # pylint: disable=protected-access


def test_conditioning_toy_tasks_hide_the_relevant_plane_from_the_queries():
  toy = _example('conditioning_toy')
  support, queries, query_labels, relevant = toy.make_tasks(
      jax.random.key(0), num_tasks=6, ways=4, queries_per_class=3, image_size=8, planes=3,
      noise=0.0)
  assert support.shape == (6, 4, 8, 8, 3) and queries.shape == (6, 12, 8, 8, 3)
  values = np.linspace(-1, 1, 4)
  for i, r in enumerate(np.asarray(relevant)):
    # The checkerboard (the cue) is on plane r of the support images only.
    support_r = np.asarray(support[i, :, :, :, r])
    assert np.allclose(np.abs(support_r - support_r.mean((1, 2), keepdims=True)), 0.5)
    assert np.ptp(np.asarray(queries[i]), axis=(1, 2)).max() == 0
    class_value = support_r.mean((1, 2))
    np.testing.assert_allclose(np.sort(class_value), values, atol=1e-6)  # one per class
    # A query's plane r holds its class's value; the other planes one of the K values.
    np.testing.assert_allclose(np.asarray(queries[i, :, 0, 0, r]),
                               class_value[np.asarray(query_labels[i])], atol=1e-6)
    others = np.delete(np.asarray(queries[i, :, 0, 0]), r, axis=-1)
    assert np.all(np.min(np.abs(others[..., None] - values), -1) < 1e-6)


def test_the_hypertransformer_learns_a_cnn_that_depends_on_the_support_set():
  # The toy's tasks need a CNN written from the support set: a fixed one scored 47-52% and
  # the HyperTransformer 82-94% after 600 steps over three seeds (5-way; the CNN written
  # for another task: 18-21%, chance). A generator that ignored its support set, or could
  # not see the cue, would score as the fixed CNN.
  toy = _example('conditioning_toy')
  result = toy.run(tiny_config(), ways=5, planes=3, steps=600, batch=8, eval_tasks=128, seed=0)
  own, swapped = result['hypertransformer']['mean'], result['hypertransformer_swapped']['mean']
  assert own > result['fixed_cnn']['mean'] + 0.15, result
  assert own > swapped + 0.3, result
  # The evaluation's own measure (over every pair, same plane or not) sees it too.
  specificity = result['task_specificity']
  assert specificity['own'] == pytest.approx(own)
  assert specificity['difference'] - specificity['ci95'] > 0.2, specificity
  assert result['fixed_cnn']['mean'] > result['chance'] + 0.1, result  # the control learned
