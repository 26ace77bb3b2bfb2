"""The generated CNN: HT's `maxpool-4-layer` network (paper, "Experiments").

Four blocks of 3x3 conv (stride 1, `same`, no bias) -> ReLU -> 2x2 max-pool ->
BatchNorm on the statistics of the batch it is applied to, then flatten (NHWC)
and a dense embedding layer. The pure functions hold the math for the module and
the HyperTransformer, which emits its `params` (`theta`); for 28x28x1 inputs:
  block_0/kernel [3, 3, 1, 8] ... block_3/kernel [3, 3, 8, 8]   (generated)
  block_i/scale [8], block_i/bias [8]    (BatchNorm; trained and shared by default)
  head/kernel [8, 20], head/bias [20]    (generated)
"""

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from cht_jax.models import ops

# TF's BatchNormalization default, as used by the original HT code.
BATCH_NORM_EPSILON = 1e-3


def max_pool_2x2(x: jax.Array) -> jax.Array:
  """2x2 max-pool, stride 2, `valid`: [N, H, W, C] -> [N, H//2, W//2, C]. Not `reduce_window`,
  whose gradient is XLA:CPU's slow `select_and_scatter`."""
  n, h, w, c = x.shape
  x = x[:, :h // 2 * 2, :w // 2 * 2, :]
  return x.reshape(n, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


def batch_stat_norm(x: jax.Array, scale: jax.Array, bias: jax.Array,
                    epsilon: float = BATCH_NORM_EPSILON) -> jax.Array:
  """BatchNorm with the statistics of `x` [N, ..., C] over all but its last axis."""
  axes = tuple(range(x.ndim - 1))
  mean = jnp.mean(x, axis=axes)
  var = jnp.mean(jnp.square(x - mean), axis=axes)
  return (x - mean) * jax.lax.rsqrt(var + epsilon) * scale + bias


def conv_block(x: jax.Array, block: dict, conv_impl: str,
               compute_dtype: str = 'float32') -> jax.Array:
  """conv -> ReLU -> max-pool -> BatchNorm: [N, H, W, C_in] -> [N, H//2, W//2, C_out], `block`
  'kernel' [k, k, C_in, C_out], 'scale', 'bias' [C_out]; 'fused_cpu': one C++ call each way."""
  if ops.resolve_conv_impl(conv_impl) == 'fused_cpu':
    from cht_jax.kernels.cpu import conv_block as cpu_kernel  # pylint: disable=g-import-not-at-top
    reason = (f"it computes in float32 only, not model.compute_dtype='{compute_dtype}'"
              if compute_dtype != 'float32' else cpu_kernel.unsupported(x, block['kernel']))
    if reason is None:
      return cpu_kernel.conv_relu_pool_norm(x, block['kernel'], block['scale'], block['bias'],
                                            BATCH_NORM_EPSILON)
    if conv_impl == 'fused_cpu':
      raise ValueError(f"model.conv_impl='fused_cpu': {reason}; use auto or patches.")
    conv_impl = 'patches'
  x = ops.conv2d(x, block['kernel'], impl=conv_impl, compute_dtype=compute_dtype)
  x = max_pool_2x2(jax.nn.relu(x))
  return batch_stat_norm(x, block['scale'], block['bias'])


def dense_head(x: jax.Array, head: dict) -> jax.Array:
  """Flattens [N, H, W, C] (NHWC order) and applies the final dense layer."""
  return x.reshape(x.shape[0], -1) @ head['kernel'] + head['bias']


def feature_map_sizes(image_size: int, num_blocks: int) -> list[int]:
  """Spatial size entering each block and after the last: 28 -> [28, 14, 7, 3, 1]."""
  sizes = [image_size]
  for _ in range(num_blocks):
    sizes.append(sizes[-1] // 2)
  return sizes


class ConvBlock(nn.Module):
  """Parameter holder for one conv block; the math is `conv_block`."""
  features: int
  kernel_size: int
  conv_impl: str
  compute_dtype: str = 'float32'

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    k = self.kernel_size
    block = {
        'kernel': self.param('kernel', nn.initializers.glorot_uniform(),
                             (k, k, x.shape[-1], self.features)),
        'scale': self.param('scale', nn.initializers.ones, (self.features,)),
        'bias': self.param('bias', nn.initializers.zeros, (self.features,)),
    }
    return conv_block(x, block, self.conv_impl, self.compute_dtype)


class Head(nn.Module):
  """Parameter holder for the final dense layer; the math is `dense_head`."""
  features: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    in_dim = x.shape[1] * x.shape[2] * x.shape[3]
    head = {
        'kernel': self.param('kernel', nn.initializers.glorot_uniform(),
                             (in_dim, self.features)),
        'bias': self.param('bias', nn.initializers.zeros, (self.features,)),
    }
    return dense_head(x, head)


class CNN(nn.Module):
  """The embedding network whose weights the HyperTransformer generates; the final
  layer's `embedding_dim` outputs are K logits under the cross-entropy loss."""
  channels: Sequence[int]
  embedding_dim: int
  conv_impl: str = 'patches'
  kernel_size: int = 3
  compute_dtype: str = 'float32'

  @nn.compact
  def __call__(self, images: jax.Array) -> jax.Array:
    """[N, H, W, C] images -> [N, embedding_dim] embeddings."""
    x = images
    for i, c_out in enumerate(self.channels):
      x = ConvBlock(c_out, self.kernel_size, self.conv_impl, self.compute_dtype,
                    name=f'block_{i}')(x)
    return Head(self.embedding_dim, name='head')(x)
