r"""How much do a trained CHT's generated weights depend on the task?

  python diagnostics/task_specificity.py --workdir=workdirs/omniglot_t2 [--num_pairs=200]

A HyperTransformer can lower its loss by writing the same CNN for every task (a
ConstPN, with the support set used only for the prototypes) before it learns to
write task-specific ones, which is what makes CHT better than ConstPN in the
paper. Every evaluation report measures which of the two a checkpoint does
(`evaluate.task_specificity`, docs/evaluation.md): on pairs (A, B) of disjoint
test tasks, A's queries are classified with theta_A (written from A's support set)
and with theta_B, the prototypes always A's; own - swapped (paired) is near 0 where
the written CNN does not depend on its task, and the spread of each array across
tasks (standard deviation over tasks / root mean square) is 0 for arrays the
HyperTransformer does not write. This script prints that measure alone, without the
protocol, and adds how each written layer's weight tokens attend to the support
tokens (`attention`): what share of their attention goes to the support set, how
concentrated it is there, and whether they pick the same labels in every task
(attending by label reads the label embeddings, which are the same in every task).
"""

import os
import sys

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

# examples/ holds generate_weights (the shared loading and task sampling); the root, cht_jax.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'examples'))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from cht_jax import api  # pylint: disable=g-import-not-at-top
from cht_jax import evaluate  # pylint: disable=g-import-not-at-top
from cht_jax import losses  # pylint: disable=g-import-not-at-top
from cht_jax import methods  # pylint: disable=g-import-not-at-top
from cht_jax.models import hypertransformer as ht_lib  # pylint: disable=g-import-not-at-top
import generate_weights  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS


def _define_flags():
  """Only when run as a script (tests import `run`)."""
  generate_weights.define_model_flags()
  flags.DEFINE_integer('step', None, 'Checkpoint step; default the latest.')
  flags.DEFINE_integer('num_pairs', 200, 'Pairs of tasks (A, B).')
  flags.DEFINE_integer('queries_per_class', 5, 'Images per class of A to classify.')
  flags.DEFINE_integer('num_attention_tasks', 20, 'Tasks to average the attention over.')


def accuracy_with(model: api.Model, theta, support, support_labels, queries,
                  query_labels) -> float:
  """Task accuracy on `queries` with the CNN `theta` and the support set's prototypes."""
  embeddings = api.embed(model, theta, support)
  prototypes = losses.class_prototypes(embeddings, jnp.asarray(support_labels), model.num_ways)
  predicted = api.classify(model, theta, prototypes[None], queries, task=0)
  return float(np.mean(np.asarray(predicted) == query_labels))


def run(config, params, test_images: np.ndarray, num_pairs: int, queries_per_class: int,
        seed: int) -> dict:
  """`evaluate.task_specificity` of `params` on `num_pairs` pairs of test tasks, one query
  draw each of `queries_per_class` images per class."""
  protocol = evaluate.default_protocol(
      config, num_tasks=2, num_episodes=num_pairs, specificity_pairs=num_pairs,
      queries_per_class=queries_per_class, num_query_draws=1, seed=seed)
  return evaluate.task_specificity(methods.build(config), params, test_images, protocol,
                                   evaluate.evaluation_spec(config, protocol))


