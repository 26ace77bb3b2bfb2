"""The CPU kernel of the generated conv block (`conv_impl='fused_cpu'`): the numbers and
gradients of its Python definition, `cnn.conv_block`, under jit, vmap and a whole training
step; where it is chosen and where not; how its library is built."""

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cht_jax import continual
from cht_jax import models
from cht_jax.kernels.cpu import library
from cht_jax.models import cnn as cnn_lib
from cht_jax.models import ops
from conftest import init_params, normal, override, shallow_config, tiny_config

pytestmark = pytest.mark.skipif(jax.default_backend() != 'cpu',
                                reason='the fused_cpu kernels run on CPU hosts only')

MISMATCH = ("The CPU kernel no longer matches the Python definition of op 'conv_block' "
            '(cht_jax/models/cnn.py:conv_block): change cht_jax/kernels/cpu/conv_block.cc '
            'to the new math.')


def block_fn(impl):
  """`cnn.conv_block`, the function the model calls, as a function of arrays."""
  return lambda x, kernel, scale, bias: cnn_lib.conv_block(
      x, {'kernel': kernel, 'scale': scale, 'bias': bias}, impl)


fused_block = block_fn('fused_cpu')
# The definition itself: the setting that no kernel stands in for ('auto''s fallback).
definition_block = block_fn('patches')


@pytest.mark.parametrize('lead, n, size, c_in, c_out, k', [
    ((), 20, 28, 1, 8, 3), ((), 20, 14, 8, 8, 3), ((), 5, 7, 8, 8, 3), ((), 6, 3, 8, 8, 3),
    ((), 2, 9, 3, 16, 3), ((), 2, 10, 5, 64, 5), ((), 3, 6, 16, 32, 1),
    ((3,), 5, 9, 3, 32, 3), ((2,), 4, 6, 8, 64, 3),
    # Narrower than a vector of 8: computed 8 wide, the extra channels zero.
    ((), 20, 28, 1, 4, 3), ((2,), 5, 7, 4, 6, 3)])
def test_block_forward_and_gradients_match_the_definition(lead, n, size, c_in, c_out, k):
  seed = 5 * (size * c_in + c_out)
  x = normal(seed, (*lead, n, size, size, c_in))
  kernel = 0.5 * normal(seed + 1, (*lead, k, k, c_in, c_out))
  scale = normal(seed + 2, (*lead, c_out))
  bias = normal(seed + 3, (*lead, c_out))
  d_out = normal(seed + 4, (*lead, n, size // 2, size // 2, c_out))
  fused, expected = fused_block, definition_block
  for _ in lead:  # One batched call (vmap's 'broadcast_all'), each episode its own statistics.
    fused, expected = jax.vmap(fused), jax.vmap(expected)
  forward_only = jax.jit(fused)(x, kernel, scale, bias)
  # The gradients and the output, each side one compiled program.
  vjp_and_output = lambda fn: jax.jit(lambda *a: jax.vjp(fn, *a[:4])[1](a[4]) + (fn(*a[:4]),))
  got = vjp_and_output(fused)(x, kernel, scale, bias, d_out)
  want = vjp_and_output(expected)(x, kernel, scale, bias, d_out)
  for a, b in zip(got, want):
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.abs(b).max()),
                               err_msg=MISMATCH)
  np.testing.assert_allclose(forward_only, want[-1], rtol=1e-5, atol=1e-5, err_msg=MISMATCH)
  # Normalised: each channel's mean is its bias (the statistics are the output's own).
  np.testing.assert_allclose(forward_only.mean(axis=(-4, -3, -2)), bias, atol=1e-4)


def test_block_under_vmap_with_shared_parameters():
  """Shared kernel, scale and bias (in_axes None): their gradients sum over episodes."""
  x = normal(0, (3, 4, 14, 14, 8))
  kernel = 0.3 * normal(1, (3, 3, 8, 8))
  scale, bias = jnp.linspace(0.5, 2.0, 8), jnp.linspace(-1.0, 1.0, 8)
  loss = lambda fn: lambda *a: jnp.sum(jnp.sin(jax.vmap(fn, (0, None, None, None))(*a)))
  got = jax.jit(jax.value_and_grad(loss(fused_block), (0, 1, 2, 3)))(x, kernel, scale, bias)
  want = jax.jit(jax.value_and_grad(loss(definition_block), (0, 1, 2, 3)))(x, kernel, scale, bias)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.abs(b).max()),
                               err_msg=MISMATCH)


def test_conv_block_keeps_residuals_only_where_differentiated():
  x = normal(0, (6, 14, 14, 8))
  block = {'kernel': 0.3 * normal(1, (3, 3, 8, 8)),
           'scale': jnp.linspace(0.5, 2.0, 8), 'bias': jnp.linspace(-1.0, 1.0, 8)}
  forward = lambda block: cnn_lib.conv_block(x, block, 'fused_cpu')
  forward_only = str(jax.make_jaxpr(forward)(block))
  differentiated = str(jax.make_jaxpr(jax.grad(lambda b: jnp.sum(forward(b) ** 3)))(block))
  assert 'cht_conv_block_norm_forward' in forward_only and 'train' not in forward_only
  assert 'cht_conv_block_norm_train_forward' in differentiated
  assert 'cht_conv_block_norm_backward' in differentiated


