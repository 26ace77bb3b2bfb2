"""Convolution as patches + one matrix product, the form XLA:CPU runs fastest here.

Every convolution of the project (the generated CNN's and the feature
extractors') goes through `conv2d`. With per-episode generated kernels under
vmap, `lax.conv_general_dilated` becomes a grouped convolution, which XLA:CPU
runs poorly; its kernel gradient is slow even for shared kernels. Gathering
the k*k shifted (strided) copies of the input and running one matrix product
turns forward and backward passes into batched matrix products instead.
See docs/performance.md for the measurements.
"""

import jax
import jax.numpy as jnp

CONV_IMPLS = ('patches', 'lax')


def _padding(size: int, kernel: int, stride: int, padding: str) -> tuple[int, int]:
  """(before, after) padding of one spatial axis, as XLA/TF define 'SAME' and 'VALID'."""
  if padding == 'VALID':
    return 0, 0
  out = -(-size // stride)
  total = max((out - 1) * stride + kernel - size, 0)
  return total // 2, total - total // 2


def conv2d(x: jax.Array, kernel: jax.Array, stride: int = 1, padding: str = 'SAME',
           impl: str = 'patches') -> jax.Array:
  """2-D convolution without bias, NHWC.

  Args:
    x: [N, H, W, C_in].
    kernel: [k_h, k_w, C_in, C_out].
    stride: the same in both spatial dimensions.
    padding: 'SAME' or 'VALID'.
    impl: 'patches' (shifted copies + one matrix product) or 'lax'
      (`lax.conv_general_dilated`); both give the same numbers.

  Returns:
    [N, H_out, W_out, C_out].
  """
  if impl == 'lax':
    return jax.lax.conv_general_dilated(
        x, kernel, window_strides=(stride, stride), padding=padding,
        dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
  if impl != 'patches':
    raise ValueError(f'Unknown conv_impl {impl!r}; expected one of {CONV_IMPLS}.')
  kh, kw, c_in, c_out = kernel.shape
  _, h, w, _ = x.shape
  pad_h, pad_w = _padding(h, kh, stride, padding), _padding(w, kw, stride, padding)
  x = jnp.pad(x, ((0, 0), pad_h, pad_w, (0, 0)))
  out_h = (x.shape[1] - kh) // stride + 1
  out_w = (x.shape[2] - kw) // stride + 1
  # Patch features in (kh, kw, c_in) order, matching kernel.reshape(-1, c_out).
  patches = jnp.concatenate([
      x[:, i:i + stride * (out_h - 1) + 1:stride, j:j + stride * (out_w - 1) + 1:stride, :]
      for i in range(kh) for j in range(kw)], axis=-1)
  return patches @ kernel.reshape(kh * kw * c_in, c_out)
