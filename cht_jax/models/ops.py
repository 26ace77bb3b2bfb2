"""Convolution as patches + one matrix product, the form XLA:CPU runs fastest here.

Every convolution of the project goes through `conv2d`. Under vmap, generated
kernels make `lax.conv_general_dilated` a grouped convolution, which XLA:CPU
runs poorly; k*k shifted input copies and one matrix product do not.
"""

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from cht_jax import kernels

CONV_IMPLS = ('auto', 'patches', 'lax', 'taps', 'fused_cpu')
COMPUTE_DTYPES = ('float32', 'bfloat16')


def forward_with_gradient_of(fast: Callable, reference: Callable) -> Callable:
  """`fast` where nothing differentiates it; `reference`'s value and VJP where something does."""
  @jax.custom_vjp
  def call(*args):
    return fast(*args)

  call.defvjp(lambda *args: jax.vjp(reference, *args), lambda vjp, grad: vjp(grad))
  return call


def resolve_conv_impl(impl: str, second_order: bool = False) -> str:
  """'auto' resolved: 'fused_cpu' on CPU where its kernel compiles, else 'patches' (also under
  `second_order` differentiation, which the kernel lacks); ValueError: 'fused_cpu' cannot run."""
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
  """2-D convolution without bias, NHWC: x [N, H, W, C_in], kernel [k_h, k_w, C_in, C_out] ->
  float32 [N, H_out, W_out, C_out]. `impl` 'patches', 'lax', 'taps' or 'auto'; under 'fused_cpu'
  a lone conv runs `lax` forward and `patches`' gradient. 'bfloat16': its operands only."""
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
  if impl == 'fused_cpu':
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
