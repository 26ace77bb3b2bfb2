"""Semi-supervised episodes: unlabeled support images for CHT and HT (issue 20).

The sampler, the host pipeline, the tokens, the prototypes, the evaluation
protocol, the library API, config validation, and training and evaluation end to end.
"""

import functools
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cht_jax import api
from cht_jax import config_validation
from cht_jax import continual
from cht_jax import evaluate
from cht_jax import losses
from cht_jax import methods
from cht_jax import optim
from cht_jax import train
from cht_jax.data import datasets
from cht_jax.data import episodes
from cht_jax.data import pipeline
from cht_jax.models import hypertransformer as ht_lib
from cht_jax.models import transformer as transformer_lib
from cht_jax.runtime import devices

from conftest import class_images, normal, tiny_config

UNLABELED = 2  # U, unlabeled images per class in these tests.


def identified_images(num_classes=12, num_images=20, size=4):
  """uint8 [C, M, size, size, 1]: image m of class c is the constant c * 20 + m."""
  ids = np.arange(num_classes)[:, None] * num_images + np.arange(num_images)
  return np.broadcast_to(ids[:, :, None, None, None],
                         (num_classes, num_images, size, size, 1)).astype(np.uint8)


def image_ids(images) -> np.ndarray:
  """The constant of each normalised image [..., H, W, 1] -> int [...]."""
  return np.round((np.asarray(images)[..., 0, 0, 0] + 1.0) * 128).astype(int)


# --------------------------------------------------------------------------
# M = 0: bit-identical to the code before unlabeled images existed.
# --------------------------------------------------------------------------

# Computed at commit 0c5c03f (before this feature) by the same code as
# `_m0_numbers`; float.hex of the float32 results on XLA:CPU. A change of the
# model's or the sampler's numerics (not of semi-supervision) moves them too:
# recompute them then, at the commit before that change.
M0_REFERENCE = {
    'support_sum': '0x1.49d0000000000p+5',
    'query_sum': '0x1.5ad0000000000p+6',
    'eval_support_sum': '0x1.95c0000000000p+3',
    'eval_query_sum': '0x1.6230000000000p+6',
    'loss': '0x1.1acd9e0000000p+7',
    'accuracy': '0x1.8e38e60000000p-2',
    'theta_norm': '0x1.9fcb740000000p+5',
    'grad_norm': '0x1.edb29a0000000p+13',
    'task_incremental': ['0x1.0000000000000p-1', '0x1.aaaaac0000000p-1',
                         '0x1.5555560000000p-1'],
    'class_incremental': ['0x1.0000000000000p-1', '0x1.aaaaac0000000p-2',
                          '0x1.0000000000000p-1'],
}


