"""`transformer.Encoder`'s forward pass, a whole stack of layers, as one C++ call.

`encoder.cc` through the XLA FFI. No gradient: the model runs it only where
nothing differentiates the encoder.
"""

import jax
import jax.numpy as jnp
import numpy as np

from cht_jax.kernels.cpu import library

ACTIVATIONS = ('relu', 'gelu', 'leaky_relu')  # The kernel's activation codes.
# Each layer's parameters in the order the kernel reads them.
_LAYER_PARAMS = tuple(
    [(('attention', name), leaf) for name in ('query', 'key', 'value', 'output')
     for leaf in ('kernel', 'bias')]
    + [(('attention_norm',), 'scale'), (('attention_norm',), 'bias')]
    + [((name,), leaf) for name in ('ffn_inner', 'ffn_output') for leaf in ('kernel', 'bias')]
    + [(('ffn_norm',), 'scale'), (('ffn_norm',), 'bias')])


def encoder_forward(params: dict, tokens: jax.Array, num_heads: int,
                    activation: str) -> jax.Array:
  """`transformer.Encoder`'s forward pass of tokens [L, E] float32 under `params`
  ({'layer_0': ...}), equal to it up to float rounding."""
  library.load()
  leaves = []
  for i in range(len(params)):
    layer = params[f'layer_{i}']
    for path, leaf in _LAYER_PARAMS:
      module = layer
      for name in path:
        module = module[name]
      leaves.append(module[leaf])
  # 'expand_dims': unbatched parameters get size-1 leading dimensions, read as shared.
  call = jax.ffi.ffi_call('cht_encoder_forward', jax.ShapeDtypeStruct(tokens.shape, jnp.float32),
                          vmap_method='expand_dims')
  return call(tokens, *leaves, num_heads=np.int64(num_heads),
              activation=np.int64(ACTIVATIONS.index(activation)))
