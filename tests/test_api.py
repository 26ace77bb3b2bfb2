"""The library API (cht_jax/api.py) refuses what it would misread, in Python's words."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from cht_jax import api
from cht_jax import methods
from cht_jax import optim
from cht_jax import train
from cht_jax.runtime import checkpoints
from cht_jax.runtime import devices

from conftest import class_images, tiny_config


@pytest.fixture(scope='module')
def model():
  config = tiny_config()  # 3-way, 16 x 16 x 1.
  return api.model_from_params(config, methods.build(config).init(jax.random.key(0)))


@pytest.fixture(scope='module')
def support():
  return class_images(num_classes=3, images_per_class=2, size=16).reshape(6, 16, 16, 1)


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
  """A workdir with training's config.json and a checkpoint of step 3."""
  config = tiny_config()
  optimizer = optim.make_optimizer(config.optim)
  state = train.make_init(methods.build(config), optimizer,
                          devices.data_mesh())(jax.random.key(0))
  state = state.replace(step=jnp.asarray(3, jnp.int32))
  path = str(tmp_path_factory.mktemp('api_workdir'))
  manager = checkpoints.manager(path, config)
  manager.save(3, args=ocp.args.StandardSave(state))
  manager.wait_until_finished()
  manager.close()
  with open(os.path.join(path, 'config.json'), 'w') as f:
    f.write(config.to_json_best_effort())
  return path


def test_a_class_without_support_images_is_named(model, support):
  labels = np.array([0, 0, 1, 1, 0, 1])  # No image of class 2.
  with pytest.raises(ValueError, match=r'no image of class 2\b.*3-way'):
    api.learn_task(model, support, labels)
  with pytest.raises(ValueError, match=r'no image of classes 1, 2\b'):
    api.learn_task(model, support[:2], np.array([0, 0]))
  theta, prototypes = api.learn_task(model, support, np.array([0, 0, 1, 1, 2, 2]))
  assert prototypes.shape[:2] == (1, 3) and bool(jnp.all(jnp.isfinite(prototypes)))


@pytest.mark.parametrize('images', [
    lambda x: x.astype(np.float32),  # Pixels 0..255 as floats.
    lambda x: x.astype(np.int64),  # As integers of another type than uint8.
    lambda x: x.astype(np.float32) / 128 - 3,  # Normalised, then shifted.
])
def test_unnormalised_images_are_refused(model, support, images):
  labels = np.repeat(np.arange(3), 2)
  with pytest.raises(ValueError, match=r'support_images are .* not normalised.*Pass uint8'
                                       r'.*x / 128 - 1'):
    api.learn_task(model, images(support), labels)
  theta, prototypes = api.learn_task(model, support, labels)
  with pytest.raises(ValueError, match=r'images are .* not normalised'):
    api.classify(model, theta, prototypes, images(support))
  # Normalised floats are what uint8 images become: the same weights.
  floats = api.learn_task(model, support.astype(np.float32) / 128 - 1, labels)
  jax.tree.map(np.testing.assert_array_equal, floats.theta, theta)


def test_labels_must_be_integers(model, support):
  with pytest.raises(ValueError, match=r'support_labels must be integers 0\.\.2, got dtype '
                                       r'float64'):
    api.learn_task(model, support, np.repeat(np.arange(3), 2).astype(np.float64))
  with pytest.raises(ValueError, match=r'integers.*dtype bool'):
    api.learn_task(model, support[:3], np.array([True, False, True]))
  memory = api.learn_task(model, support, [0, 0, 1, 1, 2, 2])  # A list of ints is fine.
  assert memory.prototypes.shape[0] == 1


def test_empty_inputs_are_named(model, support):
  labels = np.repeat(np.arange(3), 2)
  for images, empty in ((support[:0], []), (support, []), (support[:0], labels)):
    with pytest.raises(ValueError, match=rf'learn_task got {len(images)} support images and '
                       rf'{len(empty)} labels: .* each class 0\.\.2 \(the model is 3-way\)'):
      api.learn_task(model, images, empty)
  theta, prototypes = api.learn_task(model, support, labels)
  for task in (0, None):
    with pytest.raises(ValueError, match=r'images has no image \(shape \(0, 16, 16, 1\)\): '
                                         r'pass at least one'):
      api.classify(model, theta, prototypes, support[:0], task=task)


def test_load_model_names_a_missing_workdir(tmp_path):
  missing = str(tmp_path / 'no_such_run')
  with pytest.raises(FileNotFoundError, match=r'workdir .*no_such_run does not exist'):
    api.load_model(missing)
  with pytest.raises(FileNotFoundError, match=r'does not exist'):
    api.load_model(missing, tiny_config())


def test_load_model_errors_name_its_arguments(workdir, tmp_path):
  model = api.load_model(workdir, step=3)
  assert model.step == 3 and model.num_ways == 3
  with pytest.raises(checkpoints.CheckpointError) as error:
    api.load_model(workdir, step=7)
  message = str(error.value)
  assert 'step 7' in message and '[3]' in message
  assert 'load_model(..., step=N)' in message and '--checkpoint_step' not in message
  # A model of another config: name load_model's config argument, not --config flags.
  with pytest.raises(checkpoints.CheckpointError) as error:
    api.load_model(workdir, tiny_config(**{'model.channels': 6}))
  message = str(error.value)
  assert 'does not fit' in message and 'config=' in message and '--config' not in message
  # A workdir without checkpoints: its workdir argument, not --workdir.
  empty = tmp_path / 'empty'
  empty.mkdir()
  with open(empty / 'config.json', 'w') as f:
    json.dump(json.loads(tiny_config().to_json_best_effort()), f)
  with pytest.raises(checkpoints.CheckpointError) as error:
    api.load_model(str(empty))
  message = str(error.value)
  assert 'No checkpoint' in message and 'Pass the workdir of a trained model' in message