def test_a_training_loss_and_its_gradient_match_the_definition(tiny_episode):
  """The whole CHT loss (generation through the fused blocks, T(T+1)/2 query passes)."""
  results = {}
  for impl in ('patches', 'fused_cpu'):
    config = shallow_config(**{'model.conv_impl': impl})
    ht = models.build_hypertransformer(config)
    assert ht.conv_impl == impl
    params, _ = init_params(ht, tiny_episode)
    loss = lambda p: continual.episode_loss(ht, p, tiny_episode, remat=False)[0]
    results[impl] = jax.jit(jax.value_and_grad(loss))(params)
  (loss_p, grads_p), (loss_f, grads_f) = results['patches'], results['fused_cpu']
  np.testing.assert_allclose(loss_f, loss_p, rtol=1e-5, err_msg=MISMATCH)
  difference = optax.tree.norm(jax.tree.map(jnp.subtract, grads_f, grads_p))
  assert float(difference) < 1e-4 * float(optax.tree.norm(grads_p)), MISMATCH


def test_auto_picks_the_kernel_on_cpu_except_for_second_order():
  assert ops.resolve_conv_impl('auto') == 'fused_cpu'
  assert ops.resolve_conv_impl('auto', second_order=True) == 'patches'
  assert ops.resolve_conv_impl('patches') == 'patches'
  with pytest.raises(ValueError, match='second derivative'):
    ops.resolve_conv_impl('fused_cpu', second_order=True)
  with pytest.raises(ValueError, match='expected one of'):
    ops.resolve_conv_impl('fft')


def test_auto_falls_back_where_the_kernel_does_not_fit():
  """72 output channels: 'auto' runs patches, an explicit 'fused_cpu' says why not."""
  x = normal(0, (2, 4, 4, 1))
  block = {'kernel': normal(1, (3, 3, 1, 72)),
           'scale': jnp.ones(72), 'bias': jnp.zeros(72)}
  np.testing.assert_array_equal(cnn_lib.conv_block(x, block, 'auto'),
                                cnn_lib.conv_block(x, block, 'patches'))
  with pytest.raises(ValueError, match=r'C_out <= 64.*use auto or patches'):
    cnn_lib.conv_block(x, block, 'fused_cpu')


def test_a_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
  monkeypatch.setenv('CHT_JAX_KERNEL_CACHE', str(tmp_path))
  monkeypatch.setenv('CXX', str(tmp_path / 'no-such-compiler'))
  with pytest.raises(library.KernelBuildError, match='conv_impl=patches'):
    library.build()
  assert not list(tmp_path.glob('*.so'))


def test_the_build_is_cached(tmp_path, monkeypatch):
  # The compiler: one that counts its calls and writes the library the suite has built
  # (every fused test compiles the real sources), so the cache's logic runs in no time.
  real = library.build()
  compiler = tmp_path / 'cxx'
  compiler.write_text('#!/bin/sh\n'
                      f'echo called >> {tmp_path / "calls"}\n'
                      'while [ "$#" -gt 2 ]; do shift; done\n'  # Leaves -o <output>.
                      f'cp {real} "$2"\n')
  compiler.chmod(0o755)
  monkeypatch.setenv('CXX', str(compiler))
  monkeypatch.setenv('CHT_JAX_KERNEL_CACHE', str(tmp_path / 'cache'))
  built = library.build()
  assert built.parent == tmp_path / 'cache' and built.read_bytes() == real.read_bytes()
  modified = built.stat().st_mtime_ns
  assert library.build() == built
  assert built.stat().st_mtime_ns == modified
  assert (tmp_path / 'calls').read_text() == 'called\n'  # Once: the second build is a hit.
  assert [p.name for p in (tmp_path / 'cache').iterdir()] == [built.name]  # No temporaries.


def test_configs_default_to_auto_and_validation_names_the_field():
  from cht_jax import config_validation  # pylint: disable=g-import-not-at-top
  assert tiny_config().model.conv_impl == 'auto'
  maml = override(tiny_config(**{'model.conv_impl': 'fused_cpu'}), {'method': 'maml'})
  with pytest.raises(config_validation.ConfigError, match='second derivative'):
    config_validation.validate(maml, num_devices=1)


def test_every_cpu_kernel_is_checked_against_its_definition():
  """Each kernel the model calls has its tests here or in test_fused_cpu_encoder.py."""
  called = set()
  for path in pathlib.Path(cnn_lib.__file__).parent.glob('*.py'):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module == 'cht_jax.kernels.cpu':
        called.update((path.stem, alias.name) for alias in node.names)
  assert called == {('cnn', 'conv_block'), ('transformer', 'encoder')}, (
      'A kernel the model calls in a new place needs a test against its Python definition.')
