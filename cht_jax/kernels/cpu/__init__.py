"""C++ kernels for XLA:CPU (the 'fused_cpu' backend) of the model's named operations.

- 'conv_block' (`cnn.conv_block`, `model.conv_impl`): the generated CNN's
  block as one call each way, in training too (`conv_block.py`).
- 'encoder' (`transformer.Encoder`, `model.encoder_impl`): a whole stack's
  forward pass as one call, where nothing differentiates it (`encoder.py`).

`cht_jax.kernels.registry` imports this package on first use; the library is
built then (`library.py`). Why the kernels exist: with 8 channels and 28-40
tokens, XLA:CPU runs the model as thousands of small operations (patch
gathers, transposes, pooling, and each encoder layer's ~22 operations), most of
them ~1 us of work behind a thread-pool hand-off; see docs/performance.md.
Under a device mesh a custom call must run inside `shard_map` (as
`train.batch_grads` and evaluation do): XLA's partitioner does not know how to
split it and would gather the batch around it.
"""

from cht_jax.kernels import registry
from cht_jax.kernels.cpu import conv_block
from cht_jax.kernels.cpu import encoder
from cht_jax.kernels.cpu import library
from cht_jax.models import cnn

build_error = library.build_error  # What the registry asks of a backend.


def _conv_block_unsupported(x, block, conv_impl, compute_dtype):
  del conv_impl
  if compute_dtype != 'float32':
    return f"it computes in float32 only, not model.compute_dtype='{compute_dtype}'"
  return conv_block.unsupported(x, block['kernel'])


@registry.register('conv_block', 'fused_cpu', unsupported=_conv_block_unsupported)
def _conv_block(x, block, conv_impl, compute_dtype):
  del conv_impl, compute_dtype  # 'patches' and 'float32' (the only dtype it takes).
  return conv_block.conv_relu_pool_norm(x, block['kernel'], block['scale'], block['bias'],
                                        cnn.BATCH_NORM_EPSILON)


@registry.register('encoder', 'fused_cpu', forward_only=True)
def _encoder(module, params, tokens):
  return encoder.encoder_forward(params, tokens, module.num_heads, module.activation)
