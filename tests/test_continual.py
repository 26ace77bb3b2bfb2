"""The continual step against a plain Python loop over Algorithm 1."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cht_jax import continual
from cht_jax import losses
from cht_jax import models
from cht_jax.models import hypertransformer as ht_lib
from conftest import init_params, shallow_config


def reference_loss(ht, params, episode, loss):
  """Algorithm 1 written as loops, independent of continual.py's scan and pairs."""
  num_tasks, _ = episode['support_labels'].shape
  ways = ht.num_ways
  theta = jax.tree.map(jnp.zeros_like, ht_lib.zeros_theta(
      ht.cnn, episode['support_images'].shape[2:]))
  prototypes, total = [], 0.0
  for t in range(num_tasks):
    support, labels = episode['support_images'][t], episode['support_labels'][t]
    theta = ht.apply({'params': params}, support, labels, theta)
    embeddings = ht.cnn.apply({'params': theta}, support)
    prototypes.append(jnp.stack([embeddings[labels == k].mean(axis=0) for k in range(ways)]))
    for tau in range(t + 1):
      queries = ht.cnn.apply({'params': theta}, episode['query_images'][tau])
      if loss == 'class_incremental':
        centres, targets = jnp.concatenate(prototypes), episode['query_labels'][tau] + tau * ways
      else:
        centres, targets = prototypes[tau], episode['query_labels'][tau]
      logits = -((queries[:, None, :] - centres[None]) ** 2).sum(-1)
      log_probs = jax.nn.log_softmax(logits)
      total += -jnp.mean(log_probs[jnp.arange(len(targets)), targets])
  return total


@pytest.mark.parametrize('loss', ['class_incremental', 'task_incremental'])
def test_scan_loss_equals_python_loop(tiny_ht, tiny_params, tiny_episode, loss):
  expected = reference_loss(tiny_ht, tiny_params, tiny_episode, loss)
  got, _ = jax.jit(lambda p: continual.episode_loss(tiny_ht, p, tiny_episode, loss))(tiny_params)
  np.testing.assert_allclose(got, expected, rtol=2e-5)


def test_gradients_with_and_without_remat_agree(tiny_episode):
  # shallow_config's model with the definition's convolutions: the remat=False loss and
  # gradient are the program test_fused_cpu and test_mixed_precision compile too, which
  # the persistent compilation cache then holds.
  ht = models.build_hypertransformer(shallow_config(**{'model.conv_impl': 'patches'}))
  params, _ = init_params(ht, tiny_episode)
  grad = lambda remat: jax.jit(jax.value_and_grad(
      lambda p: continual.episode_loss(ht, p, tiny_episode, remat=remat)[0]))(params)[1]
  with_remat, without = grad(True), grad(False)
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(without))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale),
               with_remat, without)


@pytest.mark.parametrize('option, vectorize, num_tasks, expected', [
    ('auto', True, 1, True), ('auto', False, 1, False), ('auto', False, 2, False),
    ('auto', False, 3, True), (True, False, 1, True), (False, True, 5, False),
    ('False', True, 5, False), ('true', False, 1, True)])
def test_remat_option(option, vectorize, num_tasks, expected):
  # 'auto' rematerialises vmapped episodes (memory) and looped ones from T = 3 on
  # (speed); the strings 'True' and 'False' count as the booleans.
  assert continual.remat_option(option, vectorize, num_tasks) is expected


def test_remat_option_rejects_other_values():
  with pytest.raises(ValueError, match='model.remat'):
    continual.remat_option('sometimes', True, 1)


