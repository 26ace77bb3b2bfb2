"""Training: optimisation lowers the loss, checkpoints round-trip, resume continues."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from cht_jax import methods
from cht_jax import optim
from cht_jax import train
from cht_jax.runtime import checkpoints
from cht_jax.runtime import devices
from conftest import tiny_config, training_classes


def make_state(config, key=0):
  method = methods.build(config)
  optimizer = optim.make_optimizer(config.optim)
  state = train.make_init(method, optimizer, devices.data_mesh())(jax.random.key(key))
  return method, optimizer, state


def test_a_few_steps_lower_the_loss():
  config = tiny_config()
  ht, optimizer, state = make_state(config)
  mesh = devices.data_mesh()
  step_fn = train.make_train_step(ht, optimizer, mesh)
  images = training_classes()  # test_methods' step for this config: a cache hit.
  key = jax.random.key(3)  # The same episodes every step: the loss must fall.
  losses = []
  for _ in range(25):
    state, metrics = step_fn(state, images, key)
    losses.append(float(metrics['loss']))
  assert int(state.step) == 25
  assert np.all(np.isfinite(losses))
  assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize('name', ['sgd', 'momentum', 'adam'])
def test_optimizers_and_schedule(name):
  config = tiny_config(**{'optim.name': name, 'optim.learning_rate': 0.1,
                          'optim.decay_steps': 10, 'optim.decay_rate': 0.5})
  schedule = optim.learning_rate_schedule(config.optim)
  # Continuous decay, as tf.train.exponential_decay in the original HT: 0.1 * 0.5**(s / 10).
  np.testing.assert_allclose([schedule(0), schedule(9), schedule(10), schedule(25)],
                             [0.1, 0.1 * 0.5**0.9, 0.05, 0.1 * 0.5**2.5], rtol=1e-6)
  assert optim.make_optimizer(config.optim) is not None


def test_unknown_optimizer_is_named():
  with pytest.raises(ValueError, match='optim.name'):
    optim.make_optimizer(tiny_config(**{'optim.name': 'lbfgs'}).optim)


def test_checkpoint_round_trip(tmp_path):
  config = tiny_config()
  _, _, state = make_state(config, key=5)
  state = state.replace(step=jnp.asarray(7, jnp.int32))
  manager = checkpoints.manager(str(tmp_path), config)
  manager.save(7, args=ocp.args.StandardSave(state))
  manager.wait_until_finished()
  _, _, fresh = make_state(config, key=6)
  restored = checkpoints.restore_or_init(manager, fresh)
  assert int(restored.step) == 7
  jax.tree.map(np.testing.assert_array_equal, restored.params, state.params)
  jax.tree.map(np.testing.assert_array_equal, restored.opt_state, state.opt_state)
  manager.close()
