"""Feature extractors that turn support samples into transformer tokens (paper, section 4)."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from cht_jax.models import ops


class Conv(nn.Module):
  """A convolution with bias whose math is `ops.conv2d` (Glorot-uniform, zero bias)."""
  features: int
  kernel_size: int
  stride: int = 1
  padding: str = 'SAME'
  impl: str = 'patches'
  compute_dtype: str = 'float32'

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.param('kernel', nn.initializers.glorot_uniform(),
                        (self.kernel_size, self.kernel_size, x.shape[-1], self.features))
    bias = self.param('bias', nn.initializers.zeros, (self.features,))
    return ops.conv2d(x, kernel, self.stride, self.padding, self.impl,
                      self.compute_dtype) + bias


class ImageFeatureExtractor(nn.Module):
  """Shared by all generated layers: 3x3 `same` convs, stride 2 but the last, ReLU
  after each, then the spatial mean: [N, H, W, C] -> [N, features]."""
  features: int
  num_layers: int = 4
  kernel_size: int = 3
  conv_impl: str = 'patches'
  compute_dtype: str = 'float32'

  @nn.compact
  def __call__(self, images: jax.Array) -> jax.Array:
    x = images
    for i in range(self.num_layers):
      stride = 2 if i < self.num_layers - 1 else 1
      x = Conv(self.features, self.kernel_size, stride, 'SAME', self.conv_impl,
               self.compute_dtype, name=f'conv_{i}')(x)
      x = jax.nn.relu(x)
    return jnp.mean(x, axis=(1, 2))


def activation_conv_plan(input_size: int, num_layers: int, kernel_size: int = 3):
  """(kernel, stride) of each activation extractor conv, as in the original HT code:
  a map smaller than the kernel shrinks the kernel (stride 1); else stride 2 but
  for the last conv; convs stop once the map is smaller than the kernel."""
  if input_size < kernel_size:
    kernel_size, default_stride = input_size, 1
  else:
    default_stride = 2
  plan, size = [], input_size
  for i in range(num_layers):
    if size < kernel_size:
      break
    stride = default_stride if i < num_layers - 1 else 1
    plan.append((kernel_size, stride))
    size = (size - kernel_size) // stride + 1
  return plan


class ActivationFeatureExtractor(nn.Module):
  """Per-layer features of a generated layer's input: `valid` convs (`activation_conv_plan`)
  with ReLU between, each pre-ReLU spatial mean concatenated: -> [N, features * convs]."""
  features: int
  num_layers: int = 2
  kernel_size: int = 3
  conv_impl: str = 'patches'
  compute_dtype: str = 'float32'

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    outputs = []
    for i, (k, stride) in enumerate(
        activation_conv_plan(x.shape[1], self.num_layers, self.kernel_size)):
      x = Conv(self.features, k, stride, 'VALID', self.conv_impl, self.compute_dtype,
               name=f'conv_{i}')(x)
      outputs.append(jnp.mean(x, axis=(1, 2)))
      x = jax.nn.relu(x)
    return jnp.concatenate(outputs, axis=-1)