def test_theta_t_depends_on_theta_prev(tiny_ht, tiny_params, tiny_episode):
  support, labels = tiny_episode['support_images'][0], tiny_episode['support_labels'][0]
  zeros = ht_lib.zeros_theta(tiny_ht.cnn, support.shape[1:])
  other = jax.tree.map(lambda z: z + 0.5, zeros)
  theta_a = tiny_ht.apply({'params': tiny_params}, support, labels, zeros)
  theta_b = tiny_ht.apply({'params': tiny_params}, support, labels, other)
  for name in ('block_0', 'block_3', 'head'):
    assert not np.allclose(theta_a[name]['kernel'], theta_b[name]['kernel'])
  # And the scan feeds theta_{t-1} back: task 1 with the same support as task 0
  # still gets different weights, because theta_0 != 0.
  repeated = jnp.stack([support, support])
  thetas, _ = continual.generate_thetas(tiny_ht, tiny_params, repeated, jnp.stack([labels] * 2))
  assert not np.allclose(thetas['head']['kernel'][0], thetas['head']['kernel'][1])
  # The scan and a plain apply are different compiled programs: float32 rounding
  # (1.9e-6 seen on an AVX-512 host).
  np.testing.assert_allclose(thetas['head']['kernel'][0], theta_a['head']['kernel'],
                             rtol=1e-5, atol=1e-5)


def test_prototypes_are_frozen(tiny_ht, tiny_params, tiny_episode):
  """Row tau of the buffer comes from theta_tau, not from the latest theta."""
  thetas, prototypes = continual.generate_thetas(
      tiny_ht, tiny_params, tiny_episode['support_images'], tiny_episode['support_labels'])
  num_tasks = prototypes.shape[0]
  for tau in range(num_tasks):
    support = tiny_episode['support_images'][tau]
    labels = tiny_episode['support_labels'][tau]
    own = jax.tree.map(lambda leaf: leaf[tau], thetas)
    last = jax.tree.map(lambda leaf: leaf[-1], thetas)
    with_own = losses.class_prototypes(tiny_ht.cnn.apply({'params': own}, support), labels, 3)
    with_last = losses.class_prototypes(tiny_ht.cnn.apply({'params': last}, support), labels, 3)
    np.testing.assert_allclose(prototypes[tau], with_own, rtol=1e-5, atol=1e-5)
    if tau < num_tasks - 1:
      assert not np.allclose(prototypes[tau], with_last, atol=1e-3)


def test_pairs_cover_the_lower_triangle():
  pairs = continual.TaskPairs.lower_triangle(5)
  assert len(pairs.t) == 15  # T(T+1)/2 query passes, not T^2.
  assert list(zip(pairs.t[:4], pairs.tau[:4])) == [(0, 0), (1, 0), (1, 1), (2, 0)]
  assert np.all(pairs.tau <= pairs.t)


def test_class_incremental_logits_mask_unseen_tasks():
  embeddings = jnp.zeros((2, 3))
  prototypes = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3)
  logits = losses.class_incremental_logits(embeddings, prototypes, t=0)
  probs = jax.nn.softmax(logits)
  assert logits.shape == (2, 8)
  np.testing.assert_array_equal(probs[:, 4:], 0.0)
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)


def test_class_prototypes_are_class_means():
  embeddings = jnp.array([[1.0, 0.0], [3.0, 2.0], [10.0, 10.0]])
  labels = jnp.array([0, 0, 1])
  np.testing.assert_allclose(losses.class_prototypes(embeddings, labels, 2),
                             [[2.0, 1.0], [10.0, 10.0]])


def test_query_passes_looped_or_vectorized_agree(tiny_ht, tiny_params, tiny_episode):
  thetas, _ = continual.generate_thetas(
      tiny_ht, tiny_params, tiny_episode['support_images'], tiny_episode['support_labels'])
  pairs = continual.TaskPairs.lower_triangle(3)
  embed = lambda vectorize: continual.embed_queries(
      tiny_ht.cnn, thetas, tiny_episode['query_images'], pairs, vectorize=vectorize)
  looped, vectorized = embed(False), embed(True)
  assert looped.shape == (6, 6, 5)  # 6 pairs, 3 ways x 2 queries, 5 dims.
  np.testing.assert_allclose(looped, vectorized, rtol=1e-5, atol=1e-5)
