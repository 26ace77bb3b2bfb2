"""The fused CPU encoder (`model.encoder_impl='fused_cpu'`): the numbers of
`transformer.Encoder`'s forward pass; under differentiation the XLA modules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cht_jax.models import fused_cpu
from cht_jax.models import hypertransformer as ht_lib
from cht_jax.models import transformer
from conftest import tiny_config


def encoder_and_params(num_layers, length, width, activation='relu', **kwargs):
  encoder = transformer.Encoder(num_layers=num_layers, num_heads=2, activation=activation,
                                **kwargs)
  tokens = jax.random.normal(jax.random.key(length * width), (length, width))
  return encoder, encoder.init(jax.random.key(0), tokens)['params'], tokens


@pytest.mark.parametrize('num_layers, length, width, activation, fractions', [
    (3, 28, 104, 'relu', {}),  # The Omniglot model's conv layers (two threads).
    (1, 40, 48, 'gelu', {}),
    (2, 5, 80, 'leaky_relu', {}),  # Too few tokens for a second thread.
    (2, 33, 70, 'relu', {'query_key_fraction': 0.5, 'value_fraction': 0.75,
                         'inner_fraction': 2.0}),  # Unequal widths, odd sizes.
])
def test_kernel_matches_the_encoder(num_layers, length, width, activation, fractions):
  encoder, params, tokens = encoder_and_params(num_layers, length, width, activation,
                                               **fractions)
  want = encoder.apply({'params': params}, tokens)
  got = jax.jit(lambda p, x: fused_cpu.encoder_forward(p, x, 2, activation))(params, tokens)
  assert got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # Rows split over threads the same way every call: the same bits every time.
  for _ in range(3):
    np.testing.assert_array_equal(fused_cpu.encoder_forward(params, tokens, 2, activation), got)


def test_kernel_under_vmap_shares_or_batches_the_parameters():
  encoder, params, _ = encoder_and_params(2, 28, 104)
  tokens = jax.random.normal(jax.random.key(1), (3, 28, 104))
  want = jax.vmap(lambda x: encoder.apply({'params': params}, x))(tokens)
  shared = jax.jit(jax.vmap(lambda x: fused_cpu.encoder_forward(params, x, 2, 'relu')))
  np.testing.assert_allclose(shared(tokens), want, rtol=1e-5, atol=1e-5)
  batched_params = jax.tree.map(lambda p: jnp.stack([p, 2 * p, -p]), params)
  want = jax.vmap(lambda p, x: encoder.apply({'params': p}, x))(batched_params, tokens)
  got = jax.jit(jax.vmap(lambda p, x: fused_cpu.encoder_forward(p, x, 2, 'relu')))(
      batched_params, tokens)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)  # Doubled weights: larger.


def test_encoder_impl_changes_forward_passes_only():
  """Forward alone: the kernel; under differentiation: exactly the XLA modules."""
  encoder, params, tokens = encoder_and_params(3, 28, 104)
  fused = encoder.clone(impl='fused_cpu')
  apply = lambda module: lambda p, x: module.apply({'params': p}, x)
  np.testing.assert_array_equal(jax.jit(apply(fused))(params, tokens),
                                fused_cpu.encoder_forward(params, tokens, 2, 'relu'))
  loss = lambda module: lambda p, x: jnp.sum(apply(module)(p, x) ** 2)
  got = jax.jit(jax.value_and_grad(loss(fused), (0, 1)))(params, tokens)
  want = jax.jit(jax.value_and_grad(loss(encoder), (0, 1)))(params, tokens)
  jax.tree.map(np.testing.assert_array_equal, got, want)


def test_generated_theta_matches_the_xla_encoders():
  ht = ht_lib.HyperTransformer(num_ways=3, channels=(8, 8), encoder_impl='fused_cpu')
  images = jax.random.uniform(jax.random.key(0), (6, 16, 16, 1))
  labels = jnp.array([0, 1, 2, 0, 1, 2])
  theta_prev = ht_lib.zeros_theta(ht.cnn, images.shape[1:])
  params = ht.init(jax.random.key(1), images, labels, theta_prev)['params']
  generate = lambda module: jax.jit(lambda p: module.apply({'params': p}, images, labels,
                                                           theta_prev))
  got = generate(ht)(params)
  want = generate(ht.clone(encoder_impl='xla'))(params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), got, want)


def test_auto_and_validation():
  from cht_jax import config_validation  # pylint: disable=g-import-not-at-top
  assert transformer.resolve_encoder_impl('auto') == 'fused_cpu'  # CPU with a compiler.
  assert transformer.resolve_encoder_impl('xla') == 'xla'
  assert tiny_config().model.encoder_impl == 'auto'
  with pytest.raises(config_validation.ConfigError, match='model.encoder_impl'):
    config_validation.validate(tiny_config(**{'model.encoder_impl': 'pallas'}))
