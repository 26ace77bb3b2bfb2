"""The generated CNN's block, conv -> ReLU -> 2x2 max-pool -> BatchNorm, as one C++ call each way.

`conv_block.cc` through the XLA FFI: `cnn.conv_block`'s numbers up to float
rounding, and its first derivative except where a pooling window's positive
maxima tie (the first gets it all; JAX's reduce-max splits it).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from cht_jax.kernels.cpu import library


# The output widths the C++ code is compiled for (vectors of 8 floats); a narrower block is
# computed at the next of them, its extra channels all zeros (zero kernel, scale and bias).
OUTPUT_CHANNELS = (8, 16, 32, 64)


def _pooled_shapes(x: jax.Array, kernel: jax.Array):
  *lead, h, w, _ = x.shape
  shape = (*lead, h // 2, w // 2, kernel.shape[-1])
  return jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, jnp.int8)


def unsupported(x: jax.Array, kernel: jax.Array) -> str | None:
  """Why the kernel cannot take these inputs, or None."""
  if x.dtype != jnp.float32 or kernel.dtype != jnp.float32:
    return f'it handles float32 only, got {x.dtype} and {kernel.dtype}'
  k = kernel.shape[0]
  if (x.ndim != 4 or kernel.ndim != 4 or kernel.shape[1] != k or k % 2 != 1
      or kernel.shape[2] != x.shape[-1] or kernel.shape[3] > OUTPUT_CHANNELS[-1]):
    return (f'it needs x [N, H, W, C_in] and an odd square kernel [k, k, C_in, C_out] '
            f'with C_out <= {OUTPUT_CHANNELS[-1]}, got {kernel.shape} for {x.shape}')
  return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _conv_relu_pool_norm(x, kernel, scale, bias, epsilon):
  # Where nothing differentiates it: no pooling winners or statistics kept.
  call = jax.ffi.ffi_call('cht_conv_block_norm_forward', _pooled_shapes(x, kernel)[0],
                          vmap_method='broadcast_all')
  return call(x, kernel, scale, bias, epsilon=np.float32(epsilon))


def _norm_fwd(x, kernel, scale, bias, epsilon):
  pooled, winner = _pooled_shapes(x, kernel)
  stats = jax.ShapeDtypeStruct(scale.shape, jnp.float32)  # mean and 1 / std, [C_out].
  call = jax.ffi.ffi_call('cht_conv_block_norm_train_forward',
                          (pooled, pooled, winner, stats, stats), vmap_method='broadcast_all')
  y, pooled, winner, mean, inv = call(x, kernel, scale, bias, epsilon=np.float32(epsilon))
  return y, (x, kernel, scale, pooled, winner, mean, inv)


def _norm_bwd(epsilon, residuals, dy):
  del epsilon
  x, kernel, scale = residuals[:3]
  shapes = tuple(jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in (x, kernel, scale, scale))
  return tuple(jax.ffi.ffi_call('cht_conv_block_norm_backward', shapes,
                                vmap_method='broadcast_all')(*residuals, dy))


_conv_relu_pool_norm.defvjp(_norm_fwd, _norm_bwd)


def conv_relu_pool_norm(x: jax.Array, kernel: jax.Array, scale: jax.Array, bias: jax.Array,
                        epsilon: float) -> jax.Array:
  """`cnn.conv_block` on the CPU, one call each way; ValueError for inputs it cannot take
  (`unsupported`)."""
  reason = unsupported(x, kernel)
  if reason:
    raise ValueError(f"model.conv_impl='fused_cpu': {reason}; use auto or patches.")
  library.load()
  channels = kernel.shape[-1]
  width = next(c for c in OUTPUT_CHANNELS if c >= channels)
  if width == channels:
    return _conv_relu_pool_norm(x, kernel, scale, bias, epsilon)
  # A zero channel stays zero through ReLU, pooling and the norm (scale 0), and the padding's
  # gradient is the slice of the kernel's: the block's numbers and derivatives are unchanged.
  pad = lambda a: jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, width - channels)])
  return _conv_relu_pool_norm(x, pad(kernel), pad(scale), pad(bias), epsilon)[..., :channels]
