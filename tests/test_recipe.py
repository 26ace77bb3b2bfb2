"""The ':fast' recipe's levers (issue 16): head scale, schedules, optimisers, the variant."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cht_jax import config_validation
from cht_jax import continual
from cht_jax import models
from cht_jax import optim
from cht_jax.models import hypertransformer as ht_lib
from conftest import init_params, make_episode, override, tiny_config


def _init(config, episode):
  ht = models.build_hypertransformer(config)
  return ht, *init_params(ht, episode)


def test_head_scale_multiplies_the_generated_head_and_nothing_else(tiny_episode):
  scaled, scaled_params, theta = _init(tiny_config(**{'model.head_scale': 0.25}), tiny_episode)
  plain, plain_params, _ = _init(tiny_config(), tiny_episode)
  assert 'head_output_scale' not in plain_params  # 0: the paper's parameters exactly.
  assert float(scaled_params['head_output_scale']) == 0.25
  shared = {k: v for k, v in scaled_params.items() if k != 'head_output_scale'}
  args = (tiny_episode['support_images'][0], tiny_episode['support_labels'][0], theta)
  with_scale = scaled.apply({'params': scaled_params}, *args)
  without = plain.apply({'params': shared}, *args)
  for name in without:
    factor = 0.25 if name == 'head' else 1.0
    for key in without[name]:
      np.testing.assert_allclose(with_scale[name][key], factor * without[name][key],
                                 rtol=1e-6, atol=1e-7)


def test_learned_base_is_base_plus_scaled_generated_layers(tiny_episode):
  based, based_params, theta = _init(tiny_config(**{'model.learned_base': 0.5}), tiny_episode)
  plain, plain_params, _ = _init(tiny_config(), tiny_episode)
  assert not [k for k in plain_params if 'base' in k]  # 0: the paper's parameters exactly.
  layers = list(theta)
  extra = {f'{n}_{suffix}' for n in layers for suffix in ('base', 'generated_scale')}
  assert set(based_params) - set(plain_params) == extra
  generated = {k: v for k, v in based_params.items() if k not in extra}
  args = (tiny_episode['support_images'][0], tiny_episode['support_labels'][0], theta)
  # The first layer sees the raw images, so its generated part can be compared
  # directly; later layers see activations that already depend on the base.
  with_base = based.apply({'params': based_params}, *args)
  without = plain.apply({'params': generated}, *args)
  base_block = ht_lib.slices_to_block(based_params['block_0_base'],
                                      without['block_0']['kernel'].shape, False)
  np.testing.assert_allclose(with_base['block_0']['kernel'],
                             base_block['kernel'] + 0.5 * without['block_0']['kernel'],
                             rtol=1e-5, atol=1e-6)
  # With the generated scales at 0 every task gets the base: a ConstPN.
  zeroed = {k: (jnp.zeros_like(v) if k.endswith('generated_scale') else v)
            for k, v in based_params.items()}
  other_args = (tiny_episode['support_images'][0][::-1], tiny_episode['support_labels'][0][::-1],
                theta)
  for a, b in zip(jax.tree.leaves(based.apply({'params': zeroed}, *args)),
                  jax.tree.leaves(based.apply({'params': zeroed}, *other_args))):
    np.testing.assert_array_equal(a, b)
  head = based.apply({'params': zeroed}, *args)['head']
  np.testing.assert_array_equal(head['kernel'], based_params['head_base'][:, :-1].T)


@pytest.mark.parametrize('trained_layers, trained', [
    (2, ('block_0', 'block_1')), (-1, ('head',)), (-2, ('block_3', 'head'))])
def test_trained_layers_are_parameters_the_same_for_every_task(tiny_episode, trained_layers,
                                                                trained):
  ht, params, theta = _init(tiny_config(**{'model.trained_layers': trained_layers}),
                            tiny_episode)
  _, plain_params, _ = _init(tiny_config(), tiny_episode)
  for layer in theta:  # A trained layer has no transformer, a written one no kernel.
    assert (f'{layer}_kernel' in params) == (layer in trained)
    assert (f'{layer}_transformer' in params) == (layer not in trained)
  assert set(params) - set(plain_params) == {f'{layer}_kernel' for layer in trained} | (
      {'head_bias'} if 'head' in trained else set())
  images, labels = tiny_episode['support_images'][0], tiny_episode['support_labels'][0]
  first = ht.apply({'params': params}, images, labels, theta)
  other = ht.apply({'params': params}, images[::-1], labels, theta)  # Another task.
  for layer in theta:
    if layer in trained:
      np.testing.assert_array_equal(first[layer]['kernel'], params[f'{layer}_kernel'])
      np.testing.assert_array_equal(other[layer]['kernel'], params[f'{layer}_kernel'])
    else:
      assert not np.allclose(first[layer]['kernel'], other[layer]['kernel'])

  def loss(params):  # Gradients reach the trained layers through the CNN.
    theta_t = ht.apply({'params': params}, images, labels, theta)
    return jnp.sum(ht.cnn.apply({'params': theta_t}, images) ** 2)
  grads = jax.jit(jax.grad(loss))(params)
  for layer in trained:
    assert float(jnp.abs(grads[f'{layer}_kernel']).max()) > 0


def test_feature_norm_standardises_the_sample_features_over_the_support_set(
    tiny_episode, monkeypatch):
  from cht_jax.models import transformer as transformer_lib  # pylint: disable=g-import-not-at-top
  token_sets = []
  encoder_call = transformer_lib.Encoder.__call__

  def recording_call(self, tokens):
    token_sets.append(tokens)
    return encoder_call(self, tokens)

  monkeypatch.setattr(transformer_lib.Encoder, '__call__', recording_call)
  spreads = {}
  for feature_norm in (False, True):
    config = tiny_config(**{'model.feature_norm': feature_norm})
    ht, params, theta = _init(config, tiny_episode)
    assert ('block_0_feature_norm_scale' in params) == feature_norm
    token_sets.clear()
    ht.apply({'params': params}, tiny_episode['support_images'][0],
             tiny_episode['support_labels'][0], theta)
    tokens = token_sets[0]  # Block 0: [weight tokens | support tokens].
    num_support = tiny_episode['support_labels'].shape[1]
    num_features = 2 * (ht.activation_features or max(ht.channels)) + ht.image_features
    features = np.asarray(tokens[-num_support:, ht.embedding_dim:][:, :num_features])
    spreads[feature_norm] = features.std(axis=0)
    if feature_norm:
      np.testing.assert_allclose(features.mean(axis=0), 0.0, atol=1e-4)
  np.testing.assert_allclose(spreads[True], 1.0, rtol=1e-3)
  assert np.abs(spreads[False] - 1.0).max() > 0.1, spreads[False]  # Not so without it.


def test_fast_head_scale_starts_the_paper_model_near_log_classes():
  """The full Omniglot model (20-way, T=1): the first loss is O(log 20) with the
  ':fast' head scale, and in the tens or hundreds without it (issue 16)."""
  from configs import omniglot_t1  # pylint: disable=g-import-not-at-top
  episode = make_episode(2, num_tasks=1, ways=20, shots=1, queries=3, size=28)
  losses = {}
  for scale in (0.0, omniglot_t1.get_config('fast').model.head_scale):
    config = override(omniglot_t1.get_config(), {'model.head_scale': scale,
                                                  'model.conv_impl': 'patches'})
    ht, params, _ = _init(config, episode)
    losses[scale] = float(jax.jit(lambda p: continual.episode_loss(
        ht, p, episode, remat=False)[0])(params))
  assert losses[0.1] < 2 * np.log(20), losses
  assert losses[0.0] > 10 * np.log(20), losses


def test_cosine_schedule_with_warmup():
  config = tiny_config(**{'optim.schedule': 'cosine', 'optim.learning_rate': 0.1,
                          'optim.decay_steps': 100, 'optim.warmup_steps': 10,
                          'optim.end_fraction': 0.1})
  schedule = optim.learning_rate_schedule(config.optim)
  values = np.array([schedule(s) for s in range(0, 101)])
  np.testing.assert_allclose(values[[0, 5, 10, 100]], [0.0, 0.05, 0.1, 0.01], rtol=1e-5,
                             atol=1e-8)
  assert np.all(np.diff(values[:11]) > 0) and np.all(np.diff(values[10:]) <= 1e-9)
  np.testing.assert_allclose(values[55], 0.01 + 0.09 * 0.5, rtol=1e-5)  # Half way down.


def test_warmup_before_the_papers_schedule():
  config = tiny_config(**{'optim.learning_rate': 0.1, 'optim.decay_steps': 10,
                          'optim.decay_rate': 0.5, 'optim.warmup_steps': 4})
  schedule = optim.learning_rate_schedule(config.optim)
  # After the warmup the exponential schedule counts from the end of the warmup.
  np.testing.assert_allclose([schedule(0), schedule(2), schedule(4), schedule(14)],
                             [0.0, 0.05, 0.1, 0.05], rtol=1e-6)


def test_adamw_takes_steps():
  config = tiny_config(**{'optim.name': 'adamw', 'optim.weight_decay': 1e-4})
  optimizer = optim.make_optimizer(config.optim)
  params = {'w': jnp.ones(3)}
  state = optimizer.init(params)
  updates, _ = optimizer.update({'w': jnp.array([1.0, -1.0, 0.5])}, state, params)
  assert np.all(np.isfinite(updates['w'])) and float(jnp.abs(updates['w']).sum()) > 0


def test_fast_variant_schedule_follows_a_num_steps_override():
  from configs import omniglot_t5  # pylint: disable=g-import-not-at-top
  config = omniglot_t5.get_config('fast')
  config_validation.validate(config, num_devices=1)
  assert (config.optim.schedule, config.optim.decay_steps) == ('cosine', config.train.num_steps)
  config.train.num_steps = 1000  # As --config.train.num_steps=1000 does.
  assert (config.optim.decay_steps, config.optim.warmup_steps) == (1000, 50)
  assert (config.train.eval_every_steps, config.train.checkpoint_every_steps) == (100, 250)
  config.optim.decay_steps = 5000  # Overriding the schedule leaves the run's length alone.
  assert (config.train.num_steps, config.optim.decay_steps) == (1000, 5000)
  paper = omniglot_t5.get_config()
  assert (paper.optim.name, paper.optim.schedule, paper.model.head_scale) == ('sgd',
                                                                               'exponential', 0.0)
  assert (config.data.rotate, paper.data.rotate) == (False, True)
  assert (config.model.feature_norm, paper.model.feature_norm) == (True, False)
  assert (config.train.loss_spike_factor, paper.train.loss_spike_factor) == (1.1, 0.0)
  assert (config.model.trained_layers, paper.model.trained_layers) == (2, 0)
  assert (config.model.learned_base, paper.model.learned_base) == (0.1, 0.0)


@pytest.mark.parametrize('field, value, message', [
    ('optim.schedule', 'linear', "optim.schedule = 'linear': must be one of"),
    ('optim.end_fraction', 1.5, 'optim.end_fraction = 1.5'),
    ('model.head_scale', -1.0, 'model.head_scale = -1.0'),
    ('model.learned_base', -0.1, 'model.learned_base = -0.1'),
    ('model.trained_layers', -5, 'model.trained_layers = -5 leaves no layer of the 5'),
    ('train.loss_spike_factor', 0.9, r'train.loss_spike_factor = 0.9: must be 0 \(off\) or '
     'a finite number > 1'),
    ('optim.name', 'adagrad', "optim.name = 'adagrad'"),
])
def test_recipe_config_mistakes_are_named(field, value, message):
  config = tiny_config(**{field: value})
  with pytest.raises(config_validation.ConfigError, match=message):
    config_validation.validate(config, num_devices=1)
