"""The HyperTransformer's encoder, as in the original HT code (DESIGN.md 1.3).

Post-LayerNorm: x = LN(x + MHA(x)); x = LN(x + FFN(x)), LN epsilon 1e-6.
Biases on the q, k, v and output projections; softmax attention scaled by
sqrt(per-head depth); no positional encoding (tokens form a set).

On CPU a whole stack can also run as one C++ call (`impl='fused_cpu'`,
`fused_cpu.encoder_forward`), where nothing differentiates it: generating
theta to evaluate or deploy. Training differentiates it and runs these modules.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from cht_jax.models import fused_cpu
from cht_jax.models import ops

ACTIVATIONS = {
    'relu': jax.nn.relu,
    'gelu': jax.nn.gelu,
    'leaky_relu': lambda x: jax.nn.leaky_relu(x, negative_slope=0.1),
}
LAYER_NORM_EPSILON = 1e-6
ENCODER_IMPLS = ('auto', 'xla', 'fused_cpu')


def resolve_encoder_impl(impl: str) -> str:
  """'auto' is 'fused_cpu' on CPU where the kernel compiles, else 'xla'.

  Raises:
    ValueError: 'fused_cpu' asked for where it cannot run.
  """
  if impl not in ENCODER_IMPLS:
    raise ValueError(f'Unknown encoder_impl {impl!r}; expected one of {ENCODER_IMPLS}.')
  return fused_cpu.resolve('model.encoder_impl', impl, fallback='xla')


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
    attended = jnp.einsum('hqk,khd->qhd', jax.nn.softmax(logits, axis=-1), v)
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
  """A stack of post-LN encoder layers; widths given as fractions of E.

  Input and output: [L, E] tokens of one task (vmap for batches). `impl`
  ('auto', 'xla', 'fused_cpu'; `resolve_encoder_impl`) only changes how an
  undifferentiated forward pass runs: under differentiation it is always these
  modules (`ops.forward_with_gradient_of`).
  """
  num_layers: int = 3
  num_heads: int = 2
  query_key_fraction: float = 1.0
  value_fraction: float = 1.0
  inner_fraction: float = 1.0
  activation: str = 'relu'
  impl: str = 'xla'

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    if resolve_encoder_impl(self.impl) == 'fused_cpu' and not self.is_initializing():
      reference = self.clone(parent=None, impl='xla')
      fused = lambda params, x: fused_cpu.encoder_forward(
          params, x, self.num_heads, self.activation)
      apply = lambda params, x: reference.apply({'params': params}, x)
      return ops.forward_with_gradient_of(fused, apply)(self.variables['params'], tokens)
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
