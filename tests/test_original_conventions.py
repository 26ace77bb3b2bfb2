"""The original HT's data conventions as options (issue 34, items 3 and 4).

Independent support and query draws (episode.independent_draws, both samplers),
the original's test sampler (evaluate.Protocol.sampler='original') and binarised
Omniglot pixels (data.binarize), each beside the project's stricter default.
"""

import dataclasses
import json
import os

import jax
import ml_collections
import numpy as np
import pytest

from cht_jax import config_validation
from cht_jax import evaluate
from cht_jax import methods
from cht_jax import reports
from cht_jax.data import datasets
from cht_jax.data import episodes
from cht_jax.data import omniglot
from cht_jax.data import pipeline

from conftest import class_images, tiny_config

# Image m of class c is the constant c * M + m: its value names it.
NUM_CLASSES, NUM_IMAGES = 12, 4


def named_images(num_classes=NUM_CLASSES, num_images=NUM_IMAGES):
  ids = np.arange(num_classes * num_images, dtype=np.uint8).reshape(num_classes, num_images)
  return np.broadcast_to(ids[:, :, None, None, None], (num_classes, num_images, 2, 2, 1)).copy()


def image_ids(normalized):
  """[..., S, H, W, 1] normalised named images -> int [..., S] ids."""
  return np.rint((np.asarray(normalized)[..., 0, 0, 0] + 1.0) * 128.0).astype(int)


def support_query_ids(episode, spec):
  """(support ids [..., T, K, N], query ids [..., T, K, Q]) of sampled episodes."""
  t, k = spec.num_tasks, spec.ways
  support = image_ids(episode['support_images'])
  queries = image_ids(episode['query_images'])
  return (support.reshape(support.shape[:-2] + (t, k, -1)),
          queries.reshape(queries.shape[:-2] + (t, k, -1)))


def repeat_fraction(support, queries):
  """Fraction of queries equal to a support image of their class in their task."""
  return float(np.mean(np.any(queries[..., :, None] == support[..., None, :], axis=-1)))


SPEC = episodes.EpisodeSpec(num_tasks=2, ways=3, shots=1, queries_per_class=3)
INDEPENDENT = SPEC._replace(independent_draws=True)
EVAL_SPEC = SPEC._replace(queries_per_class=2)
NUM_EPISODES, NUM_DRAWS = 1000, 4


