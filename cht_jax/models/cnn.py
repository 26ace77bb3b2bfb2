"""The generated CNN: HT's `maxpool-4-layer` network (paper, "Experiments").

Four blocks of 3x3 conv (stride 1, `same`, no bias) -> ReLU -> 2x2 max-pool ->
BatchNorm on the statistics of the batch it is applied to, then flatten (NHWC)
and a dense embedding layer.

The same `CNN` module serves two ways of filling it: the HyperTransformer emits
a pytree with exactly the structure of its `params` (so a generated network
runs as `cnn.apply({'params': theta}, images)`), and ConstPN trains it as an
ordinary network. The pure functions below hold the math once; both the module
and the weight generator (which pushes the support batch through each freshly
generated block) call them.

Parameter pytree (`theta`), for `channels=(8, 8, 8, 8)`, 28x28x1 inputs:
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
  """2x2 max-pool, stride 2, `valid` padding: [N, H, W, C] -> [N, H//2, W//2, C].

  Written as a reshape and a max rather than `reduce_window`: same numbers,
  and its gradient avoids `select_and_scatter`, which XLA:CPU runs slowly.
  """
  n, h, w, c = x.shape
  x = x[:, :h // 2 * 2, :w // 2 * 2, :]
  return x.reshape(n, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


def batch_stat_norm(x: jax.Array, scale: jax.Array, bias: jax.Array,
                    epsilon: float = BATCH_NORM_EPSILON) -> jax.Array:
  """BatchNorm with the statistics of `x` itself (no running averages).

  Args:
    x: [N, ..., C] ([N, H, W, C] in the CNN); mean and variance are taken
      over every axis but the last.
    scale, bias: [C].
    epsilon: added to the variance.
  """
  axes = tuple(range(x.ndim - 1))
  mean = jnp.mean(x, axis=axes)
  var = jnp.mean(jnp.square(x - mean), axis=axes)
  return (x - mean) * jax.lax.rsqrt(var + epsilon) * scale + bias


def conv_block(x: jax.Array, block: dict, conv_impl: str,
               compute_dtype: str = 'float32') -> jax.Array:
  """conv -> ReLU -> max-pool -> BatchNorm: [N, H, W, C_in] -> [N, H//2, W//2, C_out].

  `block` holds 'kernel' [k, k, C_in, C_out], 'scale' and 'bias' [C_out]; the
  conv computes in `compute_dtype` (`ops.conv2d`), the rest in float32.
  Where `conv_impl` resolves to 'fused_cpu' (`ops.resolve_conv_impl`) and the
  kernel takes these shapes, the block runs as one C++ call each way instead
  (`cht_jax.kernels.cpu.conv_block`), which must equal what follows; 'auto'
  runs 'patches' where it does not take them.
  """
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
  """The embedding network whose weights the HyperTransformer generates.

  Attributes:
    channels: output channels of each conv block.
    embedding_dim: width of the final dense layer (an embedding for the
      prototypical loss, K logits for cross-entropy).
    conv_impl, compute_dtype: see `ops.conv2d`.
    kernel_size: conv kernel size (3 in the paper).
  """
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
