"""Config validation: every wrong field named, with its value and what is valid, before any work."""

import importlib
import subprocess
import sys

from conftest import REPO_ROOT
from conftest import tiny_config as tiny
import ml_collections
import pytest

from cht_jax import config_validation

ConfigError = config_validation.ConfigError


@pytest.mark.parametrize('num_tasks', [1, 2, 3, 4, 5])
@pytest.mark.parametrize('variant', ['', 'smoke', 'tiny'])
def test_shipped_configs_are_valid(num_tasks, variant):
  module = importlib.import_module(f'configs.omniglot_t{num_tasks}')
  config = module.get_config(variant)
  assert config_validation.validate(config, num_devices=1) is config


@pytest.mark.parametrize('field, value, valid', [
    ('episode.num_tasks', 0, 'an integer >= 1'),
    ('episode.ways', -2, 'an integer >= 2'),
    ('episode.shots', 0, 'an integer >= 1'),
    ('model.num_layers', 0, 'an integer >= 1'),
    ('episode.queries_per_class', 0, 'an integer >= 1'),
    ('episode.task_classes', 'overlapping', "one of ('disjoint', 'same', 'domain')"),
    ('model.channels', 0, 'an integer >= 1'),
    ('model.embedding_dim', -1, 'an integer >= 1'),
    ('model.num_heads', 0, 'an integer >= 1'),
    ('model.inner_fraction', 0.0, 'a finite number > 0'),
    ('model.activation', 'swish', 'one of'),
    ('model.conv_impl', 'fft', "one of ('auto', 'patches', 'lax', 'taps', 'fused_cpu')"),
    ('model.remat', 'sometimes', "one of ('auto', True, False)"),
    ('loss', 'hinge', "one of ('class_incremental', 'task_incremental', 'cross_entropy')"),
    ('optim.name', 'lbfgs', "one of ('sgd', 'momentum', 'adam', 'adamw')"),
    ('optim.learning_rate', float('nan'), 'a finite number > 0'),
    ('optim.momentum', 1.0, 'a finite number >= 0 and < 1'),
    ('data.split_scheme', 'random', "one of ('ht', 'alphabet')"),
    ('data.augment.hue', 0.6, 'a number in [0, 0.5]'),
    ('data.augment.brightness', -0.1, 'a number in [0, 1]'),
    ('data.augment.contrast', 2.0, 'a number in [0, 1]'),
    ('data.augment.crop_min_scale', 0.0, 'a number in (0, 1]'),
    ('train.num_steps', 0, 'an integer >= 1'),
    ('train.eval_every_steps', -1, 'an integer >= 0'),
    ('train.on_divergence', 'rollback', "one of ('stop', 'skip')"),
])
def test_a_wrong_field_is_named_with_its_value_and_what_is_valid(field, value, valid):
  with pytest.raises(ConfigError) as error:
    config_validation.validate(tiny(**{field: value}), num_devices=1)
  message = str(error.value)
  assert f'{field} = {value!r}: must be {valid}' in message, message


ONE_LABEL = 'with one class per task every query has a single possible label'


@pytest.mark.parametrize('overrides, named', [
    # One way: at T=1 the loss and its gradient are 0 at every step.
    ({'episode.ways': 1, 'episode.num_tasks': 1}, f'episode.ways = 1: must be an integer >= 2 '
                                                  f'({ONE_LABEL}'),
    ({'episode.ways': 1, 'loss': 'task_incremental'}, ONE_LABEL),  # At any T.
    ({'episode.ways': 1, 'episode.task_classes': 'same'}, ONE_LABEL),  # Class-incremental.
    ({'episode.ways': 1, 'loss': 'cross_entropy', 'model.cnn_embedding_dim': 1}, ONE_LABEL),
    ({'episode.ways': 1, 'method': 'constpn', 'constpn_ways_multiplier': 5}, ONE_LABEL),
    # No support image (no prototype), or no query (nothing to score).
    ({'episode.shots': 0}, 'episode.shots = 0: must be an integer >= 1.'),
    ({'episode.queries_per_class': 0}, 'episode.queries_per_class = 0: must be an integer >= 1.'),
])
def test_tasks_that_teach_nothing_are_refused(overrides, named):
  with pytest.raises(ConfigError, match='has a problem: ') as error:
    config_validation.validate(tiny(**overrides), num_devices=1)
  assert named in str(error.value), str(error.value)
  config_validation.validate(tiny(**{**overrides, 'episode.ways': 2, 'episode.shots': 1,
                                     'episode.queries_per_class': 1,
                                     'model.cnn_embedding_dim': 2}), num_devices=1)


def test_wrong_types_in_a_config_file():
  fields = tiny().to_dict()  # A config file builds its dicts freely: types are not enforced.
  fields['data']['rotate'] = 'yes'
  fields['episode']['shots'] = 1.5
  with pytest.raises(ConfigError) as error:
    config_validation.validate(ml_collections.ConfigDict(fields), num_devices=1)
  assert "data.rotate = 'yes': must be True or False." in str(error.value)
  assert 'episode.shots = 1.5: must be an integer >= 1.' in str(error.value)


def test_every_problem_is_reported_at_once():
  with pytest.raises(ConfigError, match='3 problems') as error:
    config_validation.validate(
        tiny(**{'episode.ways': 0, 'optim.name': 'lbfgs', 'loss': 'hinge'}), num_devices=1)
  for field in ('episode.ways', 'optim.name', 'loss'):
    assert field in str(error.value)


