"""The generated CNN and the HyperTransformer: shapes, widths, the weight layout."""

import dataclasses
import subprocess
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cht_jax import models
from cht_jax.models import cnn as cnn_lib
from cht_jax.models import features as features_lib
from cht_jax.models import hypertransformer as ht_lib
from cht_jax.models import ops
from cht_jax.models import transformer
from conftest import make_ht, normal, tiny_config


@pytest.mark.parametrize('size, kernel_size, stride, padding', [
    (9, 3, 1, 'SAME'), (28, 3, 2, 'SAME'), (7, 3, 2, 'SAME'), (4, 3, 1, 'SAME'),
    (28, 3, 2, 'VALID'), (13, 3, 1, 'VALID'), (3, 3, 2, 'VALID'), (1, 1, 1, 'VALID'),
    (8, 2, 1, 'SAME')])
def test_conv_impls_agree(size, kernel_size, stride, padding):
  x = normal(0, (3, size, size, 5))
  kernel = normal(1, (kernel_size, kernel_size, 5, 7))
  patches = ops.conv2d(x, kernel, stride, padding, 'patches')
  reference = ops.conv2d(x, kernel, stride, padding, 'lax')
  assert patches.shape == reference.shape
  np.testing.assert_allclose(patches, reference, rtol=1e-5, atol=1e-5)
  taps = ops.conv2d(x, kernel, stride, padding, 'taps')
  np.testing.assert_allclose(taps, reference, rtol=1e-5, atol=1e-5)
  # The gradients too: 'taps' is a form that training differentiates.
  loss = lambda impl: lambda x, k: jnp.sum(jnp.sin(ops.conv2d(x, k, stride, padding, impl)))
  for got, want in zip(jax.grad(loss('taps'), (0, 1))(x, kernel),
                       jax.grad(loss('lax'), (0, 1))(x, kernel)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_forward_with_gradient_of_runs_fast_alone_and_reference_under_differentiation():
  fast = lambda x, w: jnp.sin(x) * w + 1.0  # Deliberately different, to tell them apart.
  reference = lambda x, w: jnp.sin(x) * w
  f = ops.forward_with_gradient_of(fast, reference)
  x, w = jnp.arange(3.0), jnp.full(3, 2.0)
  np.testing.assert_array_equal(jax.jit(f)(x, w), fast(x, w))
  np.testing.assert_array_equal(jax.vmap(f)(x[None], w[None])[0], fast(x, w))
  value, grads = jax.value_and_grad(lambda x, w: f(x, w).sum(), argnums=(0, 1))(x, w)
  want_value, want_grads = jax.value_and_grad(lambda x, w: reference(x, w).sum(),
                                              argnums=(0, 1))(x, w)
  assert value == want_value
  for got, want in zip(grads, want_grads):
    np.testing.assert_array_equal(got, want)


@pytest.mark.skipif(jax.default_backend() != 'cpu',
                    reason="conv_impl='fused_cpu' runs on CPU hosts only")
@pytest.mark.parametrize('stride, padding', [(2, 'SAME'), (1, 'VALID')])
def test_fused_cpu_convs_run_lax_forward_and_the_patches_gradient(stride, padding):
  """The feature extractors' convs under conv_impl='fused_cpu' (CPU)."""
  x = normal(0, (3, 9, 9, 5))
  kernel = normal(1, (3, 3, 5, 7))
  conv = lambda impl: lambda x, k: ops.conv2d(x, k, stride, padding, impl)
  np.testing.assert_array_equal(jax.jit(conv('fused_cpu'))(x, kernel),
                                jax.jit(conv('lax'))(x, kernel))
  loss = lambda impl: lambda x, k: jnp.sum(conv(impl)(x, k) ** 2)
  for got, want in zip(jax.grad(loss('fused_cpu'), (0, 1))(x, kernel),
                       jax.grad(loss('patches'), (0, 1))(x, kernel)):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize('size', [28, 7, 3, 1])
def test_max_pool_matches_reduce_window(size):
  x = normal(0, (2, size, size, 3))
  np.testing.assert_array_equal(cnn_lib.max_pool_2x2(x),
                                nn.max_pool(x, (2, 2), (2, 2), 'VALID'))


def test_batch_stat_norm_uses_the_batch_statistics():
  x = 3.0 + 2.0 * normal(0, (16, 4, 4, 3))
  y = cnn_lib.batch_stat_norm(x, jnp.ones(3), jnp.zeros(3))
  np.testing.assert_allclose(y.mean(axis=(0, 1, 2)), 0.0, atol=1e-5)
  np.testing.assert_allclose(y.std(axis=(0, 1, 2)), 1.0, atol=1e-3)


def test_cnn_maps_and_params_for_omniglot():
  cnn = cnn_lib.CNN(channels=(8, 8, 8, 8), embedding_dim=20)
  params = cnn.init(jax.random.key(0), jnp.zeros((2, 28, 28, 1)))['params']
  shapes = jax.tree.map(jnp.shape, params)
  assert shapes['block_0'] == {'kernel': (3, 3, 1, 8), 'scale': (8,), 'bias': (8,)}
  for i in (1, 2, 3):
    assert shapes[f'block_{i}']['kernel'] == (3, 3, 8, 8)
  assert shapes['head'] == {'kernel': (8, 20), 'bias': (20,)}  # 28->14->7->3->1.
  assert cnn_lib.feature_map_sizes(28, 4) == [28, 14, 7, 3, 1]
  assert cnn_lib.feature_map_sizes(84, 4) == [84, 42, 21, 10, 5]
  assert cnn.apply({'params': params}, jnp.zeros((5, 28, 28, 1))).shape == (5, 20)


def test_activation_conv_plan_follows_ht():
  assert features_lib.activation_conv_plan(28, 2) == [(3, 2), (3, 1)]
  assert features_lib.activation_conv_plan(3, 2) == [(3, 2)]  # 3 -> 1, then skipped.
  assert features_lib.activation_conv_plan(1, 1) == [(1, 1)]  # Kernel shrinks to the map.


@pytest.fixture(scope='module')
def omniglot_ht():
  ht = make_ht(num_ways=20)  # The paper's settings: 8 channels, emb 32.
  support = jnp.zeros((20, 28, 28, 1))
  labels = jnp.arange(20)
  theta_prev = ht_lib.zeros_theta(ht.cnn, (28, 28, 1))
  params = jax.eval_shape(ht.init, jax.random.key(0), support, labels, theta_prev)['params']
  return ht, params


def test_token_widths_for_the_omniglot_model(omniglot_ht):
  _, params = omniglot_ht
  width = lambda layer: params[f'{layer}_transformer']['layer_0']['attention']['query'][
      'kernel'].shape[0]
  assert [width(f'block_{i}') for i in range(4)] == [80, 104, 104, 104]
  # Head: max(32 + 8 + 1, 32 + 8 activation + 32 image features).
  assert width('head') == 72
  assert params['block_0_weight_embedding'].shape == (8, 32)
  assert params['block_0_label_embedding'].shape == (21, 32)
  assert params['head_weight_embedding'].shape == (20, 32)


def test_generated_theta_is_exactly_the_cnn_params(omniglot_ht):
  ht, _ = omniglot_ht
  support = normal(0, (20, 28, 28, 1))
  labels = jnp.arange(20)
  theta_prev = ht_lib.zeros_theta(ht.cnn, (28, 28, 1))
  params = ht.init(jax.random.key(1), support, labels, theta_prev)['params']
  theta = ht.apply({'params': params}, support, labels, theta_prev)
  cnn_params = ht.cnn.init(jax.random.key(0), support)['params']
  assert jax.tree.structure(theta) == jax.tree.structure(cnn_params)
  assert jax.tree.map(jnp.shape, theta) == jax.tree.map(jnp.shape, cnn_params)
  embeddings = ht.cnn.apply({'params': theta}, support)
  assert embeddings.shape == (20, 20) and bool(jnp.all(jnp.isfinite(embeddings)))
  # The support embeddings the generator returns are the CNN's under theta_t.
  same_theta, support_embeddings = ht.apply({'params': params}, support, labels, theta_prev,
                                            with_support_embeddings=True)
  chex.assert_trees_all_equal(same_theta, theta)
  np.testing.assert_array_equal(support_embeddings, embeddings)


def test_attention_weights_are_sown_for_diagnostics():
  """The encoder keeps its attention weights where 'intermediates' are collected:
  softmax(q k^T / sqrt(d)) of its own projections, and collecting them changes
  nothing that it computes."""
  encoder = transformer.Encoder(num_layers=2, num_heads=2, query_key_fraction=1.0,
                                value_fraction=1.0, inner_fraction=1.0, activation='relu',
                                encoder_impl='xla')
  tokens = normal(0, (7, 8))
  params = encoder.init(jax.random.key(1), tokens)['params']
  outputs, found = encoder.apply({'params': params}, tokens, mutable=['intermediates'])
  np.testing.assert_array_equal(outputs, encoder.apply({'params': params}, tokens))
  (weights,) = found['intermediates']['layer_0']['attention']['attention_weights']
  attention = params['layer_0']['attention']
  project = lambda name: (tokens @ attention[name]['kernel'] + attention[name]['bias']
                          ).reshape(7, 2, 4)
  logits = jnp.einsum('qhd,khd->hqk', project('query'), project('key')) / 2.0
  np.testing.assert_allclose(weights, jax.nn.softmax(logits), rtol=1e-5, atol=1e-6)
  assert weights.shape == (2, 7, 7)
  assert set(found['intermediates']) == {'layer_0', 'layer_1'}


@pytest.mark.parametrize('generate_bn', [False, True])
def test_slices_round_trip(generate_bn):
  block = {'kernel': normal(0, (3, 3, 5, 7)),
           'scale': jnp.arange(7.0), 'bias': -jnp.arange(7.0)}
  rows = ht_lib.block_to_slices(block, generate_bn)
  assert rows.shape == (7, 45 + 2 * generate_bn)
  # Token i holds output channel i's kernel in (kh, kw, c_in) order.
  np.testing.assert_array_equal(rows[2, :45], block['kernel'][..., 2].reshape(-1))
  back = ht_lib.slices_to_block(rows, (3, 3, 5, 7), generate_bn)
  for name, value in back.items():
    np.testing.assert_array_equal(value, block[name])
  head = {'kernel': normal(0, (8, 20)), 'bias': jnp.arange(20.0)}
  rows = ht_lib.head_to_slices(head)
  assert rows.shape == (20, 9)
  jax.tree.map(np.testing.assert_array_equal, ht_lib.slices_to_head(rows), head)


def test_generated_batchnorm_option(tiny_episode):
  ht = make_ht(num_ways=3, channels=(4, 4, 4, 4), cnn_embedding_dim=5, embedding_dim=8,
               image_features=8, num_layers=1, generate_bn=True)
  images, labels = tiny_episode['support_images'][0], tiny_episode['support_labels'][0]
  theta_prev = ht_lib.zeros_theta(ht.cnn, images.shape[1:])
  params = ht.init(jax.random.key(0), images, labels, theta_prev)['params']
  assert 'block_0_scale' not in params  # Generated, not trained.
  theta = ht.apply({'params': params}, images, labels, theta_prev)
  assert theta['block_0']['scale'].shape == (4,)
  assert float(jnp.std(theta['block_0']['scale'])) > 0  # Differs per channel.


def test_the_config_model_settings_reach_the_modules():
  """Fields of config.model reach HyperTransformer by name, and its encoders theirs."""
  config = tiny_config(**{'model.num_layers': 2, 'model.inner_fraction': 2.0,
                          'model.activation': 'gelu', 'model.encoder_impl': 'xla'})
  ht = models.build_hypertransformer(config)
  assert ht.num_ways == config.episode.ways
  assert ht.channels == (config.model.channels,) * config.model.num_blocks
  training_only = set(config.model) - {field.name for field in dataclasses.fields(ht)}
  assert training_only == {'num_blocks', 'remat', 'vectorize'}, (
      'A new config.model field must be a field of HyperTransformer (or one of training).')
  assert transformer.encoder_settings(ht) == {
      'num_layers': 2, 'num_heads': config.model.num_heads,
      'query_key_fraction': 1.0, 'value_fraction': 1.0, 'inner_fraction': 2.0,
      'activation': 'gelu', 'encoder_impl': 'xla'}
  images = jnp.zeros((6, 16, 16, 1))
  theta_prev = ht_lib.zeros_theta(ht.cnn, images.shape[1:])
  params = jax.eval_shape(ht.init, jax.random.key(0), images, jnp.zeros(6, jnp.int32),
                          theta_prev)['params']
  encoder = params['block_1_transformer']
  assert set(encoder) == {'layer_0', 'layer_1'}
  width = encoder['layer_0']['attention']['query']['kernel'].shape[0]
  assert encoder['layer_0']['ffn_inner']['kernel'].shape == (width, 2 * width)


def test_importing_the_models_imports_no_kernels():
  """Backends are imported (and their libraries built) on first use only."""
  code = 'import sys, cht_jax.models; assert "cht_jax.kernels.cpu" not in sys.modules'
  subprocess.run([sys.executable, '-c', code], check=True)
