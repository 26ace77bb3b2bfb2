"""C++ kernels for XLA:CPU: the 'fused_cpu' setting of `model.conv_impl` and `model.encoder_impl`.

- `conv_block.conv_relu_pool_norm`: the generated CNN's block
  (`models/cnn.py:conv_block`, which calls it) as one call each way, in
  training too.
- `encoder.encoder_forward`: a whole stack's forward pass
  (`models/transformer.py:Encoder`, which calls it) as one call, where nothing
  differentiates it.

Each is imported where the model runs it, and builds and loads the library
(`library.py`) on its first call. Why the kernels exist: with 8 channels and
28-40 tokens, XLA:CPU runs the model as thousands of small operations (patch
gathers, transposes, pooling, and each encoder layer's ~22 operations), most of
them ~1 us of work behind a thread-pool hand-off; see docs/performance.md.
Under a device mesh a custom call must run inside `shard_map` (as
`train.batch_grads` and evaluation do): XLA's partitioner does not know how to
split it and would gather the batch around it.
"""
