"""Shared fixtures: a tiny HyperTransformer and random episodes for it."""

import jax
import jax.numpy as jnp
import pytest

from cht_jax.models import hypertransformer as ht_lib

TINY = dict(num_tasks=3, ways=3, shots=2, queries=2, image_size=16)


@pytest.fixture(scope='session')
def tiny_ht():
  return ht_lib.HyperTransformer(
      num_ways=TINY['ways'], channels=(4, 4, 4, 4), cnn_embedding_dim=5,
      embedding_dim=8, image_features=8, num_layers=1, num_heads=2)


def make_episode(key, num_tasks=TINY['num_tasks'], ways=TINY['ways'],
                 shots=TINY['shots'], queries=TINY['queries'], size=TINY['image_size']):
  """Random images, class-major labels: [T, K*N, H, W, 1] and [T, K*Q, H, W, 1]."""
  support_key, query_key = jax.random.split(key)
  labels = lambda n: jnp.tile(jnp.repeat(jnp.arange(ways), n), (num_tasks, 1))
  return {
      'support_images': jax.random.normal(support_key, (num_tasks, ways * shots, size, size, 1)),
      'support_labels': labels(shots),
      'query_images': jax.random.normal(query_key, (num_tasks, ways * queries, size, size, 1)),
      'query_labels': labels(queries),
  }


@pytest.fixture(scope='session')
def tiny_episode():
  return make_episode(jax.random.key(1))


@pytest.fixture(scope='session')
def tiny_params(tiny_ht, tiny_episode):
  theta = ht_lib.zeros_theta(tiny_ht.cnn, tiny_episode['support_images'].shape[2:])
  return tiny_ht.init(jax.random.key(0), tiny_episode['support_images'][0],
                      tiny_episode['support_labels'][0], theta)['params']
