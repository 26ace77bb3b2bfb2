"""model.compute_dtype='bfloat16': convolutions with bfloat16 operands, float32 accumulation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cht_jax import config_validation
from cht_jax import methods
from cht_jax.models import cnn as cnn_lib
from cht_jax.models import ops
from conftest import normal, shallow_config, tiny_config


def _round_bf16(x):
  return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))


@pytest.mark.parametrize('impl', ['patches', 'lax', 'taps'])
@pytest.mark.parametrize('stride, padding', [(1, 'SAME'), (2, 'SAME'), (2, 'VALID')])
def test_bfloat16_convs_are_float32_sums_of_rounded_operands(impl, stride, padding):
  """Every form rounds the operands to bfloat16 and sums their (exact) products in
  float32: the float32 convolution of the rounded operands, up to summation order."""
  x = normal(0, (4, 14, 14, 8))
  kernel = normal(1, (3, 3, 8, 8))
  got = ops.conv2d(x, kernel, stride, padding, impl, compute_dtype='bfloat16')
  assert got.dtype == jnp.float32
  rounded = ops.conv2d(_round_bf16(x), _round_bf16(kernel), stride, padding, 'lax')
  np.testing.assert_allclose(got, rounded, rtol=1e-5, atol=1e-5)
  exact = ops.conv2d(x, kernel, stride, padding, 'lax')
  assert np.max(np.abs(got - exact)) > 1e-4  # The rounding is really there ...
  np.testing.assert_allclose(got, exact, rtol=0.05, atol=0.05 * np.std(exact))  # ... and small.
  # Gradients reach float32 operands, in float32.
  grads = jax.grad(lambda x, k: jnp.sum(jnp.sin(ops.conv2d(x, k, stride, padding, impl,
                                                           compute_dtype='bfloat16'))),
                   (0, 1))(x, kernel)
  assert all(g.dtype == jnp.float32 and np.all(np.isfinite(g)) for g in grads)


def test_bfloat16_block_falls_back_from_the_float32_cpu_kernel():
  """'auto' runs the definition ('patches') where the kernel cannot take bfloat16."""
  x = normal(0, (6, 16, 16, 8))
  block = {'kernel': normal(1, (3, 3, 8, 8)),
           'scale': jnp.full((8,), 1.5), 'bias': jnp.full((8,), 0.1)}
  auto = cnn_lib.conv_block(x, block, 'auto', 'bfloat16')
  patches = cnn_lib.conv_block(x, block, 'patches', 'bfloat16')
  np.testing.assert_allclose(auto, patches, rtol=1e-5, atol=1e-5)
  if jax.default_backend() == 'cpu':
    with pytest.raises(ValueError, match="compute_dtype='bfloat16'"):
      cnn_lib.conv_block(x, block, 'fused_cpu', 'bfloat16')


def test_bfloat16_episode_loss_and_gradient_follow_float32(tiny_episode):
  """The whole CHT loss in mixed precision is within bfloat16 rounding of float32's,
  from the same parameters (which stay float32)."""
  results = {}
  for dtype in ('float32', 'bfloat16'):
    config = config_validation.validate(
        shallow_config(**{'model.compute_dtype': dtype, 'model.conv_impl': 'patches'}),
        num_devices=1)
    method = methods.build(config)
    params = jax.jit(method.init)(jax.random.key(0))
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))
    results[dtype] = jax.jit(jax.value_and_grad(
        lambda p, m=method: m.episode_loss(p, tiny_episode, 'class_incremental',
                                           remat=False)[0]))(params)
  (loss32, grads32), (loss16, grads16) = results['float32'], results['bfloat16']
  assert loss16 != loss32
  np.testing.assert_allclose(loss16, loss32, rtol=0.05)
  flat32, flat16 = (np.concatenate([np.ravel(g) for g in jax.tree.leaves(g)])
                    for g in (grads32, grads16))
  cosine = flat16 @ flat32 / np.linalg.norm(flat16) / np.linalg.norm(flat32)
  assert cosine > 0.95, cosine


def test_compute_dtype_mistakes_are_named():
  with pytest.raises(config_validation.ConfigError, match="model.compute_dtype = 'float16'"):
    config_validation.validate(tiny_config(**{'model.compute_dtype': 'float16'}), num_devices=1)
  with pytest.raises(config_validation.ConfigError, match='computes in float32 only'):
    config_validation.validate(tiny_config(**{'model.compute_dtype': 'bfloat16',
                                              'model.conv_impl': 'fused_cpu'}), num_devices=1)
