"""C++ kernels for XLA:CPU: the 'fused_cpu' setting of `model.conv_impl` and `model.encoder_impl`.

`conv_block`: the generated CNN's block; `encoder`: an encoder stack's forward
pass. XLA:CPU runs them as many tiny operations (docs/performance.md). Under a
device mesh a custom call must run inside `shard_map`.
"""