def _m0_numbers(config):
  """A training episode's loss and gradient, and an evaluation episode's accuracies."""
  method = methods.build(config)
  # The trainer's compiled init (the same parameters as `method.init`, bit for bit): the
  # program test_methods and test_train compile too, so a persistent-cache hit here.
  params = train.make_init(method, optim.make_optimizer(config.optim),
                           devices.data_mesh())(jax.random.key(0)).params
  images = jnp.asarray(class_images(num_classes=12, images_per_class=20, size=16))
  spec = datasets.episode_spec(config)
  batch = episodes.sample_episodes(jax.random.key(3), images, spec, 2, rotate=True)
  episode = jax.tree.map(lambda x: x[0], batch)
  loss_fn = lambda p: method.episode_loss(p, episode, 'class_incremental', remat=False,
                                          vectorize=False)
  (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
  evaluation = episodes.sample_evaluation_episode(jax.random.key(4), images, spec, 2)
  task_inc, class_inc = jax.jit(lambda p: method.episode_accuracies(
      p, evaluation, continual.TaskPairs.lower_triangle(2)))(params)
  numbers = {
      'support_sum': jnp.sum(batch['support_images']),
      'query_sum': jnp.sum(batch['query_images']),
      'eval_support_sum': jnp.sum(evaluation['support_images']),
      'eval_query_sum': jnp.sum(evaluation['query_images']),
      'loss': loss, 'accuracy': metrics['accuracy'], 'theta_norm': metrics['theta_norm'],
      'grad_norm': optax.tree.norm(grads),
      'task_incremental': task_inc, 'class_incremental': class_inc,
  }
  hexes = lambda v: [float(x).hex() for x in np.ravel(v)] if np.ndim(v) else float(v).hex()
  return {k: hexes(v) for k, v in numbers.items()}, set(batch) | set(evaluation)


def test_m0_step_is_the_same_as_before():
  """The sums of the sampled images and the accuracies exactly as in M0_REFERENCE,
  the loss and norms to float32 rounding (another CPU's kernels round them
  differently; the machine that wrote M0_REFERENCE matched them bit for bit)."""
  config = tiny_config(**{'episode.unlabeled_per_class': 0})
  numbers, keys = _m0_numbers(config)
  rounded = ('loss', 'theta_norm', 'grad_norm')
  assert {k: v for k, v in numbers.items() if k not in rounded} == {
      k: v for k, v in M0_REFERENCE.items() if k not in rounded}
  for key in rounded:
    np.testing.assert_allclose(float.fromhex(numbers[key]), float.fromhex(M0_REFERENCE[key]),
                               rtol=1e-4, err_msg=key)
  assert 'unlabeled_images' not in keys


# --------------------------------------------------------------------------
# Sampling.
# --------------------------------------------------------------------------

SPEC = episodes.EpisodeSpec(num_tasks=2, ways=3, shots=2, queries_per_class=3,
                            unlabeled_per_class=UNLABELED)


@pytest.mark.parametrize('task_classes', ['disjoint', 'same'])
def test_unlabeled_images_are_new_images_of_the_task_classes(task_classes):
  spec = SPEC._replace(task_classes=task_classes)
  sample = jax.jit(lambda k: episodes.sample_episodes(
      k, jnp.asarray(identified_images()), spec, 4, rotate=False))
  batch = sample(jax.random.key(0))
  assert batch['unlabeled_images'].shape == (4, 2, 3 * UNLABELED, 4, 4, 1)
  ids = {name: image_ids(batch[f'{name}_images']) for name in ('support', 'query', 'unlabeled')}
  per_class = {'support': 2, 'query': 3, 'unlabeled': UNLABELED}
  for b in range(4):
    seen = {}
    for t in range(2):
      for k in range(3):
        drawn = {name: ids[name][b, t, k * n:(k + 1) * n] for name, n in per_class.items()}
        for name, values in drawn.items():  # Every image of the task's class k.
          assert set(values // 20) == {int(batch['class_ids'][b, t, k])}, name
        every = np.concatenate(list(drawn.values()))
        assert len(set(every)) == len(every)  # Support, queries, unlabeled disjoint.
        seen.setdefault(int(batch['class_ids'][b, t, k]), []).extend(every)
    # With the same classes in every task, no image is in two tasks either.
    assert all(len(set(v)) == len(v) for v in seen.values())
  if task_classes == 'same':
    return
  # Disjoint classes: the labelled images are those the same key draws without
  # unlabeled images (the first N + Q of each class's top N + Q + U).
  labelled = episodes.sample_episodes(jax.random.key(0), jnp.asarray(identified_images()),
                                      spec._replace(unlabeled_per_class=0), 4, rotate=False)
  for name in ('support_images', 'query_images', 'class_ids'):
    np.testing.assert_array_equal(batch[name], labelled[name])


def test_unlabeled_images_turn_with_their_class():
  # Every image of a class is its template, so a rotated image shows its rotation.
  templates = class_images(num_classes=12, images_per_class=1, size=8)
  images = jnp.asarray(np.repeat(templates, 20, axis=1))
  batch = episodes.sample_episodes(jax.random.key(1), images, SPEC, 8, rotate=True)
  support = batch['support_images'][:, :, ::2]  # Shot 0 of each class: [B, T, K, ...].
  unlabeled = batch['unlabeled_images'].reshape(8, 2, 3, UNLABELED, 8, 8, 1)
  np.testing.assert_array_equal(unlabeled, jnp.broadcast_to(support[:, :, :, None],
                                                            unlabeled.shape))
  assert not np.array_equal(support, episodes.normalize(images[batch['class_ids'], 0]))


def test_evaluation_draws_queries_around_one_unlabeled_set():
  spec = SPEC._replace(queries_per_class=4)
  episode = jax.jit(lambda k: episodes.sample_evaluation_episode(
      k, jnp.asarray(identified_images()), spec, 6))(jax.random.key(0))
  assert episode['unlabeled_images'].shape == (2, 3 * UNLABELED, 4, 4, 1)  # No draw axis.
  support, unlabeled = image_ids(episode['support_images']), image_ids(
      episode['unlabeled_images'])
  queries = image_ids(episode['query_images'])  # [R, T, K*Q].
  for t in range(2):
    for k in range(3):
      kept = np.concatenate([support[t, 2 * k:2 * k + 2],
                             unlabeled[t, UNLABELED * k:UNLABELED * (k + 1)]])
      assert set(kept // 20) == {int(episode['class_ids'][t, k])}
      assert len(set(kept)) == 2 + UNLABELED
      for draw in queries[:, t, 4 * k:4 * (k + 1)]:
        assert set(draw // 20) == {int(episode['class_ids'][t, k])}
        assert not set(draw) & set(kept)  # Never a support or unlabeled image.
  assert len({tuple(q.ravel()) for q in queries}) > 1  # The draws differ.


def test_protocol_scores_every_draw_with_thetas_of_the_unlabeled_set():
  config = tiny_config(**{'episode.unlabeled_per_class': UNLABELED})
  method = methods.build(config)
  params = jax.jit(method.init)(jax.random.key(0))
  protocol = evaluate.default_protocol(config, num_episodes=2, num_query_draws=3,
                                       batch_size=2, num_tasks=2)
  images = class_images(num_classes=12, images_per_class=20, size=16)
  result = evaluate.run_protocol(method, params, images, protocol)
  # Episode 0 by hand: thetas generated once from its support and unlabeled
  # sets, each draw scored with them, then the mean over draws.
  spec = evaluate.evaluation_spec(config, protocol)
  episode = jax.jit(lambda key, images: episodes.sample_evaluation_episode(key, images, spec, 3))(
      jax.random.fold_in(jax.random.key(protocol.seed), 0), jnp.asarray(images))
  pairs = continual.TaskPairs.lower_triangle(2)
  thetas_and_prototypes = jax.jit(method.thetas_and_prototypes)
  thetas, prototypes = thetas_and_prototypes(
      params, episode['support_images'], episode['support_labels'],
      unlabeled_images=episode['unlabeled_images'])

  @jax.jit
  def draw_accuracies(draw):
    embeddings = continual.embed_queries(method.cnn, thetas, draw, pairs, remat=False)
    return continual.pair_losses('class_incremental', embeddings, episode['query_labels'],
                                 prototypes, pairs)[1]

  per_draw = [draw_accuracies(draw) for draw in episode['query_images']]
  np.testing.assert_allclose(result['class_incremental'][0][pairs.t, pairs.tau],
                             np.mean(per_draw, axis=0), atol=1e-6)
  without, _ = thetas_and_prototypes(params, episode['support_images'],
                                     episode['support_labels'])
  assert not np.allclose(thetas['head']['kernel'], without['head']['kernel'])


def test_host_pipeline_draws_unlabeled_images():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  pixels = identified_images(num_classes=6, num_images=8, size=8)
  records = [tf.io.encode_png(image).numpy() for image in pixels.reshape(-1, 8, 8, 1)]
  index = pipeline.class_index(np.repeat(np.arange(6), 8))
  spec = SPEC._replace(queries_per_class=1)
  batch = next(pipeline.episode_batches(pipeline.EncodedSource(records), index, spec, 2,
                                        0, 5, 8, 1, normalize=False, num_steps=1))
  assert batch['unlabeled_images'].dtype == np.uint8
  assert batch['unlabeled_images'].shape == (2, 2, 3 * UNLABELED, 8, 8, 1)
  device = pipeline.device_episodes(batch)
  ids = {n: image_ids(device[f'{n}_images']) for n in ('support', 'query', 'unlabeled')}
  for b, t, k in np.ndindex(2, 2, 3):
    drawn = np.concatenate([ids['support'][b, t, 2 * k:2 * k + 2], ids['query'][b, t, k:k + 1],
                            ids['unlabeled'][b, t, UNLABELED * k:UNLABELED * (k + 1)]])
    assert set(drawn // 8) == {int(batch['class_ids'][b, t, k])}
    assert len(set(drawn)) == 3 + UNLABELED


# --------------------------------------------------------------------------
# The model: tokens, theta, prototypes.
# --------------------------------------------------------------------------


def _encoder_inputs(ht, params, images, labels, unlabeled):
  """The tokens each layer's transformer reads, in generation order."""
  tokens = []

  def record(next_fun, args, kwargs, context):
    if isinstance(context.module, transformer_lib.Encoder) and context.method_name == '__call__':
      tokens.append(args[0])
    return next_fun(*args, **kwargs)

  def forward(params, images, labels, unlabeled):
    with nn.intercept_methods(record):
      ht.apply({'params': params}, images, labels,
               ht_lib.zeros_theta(ht.cnn, images.shape[1:]), unlabeled_images=unlabeled)
    return tokens

  return jax.jit(forward)(params, images, labels, unlabeled)  # One program, not op by op.


def test_unlabeled_tokens_differ_only_in_their_label_embedding(tiny_ht, tiny_params,
                                                               tiny_episode):
  images, labels = tiny_episode['support_images'][0], tiny_episode['support_labels'][0]
  # The support images again, unlabeled: the same activations (their own
  # BatchNorm batch has the same statistics), so only the label part differs.
  tokens = _encoder_inputs(tiny_ht, tiny_params, images, labels, images)
  names = [f'block_{i}' for i in range(len(tiny_ht.channels))] + ['head']
  assert len(tokens) == len(names)
  emb, size = tiny_ht.embedding_dim, len(labels)
  for name, layer in zip(names, tokens):
    table = tiny_params[f'{name}_label_embedding']  # [K + 1, emb].
    labelled, unlabeled = layer[-2 * size:-size], layer[-size:]
    np.testing.assert_array_equal(labelled[:, :emb], table[labels])
    np.testing.assert_array_equal(unlabeled[:, :emb],
                                  jnp.broadcast_to(table[tiny_ht.num_ways], (size, emb)))
    np.testing.assert_allclose(unlabeled[:, emb:], labelled[:, emb:], rtol=1e-6, atol=1e-6)
  # Weight tokens, then the labelled ones, then the unlabeled: the first layer
  # reads what it reads without them, plus them (later layers read the
  # labelled activations through weights that the unlabeled tokens changed).
  without = _encoder_inputs(tiny_ht, tiny_params, images, labels, None)
  assert [len(a) + size for a in without] == [len(layer) for layer in tokens]
  np.testing.assert_allclose(tokens[0][:-size], without[0], rtol=1e-6, atol=1e-6)


def test_unlabeled_images_change_theta_not_the_prototypes_definition(tiny_ht, tiny_params,
                                                                     tiny_episode):
  images, labels = tiny_episode['support_images'], tiny_episode['support_labels']
  unlabeled = normal(7, (3, 4, *images.shape[2:]))
  generate = jax.jit(functools.partial(continual.generate_thetas, tiny_ht))
  thetas, prototypes = generate(tiny_params, images, labels, unlabeled_images=unlabeled)
  plain, _ = generate(tiny_params, images, labels)
  for name in thetas:  # Every generated layer of every task (scale, bias: trained).
    assert not np.any(np.isclose(thetas[name]['kernel'], plain[name]['kernel']).all(
        axis=tuple(range(1, thetas[name]['kernel'].ndim))))
  # Prototypes: class means of the labelled images alone, embedded as one batch by theta_t.
  embed = jax.jit(lambda theta, images: tiny_ht.cnn.apply({'params': theta}, images))
  for t in range(3):
    embeddings = embed(jax.tree.map(lambda leaf: leaf[t], thetas), images[t])
    np.testing.assert_allclose(prototypes[t], losses.class_prototypes(
        embeddings, labels[t], tiny_ht.num_ways), rtol=1e-5, atol=1e-5)
  # The transformer reads them: the loss has a gradient with respect to them.
  episode = {**tiny_episode, 'unlabeled_images': unlabeled}
  grad = jax.jit(jax.grad(lambda u: continual.episode_loss(
      tiny_ht, tiny_params, {**episode, 'unlabeled_images': u}, remat=False)[0]))(unlabeled)
  assert float(jnp.abs(grad).sum()) > 0


def test_api_learns_a_task_with_unlabeled_images():
  config = tiny_config()
  method = methods.build(config)
  model = api.model_from_params(config, method.init(jax.random.key(0)))
  images = class_images(num_classes=3, images_per_class=4, size=16)
  support, labels = images[:, 0], np.arange(3)
  unlabeled = images[:, 1:].reshape(-1, 16, 16, 1)
  theta, prototypes = api.learn_task(model, support, labels, unlabeled_images=unlabeled)
  expected_theta, expected = continual.generate_task(
      model.ht, model.params, episodes.normalize(support), labels,
      ht_lib.zeros_theta(model.ht.cnn, model.image_shape), episodes.normalize(unlabeled))
  np.testing.assert_allclose(prototypes[0], expected, rtol=1e-5, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
               theta, expected_theta)
  np.testing.assert_allclose(prototypes[0], losses.class_prototypes(
      api.embed(model, theta, support), labels, 3), rtol=1e-5, atol=1e-5)
  plain, _ = api.learn_task(model, support, labels)
  assert not np.allclose(theta['head']['kernel'], plain['head']['kernel'])
  with pytest.raises(ValueError, match=r'unlabeled_images must be \[N, 16, 16, 1\]'):
    api.learn_task(model, support, labels, unlabeled_images=unlabeled[:, :8])


# --------------------------------------------------------------------------
# Config validation.
# --------------------------------------------------------------------------


@pytest.mark.parametrize('overrides, expected', [
    # The original's draws (the default): the support set with its unlabeled images, and
    # the queries, each drawn from the class's 20 images.
    ({'episode.unlabeled_per_class': 19}, None),  # max(1 + 19, 3) = 20 images: fits.
    ({'episode.unlabeled_per_class': 20},
     r'max\(episode\.shots \+ episode\.unlabeled_per_class, episode\.queries_per_class\) = '
     r'21 distinct images per class \(episode\.independent_draws: .*\), but Omniglot has 20 '
     r'per class'),
    # Distinct draws: all of them distinct.
    ({'episode.unlabeled_per_class': 16, 'episode.independent_draws': False}, None),
    ({'episode.unlabeled_per_class': 17, 'episode.independent_draws': False},
     r'episode\.shots \+ episode\.queries_per_class \+ episode\.unlabeled_per_class = '
     r'1 \+ 3 \+ 17 = 21 images per class, but Omniglot has 20 per class'),
    ({'episode.unlabeled_per_class': -1}, r'episode\.unlabeled_per_class = -1: must be an '
                                          r'integer >= 0'),
    ({'episode.unlabeled_per_class': 2, 'method': 'constpn'},
     r"episode\.unlabeled_per_class = 2: .*method = 'cht' only, not method = 'constpn'"),
])
def test_config_validation_of_unlabeled_per_class(overrides, expected):
  from configs import omniglot_semisupervised  # pylint: disable=g-import-not-at-top
  config = omniglot_semisupervised.get_config('2,2')
  assert config.episode.unlabeled_per_class == 2 and config.episode.num_tasks == 2
  with config.unlocked():
    for dotted, value in overrides.items():
      section, _, name = dotted.rpartition('.')
      (config[section] if section else config)[name] = value
  if expected is None:
    config_validation.validate(config, num_devices=1)
    return
  with pytest.raises(config_validation.ConfigError, match=expected) as error:
    config_validation.validate(config, num_devices=1)
  assert '\n' not in str(error.value)


# --------------------------------------------------------------------------
# End to end: python -m cht_jax.main, training then the protocol.
# --------------------------------------------------------------------------


def test_trains_and_evaluates_with_unlabeled_images(tmp_path, prepared_omniglot):
  """What `python -m cht_jax.main` runs in either mode, on real Omniglot, in this process
  (test_main and test_evaluate run main itself): a fresh process would trace and compile
  the whole semi-supervised program again."""
  from configs import omniglot_semisupervised  # pylint: disable=g-import-not-at-top
  config = omniglot_semisupervised.get_config(f'{UNLABELED},2,tiny')
  config.data.data_dir = prepared_omniglot
  config = config_validation.validate(config)
  workdir = str(tmp_path / 'semi')
  train.train_and_evaluate(config, workdir)
  assert sorted(int(s) for s in os.listdir(os.path.join(workdir, 'checkpoints'))) == [2, 4]
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  assert all(np.isfinite(r['train/loss']) for r in rows if r['split'] == 'train')
  assert any(r['split'] == 'validation' for r in rows)
  evaluate.evaluate_checkpoint(config, workdir, num_episodes=2, num_query_draws=2)
  with open(os.path.join(workdir, 'eval', 'test_T2_step4.json')) as f:
    saved = json.load(f)
  assert saved['episode']['unlabeled_per_class'] == UNLABELED
  assert saved['task_specificity']['num_pairs'] == 2  # Written with unlabeled images too.
  assert saved['config']['episode']['unlabeled_per_class'] == UNLABELED
  assert 0 <= saved['table']['class_incremental']['mean'][-1] <= 1