def test_unknown_field_suggests_the_known_one():
  config = tiny()
  with config.unlocked():
    config.train.num_step = 5
  with pytest.raises(ConfigError, match='train.num_step = 5 is not a known config field; '
                     'did you mean train.num_steps'):
    config_validation.validate(config, num_devices=1)


def test_missing_field_is_named():
  config = tiny()
  with config.unlocked():
    del config.train['on_divergence']
  with pytest.raises(ConfigError, match="train.on_divergence is missing: it must be one of"):
    config_validation.validate(config, num_devices=1)


def test_classes_needed_against_the_train_split():
  config = tiny(**{'episode.ways': 300, 'episode.num_tasks': 4, 'train.eval_every_steps': 0})
  with pytest.raises(ConfigError) as error:
    config_validation.validate(config, num_devices=1)
  assert ("episode.ways * episode.num_tasks = 300 * 4 = 1200 distinct classes per episode "
          "(episode.task_classes='disjoint') but the 'train' split of "
          "data.split_scheme='ht' has only 1150 classes") in str(error.value)
  config = tiny(**{'episode.ways': 300, 'episode.num_tasks': 4, 'train.eval_every_steps': 0,
                   'episode.task_classes': 'same'})
  config_validation.validate(config, num_devices=1)  # Only 300 classes: fits.


def test_validation_runs_the_tasks_its_classes_allow():
  from cht_jax import train
  config = tiny(**{'episode.ways': 20, 'episode.num_tasks': 3,
                   'data.split_scheme': 'alphabet'})
  config_validation.validate(config, num_devices=1)  # 60 > 50 classes: validates on 2 tasks.
  assert train.validation_tasks(config, 50) == 2
  assert train.validation_tasks(tiny(), 50) == 2  # T=2, 3-way: all tasks fit.
  config = tiny(**{'episode.ways': 60, 'episode.num_tasks': 1})
  with pytest.raises(ConfigError, match="episode.ways = 60 classes per task but the "
                     "'validation' split of data.split_scheme='ht' has only 50 classes"
                     '.*train.eval_every_steps=0'):
    config_validation.validate(config, num_devices=1)
  with config.unlocked():
    config.train.eval_every_steps = 0
  config_validation.validate(config, num_devices=1)


def test_images_per_class():
  with pytest.raises(ConfigError, match=r'15 \+ 10 = 25 images per class, but Omniglot has 20'):
    config_validation.validate(
        tiny(**{'episode.shots': 15, 'episode.queries_per_class': 10}), num_devices=1)


def test_image_size_against_cnn_depth():
  with pytest.raises(ConfigError, match=r'data.image_size = 8 is too small for '
                     r'model.num_blocks = 4: each block halves the feature map '
                     r'\(8 -> 4 -> 2 -> 1 -> 0\), so it must be >= 16, or '
                     r'model.num_blocks <= 3'):
    config_validation.validate(tiny(**{'data.image_size': 8}), num_devices=1)
  config_validation.validate(tiny(**{'data.image_size': 8, 'model.num_blocks': 3}),
                             num_devices=1)


def test_cross_entropy_needs_one_logit_per_class():
  with pytest.raises(ConfigError, match='model.cnn_embedding_dim = 6 must equal '
                     'episode.ways = 3'):
    config_validation.validate(tiny(loss='cross_entropy'), num_devices=1)
  config_validation.validate(tiny(**{'loss': 'cross_entropy', 'model.cnn_embedding_dim': 3}),
                             num_devices=1)


def test_batch_against_devices():
  with pytest.raises(ConfigError, match='train.episodes_per_step = 3 must be a multiple of '
                     'the 2 devices'):
    config_validation.validate(tiny(**{'train.episodes_per_step': 3}), num_devices=2)


def test_a_config_file_that_failed_to_load():
  with pytest.raises(ConfigError, match='The config could not be loaded'):
    config_validation.validate(object())
  assert isinstance(config_validation.validate(tiny(), num_devices=1),
                    ml_collections.ConfigDict)


def test_validation_imports_nothing_above_it():
  """methods import config_validation: importing them back would loop."""
  above = ('cht_jax.methods', 'cht_jax.train', 'cht_jax.evaluate')
  code = ('import sys, cht_jax.config_validation; '
          f'print([m for m in {above} if m in sys.modules])')
  result = subprocess.run([sys.executable, '-c', code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)
  assert result.stdout.strip() == '[]', result.stdout + result.stderr[-2000:]


def run_main(*args):
  command = [sys.executable, '-m', 'cht_jax.main', '--workdir=/nonexistent/never_created',
             *args]
  return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize('args, expected', [
    (['--config=configs/omniglot_t2.py:tiny', '--config.train.num_step=5'],
     'FATAL Flags parsing error: --config.train.num_step=5: the config has no field '
     'train.num_step; did you mean train.num_steps?'),
    (['--config=configs/omniglot_t2.py:tiny', '--config.episode.ways=1'],
     'ConfigError: The config has a problem: episode.ways = 1: must be an integer >= 2 '
     '(with one class per task'),
    (['--config=configs/omniglot_t2.py:tiy'],
     "ValueError: Unknown config variant 'tiy'; expected one of ('', 'smoke', 'tiny', 'fast')."),
])
def test_main_prints_one_paragraph_and_exits_1(args, expected):
  result = run_main(*args)
  assert result.returncode == 1, result.stderr[-2000:]
  assert expected in result.stderr, result.stderr[-2000:]
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]
