"""Convolution as patches + one matrix product, the form XLA:CPU runs fastest here.

Every convolution of the project (the generated CNN's and the feature
extractors') goes through `conv2d`. With per-episode generated kernels under
vmap, `lax.conv_general_dilated` becomes a grouped convolution, which XLA:CPU
runs poorly; its kernel gradient is slow even for shared kernels. Gathering
the k*k shifted (strided) copies of the input and running one matrix product
turns forward and backward passes into batched matrix products instead.
See docs/performance.md for the measurements.

`compute_dtype` 'bfloat16' (mixed precision, an option; 'float32' is the
paper's arithmetic) rounds both operands of every convolution to bfloat16 and
accumulates the products in float32: the patches, the largest tensor of a
step, take half the memory traffic, and the output stays float32 for what
follows (ReLU, pooling, BatchNorm).

`conv_impl` also chooses a backend for the generated CNN's blocks
(`cnn.conv_block`): 'fused_cpu' runs them as C++ kernels on CPU
(`cht_jax.kernels.cpu`); 'auto' picks it where it runs (`resolve_conv_impl`).
There is no kernel for a lone convolution: under 'fused_cpu' `conv2d` takes
the form below that is fastest there (`forward_with_gradient_of`).
"""

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from cht_jax import kernels

CONV_IMPLS = ('auto', 'patches', 'lax', 'taps', 'fused_cpu')
COMPUTE_DTYPES = ('float32', 'bfloat16')


def forward_with_gradient_of(fast: Callable, reference: Callable) -> Callable:
  """`fast` where nothing differentiates it; `reference`'s value and VJP where something does.

  For forward-only passes (generating theta to evaluate or deploy) that have a
  faster form with no gradient of its own (conv2d's 'fused_cpu' form, the
  encoder's kernel): training, which differentiates, runs exactly `reference`,
  and forward-only calls get `fast`, equal up to float rounding (tested). Both
  take and return arrays (close over the rest).
  """
  @jax.custom_vjp
  def call(*args):
    return fast(*args)

  call.defvjp(lambda *args: jax.vjp(reference, *args), lambda vjp, grad: vjp(grad))
  return call


def resolve_conv_impl(impl: str, second_order: bool = False) -> str:
  """The implementation `impl` stands for on this backend: 'auto' is resolved.

  'auto' is 'fused_cpu' on CPU where its kernel compiles, else 'patches' (also
  where the model is differentiated twice, which the kernel does not support).

  Raises:
    ValueError: 'fused_cpu' asked for where it cannot run.
  """
  if second_order and impl == 'auto':
    return 'patches'
  if second_order and impl == 'fused_cpu' and jax.default_backend() == 'cpu':
    raise ValueError("model.conv_impl='fused_cpu' has no second derivative, which "
                     'second-order MAML needs; use auto or patches.')
  return kernels.resolve('model.conv_impl', impl, CONV_IMPLS, fallback='patches')


def _padding(size: int, kernel: int, stride: int, padding: str) -> tuple[int, int]:
  """(before, after) padding of one spatial axis, as XLA/TF define 'SAME' and 'VALID'."""
  if padding == 'VALID':
    return 0, 0
  out = -(-size // stride)
  total = max((out - 1) * stride + kernel - size, 0)
  return total // 2, total - total // 2


def conv2d(x: jax.Array, kernel: jax.Array, stride: int = 1, padding: str = 'SAME',
           impl: str = 'patches', compute_dtype: str = 'float32') -> jax.Array:
  """2-D convolution without bias, NHWC.

  Args:
    x: [N, H, W, C_in].
    kernel: [k_h, k_w, C_in, C_out].
    stride: the same in both spatial dimensions.
    padding: 'SAME' or 'VALID'.
    impl: 'patches' (shifted copies + one matrix product) or 'lax'
      (`lax.conv_general_dilated`); both give the same numbers. 'auto' is
      resolved (`resolve_conv_impl`). 'fused_cpu' fuses the generated CNN's
      blocks (`cnn.conv_block`); the other convs then run `lax` where nothing
      differentiates them (faster there on CPU) and `patches` where something
      does (`forward_with_gradient_of`).
    compute_dtype: 'float32', or 'bfloat16': operands rounded to bfloat16,
      products accumulated in float32.

  Returns:
    [N, H_out, W_out, C_out], float32.
  """
  impl = resolve_conv_impl(impl)
  if compute_dtype not in COMPUTE_DTYPES:
    raise ValueError(f'Unknown compute_dtype {compute_dtype!r}; expected one of '
                     f'{COMPUTE_DTYPES}.')
  x, kernel = x.astype(compute_dtype), kernel.astype(compute_dtype)
  lax_conv = functools.partial(_lax_conv, stride=stride, padding=padding)
  patches_conv = functools.partial(_patches_conv, stride=stride, padding=padding)
  if impl == 'lax':
    return lax_conv(x, kernel)
  if impl == 'taps':
    return _taps_conv(x, kernel, stride=stride, padding=padding)
  if impl == 'fused_cpu':  # No kernel for a lone conv: the forms fastest on CPU.
    return forward_with_gradient_of(lax_conv, patches_conv)(x, kernel)
  return patches_conv(x, kernel)


def _lax_conv(x: jax.Array, kernel: jax.Array, stride: int, padding: str) -> jax.Array:
  return jax.lax.conv_general_dilated(
      x, kernel, window_strides=(stride, stride), padding=padding,
      dimension_numbers=('NHWC', 'HWIO', 'NHWC'), preferred_element_type=jnp.float32)


def _shifted_views(x: jax.Array, kh: int, kw: int, stride: int, padding: str) -> list:
  """The kh*kw shifted (strided) views of padded `x`, tap (i, j) in row-major order:
  view[i * kw + j][n, y, x', c] = x_padded[n, i + stride * y, j + stride * x', c]."""
  _, h, w, _ = x.shape
  pad_h, pad_w = _padding(h, kh, stride, padding), _padding(w, kw, stride, padding)
  x = jnp.pad(x, ((0, 0), pad_h, pad_w, (0, 0)))
  out_h = (x.shape[1] - kh) // stride + 1
  out_w = (x.shape[2] - kw) // stride + 1
  return [x[:, i:i + stride * (out_h - 1) + 1:stride, j:j + stride * (out_w - 1) + 1:stride, :]
          for i in range(kh) for j in range(kw)]


def _taps_conv(x: jax.Array, kernel: jax.Array, stride: int, padding: str) -> jax.Array:
  """A sum of k*k products of shifted (strided) views with kernel[i, j]: no patches
  tensor (k*k times the input) is written, which on a GPU is the step's largest cost."""
  kh, kw, c_in, c_out = kernel.shape
  taps = kernel.reshape(kh * kw, c_in, c_out)
  out = 0.0
  for view, tap in zip(_shifted_views(x, kh, kw, stride, padding), taps):
    out = out + jnp.matmul(view, tap, preferred_element_type=jnp.float32)
  return out


def _patches_conv(x: jax.Array, kernel: jax.Array, stride: int, padding: str) -> jax.Array:
  kh, kw, c_in, c_out = kernel.shape
  # Patch features in (kh, kw, c_in) order, matching kernel.reshape(-1, c_out).
  patches = jnp.concatenate(_shifted_views(x, kh, kw, stride, padding), axis=-1)
  return jnp.matmul(patches, kernel.reshape(kh * kw * c_in, c_out),
                    preferred_element_type=jnp.float32)
