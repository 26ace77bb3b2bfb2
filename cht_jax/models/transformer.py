"""The HyperTransformer's encoder, as in the original HT code (paper, section 4).

Post-LayerNorm: x = LN(x + MHA(x)); x = LN(x + FFN(x)), LN epsilon 1e-6.
Biases on the q, k, v and output projections; softmax attention scaled by
sqrt(per-head depth); no positional encoding (tokens form a set).
"""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from cht_jax import kernels
from cht_jax.models import ops

ACTIVATIONS = {
    'relu': jax.nn.relu,
    'gelu': jax.nn.gelu,
    'leaky_relu': lambda x: jax.nn.leaky_relu(x, negative_slope=0.1),
}
LAYER_NORM_EPSILON = 1e-6
ENCODER_IMPLS = ('auto', 'xla', 'fused_cpu')


def resolve_encoder_impl(impl: str) -> str:
  """'auto' is 'fused_cpu' on CPU where the kernel compiles, else 'xla' (ValueError:
  'fused_cpu' where it cannot run)."""
  return kernels.resolve('model.encoder_impl', impl, ENCODER_IMPLS, fallback='xla')


def width_from_fraction(model_width: int, fraction: float, num_heads: int) -> int:
  """E * fraction rounded up to a multiple of `num_heads` (as in HT)."""
  dim = int(model_width * fraction)
  return math.ceil(dim / num_heads) * num_heads


def _dense(features: int, name: str) -> nn.Dense:
  return nn.Dense(features, kernel_init=nn.initializers.glorot_uniform(), name=name)


class MultiHeadSelfAttention(nn.Module):
  """[L, E] -> [L, E] multi-head self-attention over an unordered token set."""
  num_heads: int
  query_key_dim: int
  value_dim: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    length, width = x.shape
    h = self.num_heads
    q = _dense(self.query_key_dim, 'query')(x).reshape(length, h, -1)
    k = _dense(self.query_key_dim, 'key')(x).reshape(length, h, -1)
    v = _dense(self.value_dim, 'value')(x).reshape(length, h, -1)
    logits = jnp.einsum('qhd,khd->hqk', q, k) / math.sqrt(q.shape[-1])
    weights = jax.nn.softmax(logits, axis=-1)
    # [h, L, L], kept only where 'intermediates' are collected (diagnostics/task_specificity.py).
    self.sow('intermediates', 'attention_weights', weights)
    attended = jnp.einsum('hqk,khd->qhd', weights, v)
    return _dense(width, 'output')(attended.reshape(length, -1))


class EncoderLayer(nn.Module):
  num_heads: int
  query_key_dim: int
  value_dim: int
  inner_dim: int
  activation: str = 'relu'

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    attended = MultiHeadSelfAttention(
        self.num_heads, self.query_key_dim, self.value_dim, name='attention')(x)
    x = nn.LayerNorm(epsilon=LAYER_NORM_EPSILON, name='attention_norm')(x + attended)
    y = ACTIVATIONS[self.activation](_dense(self.inner_dim, 'ffn_inner')(x))
    y = _dense(x.shape[-1], 'ffn_output')(y)
    return nn.LayerNorm(epsilon=LAYER_NORM_EPSILON, name='ffn_norm')(x + y)


class Encoder(nn.Module):
  """A stack of post-LN encoder layers, widths as fractions of E: [L, E] -> [L, E].
  `encoder_impl` changes only how an undifferentiated forward pass runs."""
  num_layers: int
  num_heads: int
  query_key_fraction: float
  value_fraction: float
  inner_fraction: float
  activation: str
  encoder_impl: str

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    if resolve_encoder_impl(self.encoder_impl) == 'fused_cpu' and not self.is_initializing():
      # The kernel has no gradient; initialising must create the params.
      from cht_jax.kernels.cpu import encoder as cpu_kernel  # pylint: disable=g-import-not-at-top
      definition = self.clone(parent=None, encoder_impl='xla')
      return ops.forward_with_gradient_of(
          lambda params, x: cpu_kernel.encoder_forward(params, x, self.num_heads,
                                                       self.activation),
          lambda params, x: definition.apply({'params': params}, x),
      )(self.variables['params'], tokens)
    width = tokens.shape[-1]
    dims = {
        'query_key_dim': width_from_fraction(width, self.query_key_fraction, self.num_heads),
        'value_dim': width_from_fraction(width, self.value_fraction, self.num_heads),
        'inner_dim': width_from_fraction(width, self.inner_fraction, self.num_heads),
    }
    x = tokens
    for i in range(self.num_layers):
      x = EncoderLayer(self.num_heads, activation=self.activation,
                       name=f'layer_{i}', **dims)(x)
    return x


def encoder_settings(module: nn.Module) -> dict:
  """`module`'s values of `Encoder`'s fields: what it builds its encoders with."""
  return {field.name: getattr(module, field.name) for field in dataclasses.fields(Encoder)
          if field.name not in ('parent', 'name')}