@jax.jit
def draw_all(key, images):
  """Training episodes of both kinds and evaluation episodes of both samplers, in one
  compiled program (compiling is most of this file's time)."""
  train_key, eval_key = jax.random.split(key)
  evaluation = jax.vmap(episodes.sample_evaluation_episode, in_axes=(0, None, None, None))
  eval_keys = jax.random.split(eval_key, NUM_EPISODES // 2)
  return {
      'distinct': episodes.sample_episodes(train_key, images, SPEC, NUM_EPISODES, False),
      'independent': episodes.sample_episodes(train_key, images, INDEPENDENT, NUM_EPISODES,
                                              False),
      'strict': evaluation(eval_keys, images, EVAL_SPEC, NUM_DRAWS),
      'original': evaluation(eval_keys, images, EVAL_SPEC._replace(independent_draws=True),
                             NUM_DRAWS),
  }


@pytest.fixture(scope='module')
def sampled():
  return draw_all(jax.random.key(0), named_images())


def test_independent_draws_repeat_the_support_image_about_one_query_in_m(sampled):
  support, queries = support_query_ids(sampled['independent'], INDEPENDENT)
  # 1-shot: each query is uniform over the M images, the support image too,
  # independently: P(equal) = 1/M. 18,000 queries in 6,000 independent groups.
  assert repeat_fraction(support, queries) == pytest.approx(1 / NUM_IMAGES, abs=0.015)
  # Each draw on its own is without replacement, within its class.
  assert (np.sort(queries, -1)[..., 1:] != np.sort(queries, -1)[..., :-1]).all()
  assert (support // NUM_IMAGES == queries[..., :1] // NUM_IMAGES).all()


def test_distinct_draws_never_repeat_the_support_image(sampled):
  support, queries = support_query_ids(sampled['distinct'], SPEC)
  assert repeat_fraction(support, queries) == 0.0


def test_independent_draws_same_seed_same_numbers(sampled):
  again = draw_all(jax.random.key(0), named_images())
  for kind in sampled:
    for name in sampled[kind]:
      np.testing.assert_array_equal(sampled[kind][name], again[kind][name])
  # The option changes the draws, not the classes (the same class key).
  np.testing.assert_array_equal(sampled['independent']['class_ids'],
                                sampled['distinct']['class_ids'])


def test_independent_draws_need_each_draw_to_fit_not_their_sum():
  # 2 + 3 images per class > M = 4, but each draw alone fits.
  spec = episodes.EpisodeSpec(num_tasks=1, ways=3, shots=2, queries_per_class=3)
  with pytest.raises(ValueError, match='= 5 images per class'):
    episodes.validate_spec(spec, (NUM_CLASSES, NUM_IMAGES, 2, 2, 1))
  episodes.validate_spec(spec._replace(independent_draws=True), (NUM_CLASSES, NUM_IMAGES, 2, 2, 1))
  # With the same classes in every task, each task draws anew: T does not multiply.
  same = spec._replace(num_tasks=3, task_classes='same', independent_draws=True)
  assert episodes.images_per_class_needed(same) == 3
  episode = jax.eval_shape(lambda key: episodes.sample_episode(
      key, named_images(), same, rotate=True), jax.random.key(1))  # Traceable; no compile.
  assert episode['query_images'].shape == (3, 9, 2, 2, 1)
  problems = episodes.spec_problems(same._replace(queries_per_class=5), NUM_CLASSES, NUM_IMAGES)
  assert any('episode.independent_draws' in p and '= 5 distinct images' in p for p in problems)


def test_host_pipeline_honours_independent_draws():
  labels = np.repeat(np.arange(NUM_CLASSES), NUM_IMAGES)  # Record r is image r % M of r // M.
  index = pipeline.class_index(labels)
  n = SPEC.shots

  def fraction(spec):
    records, classes = pipeline.episode_indices(7, 3, index, spec, 500)
    assert (records // NUM_IMAGES == classes[..., None]).all()
    return repeat_fraction(records[..., :n], records[..., n:])

  assert fraction(SPEC) == 0.0
  assert fraction(INDEPENDENT) == pytest.approx(1 / NUM_IMAGES, abs=0.02)
  first = pipeline.episode_indices(7, 3, index, INDEPENDENT, 4)
  again = pipeline.episode_indices(7, 3, index, INDEPENDENT, 4)
  np.testing.assert_array_equal(first[0], again[0])


def test_original_test_sampler_keeps_the_support_set_and_draws_from_all_images(sampled):
  strict, original = sampled['strict'], sampled['original']
  # Paired episodes: the same classes and support images, only the queries differ.
  np.testing.assert_array_equal(strict['support_images'], original['support_images'])
  np.testing.assert_array_equal(strict['class_ids'], original['class_ids'])
  t, k, q, e = EVAL_SPEC.num_tasks, EVAL_SPEC.ways, EVAL_SPEC.queries_per_class, NUM_EPISODES // 2
  support = image_ids(strict['support_images']).reshape(e, 1, t, k, 1)
  per_draw = lambda episode: image_ids(episode['query_images']).reshape(e, NUM_DRAWS, t, k, q)
  assert repeat_fraction(support, per_draw(strict)) == 0.0
  assert repeat_fraction(support, per_draw(original)) == pytest.approx(1 / NUM_IMAGES, abs=0.02)
  # Each draw anew: the query sets of one class differ between draws.
  queries = np.sort(per_draw(original), -1)
  assert (queries[:, 1:] != queries[:, :1]).any(-1).mean() > 0.5


def test_evaluation_records_the_sampler_in_json_markdown_and_file_names(tmp_path, monkeypatch):
  config = tiny_config()
  protocol = evaluate.default_protocol(config, num_episodes=2, num_query_draws=2,
                                       batch_size=2, sampler='original', specificity_pairs=0)
  assert evaluate.default_protocol(config).sampler == 'strict'
  assert evaluate.evaluation_spec(config, protocol).independent_draws
  # The training config's draws do not choose the evaluation's.
  independent = tiny_config(**{'episode.independent_draws': True})
  assert not evaluate.evaluation_spec(independent, evaluate.default_protocol(independent)
                                      ).independent_draws
  with pytest.raises(evaluate.EvaluationError, match="sampler must be one of"):
    evaluate.default_protocol(config, sampler='lenient')

  # The protocol's own run is tested in test_evaluate.py; here what it is given and
  # what the result files say, without compiling a model.
  given = []

  def run_protocol(method, params, images, protocol, spec, signals=None):
    del signals
    given.append(spec)
    t = protocol.num_tasks
    matrix = np.where(np.tril(np.ones((t, t))) > 0, 0.5, np.nan)
    return {'task_incremental': np.stack([matrix] * protocol.num_episodes),
            'class_incremental': np.stack([matrix] * protocol.num_episodes),
            'timing': {'seconds': 1.0, 'first_batch_seconds': 1.0,
                       'episodes_per_second': 2.0, 'device': 'cpu'}}

  monkeypatch.setattr(evaluate, 'run_protocol', run_protocol)
  results = evaluate.evaluate(config, None, protocol, class_images(images_per_class=8),
                              methods.build(config))
  assert given[0].independent_draws
  results.update(workdir=str(tmp_path), step=1)
  prefix = reports.result_prefix(str(tmp_path), protocol, 1)
  assert prefix.endswith(os.path.join('eval', f'test_T{protocol.num_tasks}_step1_original'))
  strict_prefix = reports.result_prefix(
      str(tmp_path), dataclasses.replace(protocol, sampler='strict'), 1)
  assert strict_prefix != prefix  # The two protocols never overwrite each other's files.
  paths = reports.write_results(results, prefix, plot=False)
  with open(paths[0]) as f:
    saved = json.load(f)
  assert saved['protocol']['sampler'] == 'original'
  assert saved['episode']['independent_draws'] is True
  with open(paths[2]) as f:
    assert 'original query sampler' in f.read()


def test_binarized_images_have_two_values_split_at_the_midpoint():
  grey = np.arange(256, dtype=np.uint8).reshape(1, 1, 16, 16, 1)
  binary = omniglot.binarize_images(grey)
  assert binary.dtype == np.uint8 and set(np.unique(binary)) == {0, 255}
  assert (binary[grey < 128] == 0).all() and (binary[grey >= 128] == 255).all()


def test_binarized_omniglot_has_its_own_cache(tmp_path):
  data_dir, size = str(tmp_path), 8
  rng = np.random.default_rng(0)
  grey = {s: rng.integers(0, 256, (n, 20, size, size, 1), dtype=np.uint8)
          for s, n in zip(omniglot.SPLITS, omniglot.HT_SPLIT_SIZES)}
  grey_path = omniglot._cache_path(data_dir, 'ht', 2022, size)
  omniglot._save_npz(grey_path, grey)  # What a run on the real data leaves.
  binary_path = omniglot._cache_path(data_dir, 'ht', 2022, size, binarize=True)
  assert binary_path != grey_path

  config = tiny_config(**{'data.data_dir': data_dir, 'data.image_size': size,
                          'data.binarize': True})
  out = datasets.load_dataset(config)
  assert os.path.exists(binary_path)
  for split in omniglot.SPLITS:
    assert set(np.unique(out[split])) == {0, 255}
    np.testing.assert_array_equal(out[split], omniglot.binarize_images(grey[split]))
  # The grey cache is untouched and still what a grey config reads.
  np.testing.assert_array_equal(
      datasets.load_dataset(tiny_config(**{'data.data_dir': data_dir, 'data.image_size': size,
                                           'data.binarize': False}))['test'], grey['test'])
  # A second binarised load reads its own file, not the grey one.
  os.remove(grey_path)
  again = omniglot.load_omniglot(data_dir, None, image_size=size, binarize=True)
  np.testing.assert_array_equal(again['train'], out['train'])


def test_config_validation_knows_the_options():
  config_validation.validate(tiny_config(**{'data.binarize': True,
                                            'episode.independent_draws': True}), num_devices=1)
  fields = tiny_config().to_dict()  # A config file builds its dicts freely.
  fields['episode']['independent_draws'] = 'yes'
  with pytest.raises(config_validation.ConfigError,
                     match="episode.independent_draws = 'yes': must be True or False"):
    config_validation.validate(ml_collections.ConfigDict(fields), num_devices=1)
  with pytest.raises(config_validation.ConfigError, match="data.binarize = True binarises"):
    config_validation.validate(tiny_config(**{'data.binarize': True,
                                              'data.dataset': 'tiered_imagenet'}), num_devices=1)
  # A config saved before the options (config.json of an older run) reads as what that run
  # trained with: distinct draws.
  old = tiny_config()
  with old.unlocked():
    del old.episode['independent_draws']
  assert not datasets.episode_spec(old).independent_draws


def test_paper_configs_train_with_the_original_conventions():
  from configs import omniglot_ht_ce, omniglot_minibatch, omniglot_t5, tiered_imagenet_t2  # pylint: disable=g-import-not-at-top
  for config in (omniglot_ht_ce.get_config('1'), omniglot_t5.get_config(),
                 omniglot_t5.get_config('tiny')):
    assert config.episode.independent_draws is True and config.data.binarize is True
    config_validation.validate(config, num_devices=1)
  # Not Omniglot: its pixels stay as they are; the original's draws all the same.
  tiered = tiered_imagenet_t2.get_config()
  assert tiered.episode.independent_draws is True and tiered.data.binarize is False
  config_validation.validate(tiered, num_devices=1)
  # The mini-batch setting draws new images in every task; `:fast` keeps the conventions
  # its results were measured with.
  assert omniglot_minibatch.get_config().episode.independent_draws is False
  fast = omniglot_t5.get_config('fast')
  assert fast.episode.independent_draws is False and fast.data.binarize is False
