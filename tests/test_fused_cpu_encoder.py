"""The CPU kernel of the encoder stack (`model.encoder_impl='fused_cpu'`): the numbers of
its Python definition, `transformer.Encoder`, in forward passes; under differentiation
the definition itself."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cht_jax.kernels.cpu import encoder as encoder_kernel
from cht_jax.models import hypertransformer as ht_lib
from cht_jax.models import transformer
from conftest import make_ht, normal, tiny_config

pytestmark = pytest.mark.skipif(jax.default_backend() != 'cpu',
                                reason='the fused_cpu kernels run on CPU hosts only')

MISMATCH = ("The CPU kernel no longer matches the Python definition of op 'encoder' "
            '(cht_jax/models/transformer.py:Encoder): change cht_jax/kernels/cpu/encoder.cc '
            'to the new math.')
# The paper's settings of the model's encoders (configs/omniglot_base.py).
DEFAULTS = transformer.encoder_settings(make_ht(num_ways=1))


def encoder_and_params(num_layers, length, width, activation='relu', **fractions):
  """The definition (`encoder_impl` the setting no kernel stands in for), its params, tokens."""
  encoder = transformer.Encoder(**{**DEFAULTS, **fractions, 'num_layers': num_layers,
                                   'num_heads': 2, 'activation': activation,
                                   'encoder_impl': 'xla'})
  tokens = normal(length * width, (length, width))
  return encoder, encoder.init(jax.random.key(0), tokens)['params'], tokens


def apply(module):
  return lambda params, tokens: module.apply({'params': params}, tokens)


@pytest.mark.parametrize('num_layers, length, width, activation, fractions', [
    (3, 28, 104, 'relu', {}),  # The Omniglot model's conv layers (two threads).
    (1, 40, 48, 'gelu', {}),
    (2, 5, 80, 'leaky_relu', {}),  # Too few tokens for a second thread.
    (2, 33, 70, 'relu', {'query_key_fraction': 0.5, 'value_fraction': 0.75,
                         'inner_fraction': 2.0}),  # Unequal widths, odd sizes.
])
def test_kernel_matches_the_definition(num_layers, length, width, activation, fractions):
  encoder, params, tokens = encoder_and_params(num_layers, length, width, activation,
                                               **fractions)
  fused = apply(encoder.clone(encoder_impl='fused_cpu'))
  want = apply(encoder)(params, tokens)
  got = jax.jit(fused)(params, tokens)
  assert got.shape == want.shape
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=MISMATCH)
  # Rows split over threads the same way every call: the same bits every time.
  for _ in range(3):
    np.testing.assert_array_equal(fused(params, tokens), got)


def test_kernel_under_vmap_shares_or_batches_the_parameters():
  encoder, params, _ = encoder_and_params(2, 28, 104)
  fused = apply(encoder.clone(encoder_impl='fused_cpu'))
  tokens = normal(1, (3, 28, 104))
  want = jax.vmap(lambda x: apply(encoder)(params, x))(tokens)
  shared = jax.jit(jax.vmap(lambda x: fused(params, x)))
  np.testing.assert_allclose(shared(tokens), want, rtol=1e-5, atol=1e-5, err_msg=MISMATCH)
  batched_params = jax.tree.map(lambda p: jnp.stack([p, 2 * p, -p]), params)
  want = jax.vmap(apply(encoder))(batched_params, tokens)
  got = jax.jit(jax.vmap(fused))(batched_params, tokens)
  # Doubled weights: larger.
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=MISMATCH)


def test_encoder_impl_changes_forward_passes_only():
  """Forward alone: the kernel; under differentiation: exactly the definition."""
  encoder, params, tokens = encoder_and_params(3, 28, 104)
  fused = encoder.clone(encoder_impl='fused_cpu')
  np.testing.assert_array_equal(jax.jit(apply(fused))(params, tokens),
                                encoder_kernel.encoder_forward(params, tokens, 2, 'relu'))
  loss = lambda module: lambda p, x: jnp.sum(apply(module)(p, x) ** 2)
  got = jax.jit(jax.value_and_grad(loss(fused), (0, 1)))(params, tokens)
  want = jax.jit(jax.value_and_grad(loss(encoder), (0, 1)))(params, tokens)
  jax.tree.map(np.testing.assert_array_equal, got, want)


def test_generated_theta_matches_the_definition():
  ht = make_ht(num_ways=3, channels=(8, 8)).clone(encoder_impl='fused_cpu')
  images = jnp.asarray(np.random.default_rng(0).uniform(size=(6, 16, 16, 1)), jnp.float32)
  labels = jnp.array([0, 1, 2, 0, 1, 2])
  theta_prev = ht_lib.zeros_theta(ht.cnn, images.shape[1:])
  params = jax.jit(ht.init)(jax.random.key(1), images, labels, theta_prev)['params']
  generate = lambda module: jax.jit(lambda p: module.apply({'params': p}, images, labels,
                                                           theta_prev))
  got = generate(ht)(params)
  want = generate(ht.clone(encoder_impl='xla'))(params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5,
                                                       err_msg=MISMATCH), got, want)


def test_auto_and_validation():
  from cht_jax import config_validation  # pylint: disable=g-import-not-at-top
  assert transformer.resolve_encoder_impl('auto') == 'fused_cpu'  # CPU with a compiler.
  assert transformer.resolve_encoder_impl('xla') == 'xla'
  assert tiny_config().model.encoder_impl == 'auto'
  with pytest.raises(config_validation.ConfigError, match='model.encoder_impl'):
    config_validation.validate(tiny_config(**{'model.encoder_impl': 'pallas'}))
