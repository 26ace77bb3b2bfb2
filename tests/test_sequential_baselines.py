"""Table 1 baselines (cht_jax/methods): EWC, fine-tuning, MAML++ and
their shared scan, trained and evaluated by the one trainer and protocol."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cht_jax import config_validation
from cht_jax import evaluate
from cht_jax import methods
from cht_jax import train
from cht_jax.methods import ewc
from cht_jax.methods import finetune
from cht_jax.methods import maml
from cht_jax.methods import sequential
from cht_jax.models import cnn as cnn_lib
from conftest import class_images, normal

# A CNN without conv blocks is a linear softmax classifier: logits = flatten(x) W + b.
LINEAR = cnn_lib.CNN(channels=(), embedding_dim=4)  # 2 tasks of 2 classes.
SMALL = cnn_lib.CNN(channels=(2,), embedding_dim=6)  # One conv block, 3 tasks of 2 classes.


def small_theta(key=0):
  return SMALL.init(jax.random.key(key), jnp.zeros((1, 4, 4, 1)))['params']


def small_task(key, num_tasks=3, ways=2, shots=2):
  images = normal(key, (num_tasks, ways * shots, 4, 4, 1))
  labels = jnp.tile(jnp.repeat(jnp.arange(ways), shots), (num_tasks, 1))
  return images, labels


def assert_trees_close(a, b, **kwargs):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, **kwargs), a, b)


def test_worktree_package_is_imported():
  assert os.path.dirname(sequential.__file__).startswith(
      os.path.join(os.path.dirname(os.path.dirname(__file__)), 'cht_jax'))


# --------------------------------------------------------------------------
# EWC.
# --------------------------------------------------------------------------


def test_ewc_penalty_hand_computed():
  theta = {'a': jnp.array([1.0, 2.0]), 'b': jnp.array([[3.0]])}
  fishers = {'a': jnp.array([[1.0, 0.5], [2.0, 0.0]]), 'b': jnp.array([[[1.0]], [[0.0]]])}
  anchors = {'a': jnp.array([[0.0, 0.0], [1.0, 1.0]]), 'b': jnp.array([[[1.0]], [[5.0]]])}
  # Task 0: 1*(1-0)^2 + 0.5*(2-0)^2 + 1*(3-1)^2 = 7; task 1: 2*(1-1)^2 + 0 + 0 = 0.
  np.testing.assert_allclose(ewc.penalty(theta, fishers, anchors, ewc_lambda=2.0), 7.0)
  np.testing.assert_allclose(ewc.penalty(theta, fishers, anchors, ewc_lambda=0.0), 0.0)
  # Its gradient is lambda * sum_tau F_tau (theta - theta*_tau).
  grads = jax.grad(ewc.penalty)(theta, fishers, anchors, 2.0)
  np.testing.assert_allclose(grads['a'], 2.0 * np.array([1.0 * 1 + 2.0 * 0, 0.5 * 2 + 0]))
  np.testing.assert_allclose(grads['b'], [[2.0 * 2.0]])


@pytest.mark.parametrize('kind', ewc.FISHERS)
def test_fisher_diagonal_matches_per_sample_brute_force(kind):
  theta = small_theta()
  images, labels = small_task(3)
  images, t = images[1], 1  # Task 1 of 3: classes of task 2 are unseen (probability 0).
  log_probs = lambda th: sequential.seen_log_probs(SMALL, th, images, t, ways=2)
  targets = t * 2 + labels[1]
  fisher = jax.jit(lambda th: ewc.fisher_diagonal(log_probs, th, targets, kind))(theta)
  probs = np.exp(np.asarray(log_probs(theta)))
  expected = jax.tree.map(np.zeros_like, theta)
  for n in range(len(images)):
    outputs = [int(targets[n])] if kind == 'empirical' else range(probs.shape[1])
    for m in outputs:
      weight = 1.0 if kind == 'empirical' else probs[n, m]
      grad = jax.grad(lambda th: log_probs(th)[n, m])(theta)
      expected = jax.tree.map(lambda e, g: e + weight * np.square(g) / len(images),
                              expected, grad)
  assert_trees_close(fisher, expected, rtol=2e-4, atol=1e-7)
  assert float(np.sum(probs[:, 4:])) == 0.0


def test_ewc_rule_records_fisher_and_anchor():
  theta = small_theta()
  images, labels = small_task(4)
  rule = ewc.ewc_rule(SMALL, ways=2, num_steps=2, learning_rate=0.1, ewc_lambda=5.0)
  state = ewc.init_state(theta, num_tasks=3)
  theta_0, (fishers, anchors), _ = rule(theta, state, images[0], labels[0], 0)
  assert_trees_close(jax.tree.map(lambda a: a[0], anchors), theta_0)
  for later in (1, 2):
    assert all(float(jnp.abs(f[later]).sum()) == 0 for f in jax.tree.leaves(fishers))
  assert sum(float(f[0].sum()) for f in jax.tree.leaves(fishers)) > 0


# --------------------------------------------------------------------------
# Fine-tuning and the scan over tasks.
# --------------------------------------------------------------------------


@pytest.mark.parametrize('t', [0, 1])
def test_finetune_step_hand_computed(t):
  # Linear classifier, zero weights: p is uniform over the seen classes.
  x = np.array([[1.0, 2.0], [3.0, -1.0]])  # Two 1x1x2 images.
  labels = np.array([0, 1])
  theta = {'head': {'kernel': jnp.zeros((2, 4)), 'bias': jnp.zeros(4)}}
  seen = 2 * (t + 1)
  p = np.zeros((2, 4))
  p[:, :seen] = 1.0 / seen
  one_hot = np.eye(4)[t * 2 + labels]
  lr = 0.5
  kernel = -lr * x.T @ (p - one_hot) / 2
  bias = -lr * (p - one_hot).mean(axis=0)
  update = finetune.finetune_rule(LINEAR, ways=2, num_steps=1, learning_rate=lr)
  new, state, _ = update(theta, (), jnp.asarray(x).reshape(2, 1, 1, 2), jnp.asarray(labels), t)
  np.testing.assert_allclose(new['head']['kernel'], kernel, rtol=1e-6)
  np.testing.assert_allclose(new['head']['bias'], bias, rtol=1e-6, atol=1e-8)
  assert state == ()
  if t == 0:  # Outputs of the unseen task 1 are untouched.
    np.testing.assert_array_equal(new['head']['kernel'][:, 2:], 0.0)


def test_sgd_steps_with_per_leaf_per_step_rates_and_first_order():
  loss = lambda th: 0.5 * (th['a'] ** 2 + th['b'] ** 2)
  theta = {'a': jnp.array(1.0), 'b': jnp.array(2.0)}
  rates = {'a': jnp.array([0.5, 0.5]), 'b': jnp.array([1.0, 0.0])}
  final, steps = sequential.sgd_steps(loss, theta, rates, 2)
  np.testing.assert_allclose([final['a'], final['b']], [0.25, 0.0])
  np.testing.assert_allclose(steps['a'], [0.5, 0.25])
  np.testing.assert_allclose(steps['b'], [0.0, 0.0])
  # d a_2 / d a_0: (1 - 0.5)^2 through the gradients, 1 with them stopped.
  for first_order, expected in ((False, 0.25), (True, 1.0)):
    grad = jax.grad(lambda a: sequential.sgd_steps(
        loss, {'a': a, 'b': jnp.array(2.0)}, rates, 2, first_order)[0]['a'])(1.0)
    np.testing.assert_allclose(grad, expected)


def test_scan_over_tasks_equals_a_python_loop():
  theta = small_theta(1)
  images, labels = small_task(5)
  rule = ewc.ewc_rule(SMALL, ways=2, num_steps=2, learning_rate=0.2, ewc_lambda=10.0)
  scanned = jax.jit(lambda: sequential.run_sequence(
      rule, theta, ewc.init_state(theta, 3), images, labels))()
  current, state = theta, ewc.init_state(theta, 3)
  for t in range(3):
    current, state, _ = rule(current, state, images[t], labels[t], t)
    assert_trees_close(jax.tree.map(lambda leaf: leaf[t], scanned), current,
                       rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------
# The K*T head: task- and class-incremental accuracy.
# --------------------------------------------------------------------------


def test_task_and_class_incremental_indexing_of_the_head():
  # 3 tasks of 2 classes; queries of task 1 (targets 2 + label).
  logits = jnp.array([[0.0, 0.0, 1.0, 0.5, 9.0, 0.0],   # label 0: best of task 1 is output 2.
                      [5.0, 0.0, 0.0, 1.0, 0.0, 0.0]])  # label 1: best of task 1 is output 3.
  labels = jnp.array([0, 1])
  task_1, class_1 = sequential.pair_accuracies(logits, labels, t=1, tau=1, ways=2)
  task_2, class_2 = sequential.pair_accuracies(logits, labels, t=2, tau=1, ways=2)
  assert float(task_1) == float(task_2) == 1.0  # Only task 1's outputs compete.
  assert float(class_1) == 0.5  # Outputs 0..3: row 0 right (2), row 1 wrong (0).
  assert float(class_2) == 0.0  # Outputs 0..5: row 0 now picks 4.
  np.testing.assert_array_equal(sequential.seen_classes_mask(0, 6, 2), [1, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(sequential.task_classes_mask(2, 6, 2), [0, 0, 0, 0, 1, 1])


def test_fresh_head_keeps_the_conv_blocks():
  theta = small_theta()
  new = finetune.fresh_head(theta, 10, 'zeros')
  assert new['head']['kernel'].shape == (theta['head']['kernel'].shape[0], 10)
  np.testing.assert_array_equal(new['head']['kernel'], 0.0)
  assert_trees_close(new['block_0'], theta['block_0'])
  glorot = finetune.fresh_head(theta, 10, 'glorot', jax.random.key(0))
  assert float(jnp.abs(glorot['head']['kernel']).sum()) > 0


# --------------------------------------------------------------------------
# MAML++.
# --------------------------------------------------------------------------


def test_multi_step_loss_weights():
  np.testing.assert_allclose(maml.multi_step_weights(0, 5, 10), [0.2] * 5)
  np.testing.assert_allclose(maml.multi_step_weights(5, 5, 10), [0.1] * 4 + [0.6], rtol=1e-6)
  np.testing.assert_allclose(maml.multi_step_weights(10, 5, 10), [0, 0, 0, 0, 1])
  np.testing.assert_allclose(maml.multi_step_weights(9, 5, 10), [0.02] * 4 + [0.92], rtol=1e-5)
  late = maml.multi_step_weights(99, 5, 100)  # 0.2 * (1 - 99/100) is below MAML++'s floor.
  np.testing.assert_allclose(late, [0.006] * 4 + [0.976], rtol=1e-5)


def test_maml_loss_is_the_final_step_without_multi_step_weights():
  cnn = cnn_lib.CNN(channels=(2,), embedding_dim=4)  # 2 tasks of 2 classes.
  theta = cnn.init(jax.random.key(0), jnp.zeros((1, 4, 4, 1)))['params']
  params = maml.init_params(theta, num_steps=2, inner_learning_rate=0.1)
  images, labels = small_task(6, num_tasks=2)
  queries, query_labels = small_task(7, num_tasks=2)
  episode = {'support_images': images, 'support_labels': labels,
             'query_images': queries, 'query_labels': query_labels}

  @jax.jit
  def losses_and_grads(params):
    final = lambda p: maml.episode_loss(cnn, p, episode, ways=2, num_steps=2)[0]
    weighted = maml.episode_loss(cnn, params, episode, 2, 2, jnp.array([0.0, 1.0]))[0]
    return final(params), weighted, jax.grad(final)(params)  # Second order.

  final, one_hot_last, grads = losses_and_grads(params)
  np.testing.assert_allclose(final, one_hot_last, rtol=1e-5)
  assert all(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(grads['lslr']))


def test_maml_cannot_extrapolate_its_head():
  config = tiny_baseline_config('maml')
  protocol = evaluate.default_protocol(config, num_tasks=3, num_episodes=2)
  with pytest.raises(evaluate.EvaluationError, match='--eval_tasks <= 2'):
    evaluate.evaluate(config, None, protocol, class_images=class_images(9))
  with pytest.raises(ValueError, match='head for T=2'):
    methods.build(config).sequence_learner(None, num_tasks=3)


# --------------------------------------------------------------------------
# End to end: train a few steps, checkpoint, evaluate, write the results.
# --------------------------------------------------------------------------


def tiny_baseline_config(method):
  from configs import baselines_table1  # pylint: disable=g-import-not-at-top
  return baselines_table1.get_config(f'{method},2,tiny')  # 3-way 1-shot, 16x16, 4 steps.


@pytest.mark.parametrize('method', ('finetune', 'ewc', 'maml'))
def test_trains_and_evaluates_end_to_end(method, tmp_path):
  config = tiny_baseline_config(method)
  # One compiled step each (CPU time): MAML++ first order with the multi-step loss
  # throughout (second order is checked above); validation only with EWC.
  config.baseline.maml_first_order_steps = config.baseline.maml_msl_anneal_steps = 4
  config.train.eval_every_steps = 4 if method == 'ewc' else 0
  config_validation.validate(config, num_devices=1)
  dataset = {'train': class_images(12), 'validation': class_images(6, seed=1),
             'test': class_images(9, seed=2)}
  workdir = str(tmp_path)
  last = train.train_and_evaluate(config, workdir, dataset=dataset)
  assert np.isfinite(last['loss'])
  assert ('validation/class_incremental_final' in last) == (method == 'ewc')
  assert sorted(int(s) for s in os.listdir(os.path.join(workdir, 'checkpoints'))) == [2, 4]
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  assert [r['step'] for r in rows if r['split'] == 'train'] == [2, 4]

  results, paths = evaluate.evaluate_checkpoint(
      config, workdir, dataset=dataset, plot=False, num_episodes=3, num_query_draws=2,
      batch_size=2)
  assert paths[0] == os.path.join(workdir, 'eval', 'test_T2_step4.json')
  with open(paths[0]) as f:
    saved = json.load(f)
  assert saved['method'] == methods.display_name(config)
  for name in ('task_incremental', 'class_incremental'):
    mean = np.array(saved[name]['mean'], dtype=float)
    assert mean.shape == (2, 2) and np.isnan(mean[0, 1])
    assert np.all((mean[np.tril_indices(2)] >= 0) & (mean[np.tril_indices(2)] <= 1))
  assert len(saved['table']['class_incremental']['mean']) == 2
  assert os.path.exists(paths[2])  # The Markdown table.


def test_table1_configs_validate_and_name_bad_arguments():
  from configs import baselines_table1  # pylint: disable=g-import-not-at-top
  for arg in ('finetune,5', 'ewc,2,smoke', 'maml,5', 'maml,3,tiny'):
    config = config_validation.validate(baselines_table1.get_config(arg), num_devices=1)
    assert config.method == arg.split(',')[0]
    assert config.episode.num_tasks == int(arg.split(',')[1])
  with pytest.raises(ValueError, match='METHOD,T'):
    baselines_table1.get_config('maml')
  config = baselines_table1.get_config('ewc,2,tiny')
  config.method = 'ewcc'
  with pytest.raises(config_validation.ConfigError, match='method'):
    config_validation.validate(config, num_devices=1)