def attention(model: api.Model, test_images: np.ndarray, shots: int, num_tasks: int,
              seed: int) -> dict:
  """How the weight tokens attend to the support tokens, over `num_tasks` test tasks.

  Returns:
    {'<layer>/<encoder layer>': stats}, stats the means over tasks, heads and
    weight tokens of: 'on_support', the attention weight on the support tokens;
    'entropy', the entropy of the attention renormalised over the support tokens
    divided by log S (1: uniform, 0: one token); 'top', the largest weight of the
    renormalised attention (1/S uniform); 'same_label', how often a (head, weight
    token) attends most to the support image of the label it attends most to in
    most tasks; and 'same_label_chance', that share for labels drawn at random
    (the modal count of `num_tasks` uniform draws of K labels, simulated).
  """
  # The fused CPU encoder is one C++ call: the XLA modules record the weights.
  ht = model.ht.clone(encoder_impl='xla')
  collect = jax.jit(lambda images, labels, theta: ht.apply(
      {'params': model.params}, images, labels, theta, mutable=['intermediates'])[1])
  zeros = ht_lib.zeros_theta(ht.cnn, model.image_shape)
  per_layer = {}
  for task in range(num_tasks):
    (support, labels, _, _), = generate_weights.make_tasks(test_images, 1, model.num_ways,
                                                           shots, 0, seed * 1_000_003 + task)
    found = collect(api.preprocess(model, support), jnp.asarray(labels), zeros)
    for path, weights in jax.tree_util.tree_flatten_with_path(found['intermediates'])[0]:
      weights = np.asarray(weights)  # [h, L, L]; the weight tokens first, then the support.
      num_weight_tokens = weights.shape[-1] - len(labels)
      rows = weights[:, :num_weight_tokens]
      on_support = rows[..., num_weight_tokens:].sum(-1)
      p = rows[..., num_weight_tokens:] / on_support[..., None]
      name = '/'.join(str(key.key) for key in path[:2]).replace('_transformer', '')
      per_layer.setdefault(name, []).append({
          'on_support': on_support.mean(),
          'entropy': (-(p * np.log(p + 1e-12)).sum(-1) / np.log(len(labels))).mean(),
          'top': p.max(-1).mean(),
          'top_label': labels[p.argmax(-1)]})  # [h, weight tokens]
  result = {}
  for name, tasks in per_layer.items():
    top_labels = np.stack([t['top_label'] for t in tasks])  # [tasks, h, weight tokens]
    modal = np.apply_along_axis(lambda x: np.bincount(x).max() / len(x), 0, top_labels)
    result[name] = {key: float(np.mean([t[key] for t in tasks]))
                    for key in ('on_support', 'entropy', 'top')}
    result[name]['same_label'] = float(modal.mean())
  draws = np.random.default_rng(seed).integers(0, model.num_ways, (1000, num_tasks))
  chance = np.mean([np.bincount(row).max() for row in draws]) / num_tasks
  for stats in result.values():
    stats['same_label_chance'] = float(chance)
  return result


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  config, model, test_images = generate_weights.load(FLAGS.workdir, FLAGS.config,
                                                     FLAGS.data_dir, FLAGS.step)
  result = run(config, model.params, test_images, FLAGS.num_pairs, FLAGS.queries_per_class,
               FLAGS.seed)
  if result is None:
    raise app.UsageError('Task specificity is not measured for this model (see the log).')
  print(f'{FLAGS.workdir}, step {model.step}, {result["num_pairs"]} pairs of test tasks:')
  print(f'  task-0 accuracy with its own theta    {100 * result["own"]:.1f} '
        f'+- {100 * result["own_ci95"]:.1f}')
  print(f'  with another task\'s theta             {100 * result["swapped"]:.1f} '
        f'(swapped: {result["swap"]})')
  print(f'  own - swapped (paired)                {100 * result["difference"]:+.2f} '
        f'+- {100 * result["ci95"]:.2f} points')
  print('  spread across tasks (std / rms) of each array of theta:')
  for name, value in result['spread'].items():
    print(f'    {name:24s} {value:.4f}')
  stats = attention(model, test_images, config.episode.shots, FLAGS.num_attention_tasks,
                    FLAGS.seed)
  chance = next(iter(stats.values()))['same_label_chance']
  print(f'  attention of the weight tokens to the support set, {FLAGS.num_attention_tasks} '
        f'tasks (uniform: top {1 / (model.num_ways * config.episode.shots):.3f}; '
        f'random labels: same label {chance:.3f}):')
  print(f'    {"layer/encoder layer":24s} on support  entropy/log S  top  same label')
  for name, s in stats.items():
    print(f'    {name:24s} {s["on_support"]:10.3f}  {s["entropy"]:13.3f}  {s["top"]:.3f}  '
          f'{s["same_label"]:.3f}')


if __name__ == '__main__':
  _define_flags()
  app.run(main)
