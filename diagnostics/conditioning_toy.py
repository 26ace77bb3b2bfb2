r"""Can the HyperTransformer write a CNN that depends on the support set? A toy that needs it.

  python diagnostics/conditioning_toy.py [--steps=1500] [--config.model.feature_norm=True]

On Omniglot every trained model so far writes one CNN for every task
(diagnostics/task_specificity.py, docs/recipe.md). This asks whether that is
the landscape of Omniglot or a limit of the generator: it trains the HyperTransformer
(T=1) and, as the control, a fixed CNN (the same network, its weights trained directly as
a prototypical network) on synthetic tasks that a fixed CNN cannot solve.

Each K-way 1-shot task draws a relevant channel r of C. Every image is C constant planes
(plus pixel noise): plane r holds the class's value (a permutation of K evenly spaced
values in [-1, 1]), the other planes values drawn independently for each image from the
same K values. The support images, and only they, carry a checkerboard on plane r: the
task's cue. A query alone does not say which plane matters, so a fixed CNN must weigh all
planes, and the other planes' values, drawn anew for every image, bury the class's; a CNN
written from the support set can read plane r alone and classify every query.

It prints the query accuracy of both models on fresh tasks, and for the
HyperTransformer also with the CNN written from another task's support set (swapped:
the same tasks and prototypes, another relevant plane), which is the fixed CNN's lot.
How to read it: the HyperTransformer's own accuracy well above the fixed CNN's, and its
swapped accuracy near chance (1/K), means the generator writes task-specific CNNs; its
own accuracy at the fixed CNN's level means it does not condition on the support set.
The model is `configs/omniglot_t1.py:tiny`'s (1 transformer layer, 8 channels, 16x16
images); `--config.*` flags change it.
"""

import functools
import os
import sys

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import ml_collections
from ml_collections import config_flags
import numpy as np
import optax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from cht_jax import evaluate  # pylint: disable=g-import-not-at-top
from cht_jax import losses  # pylint: disable=g-import-not-at-top
from cht_jax import metrics  # pylint: disable=g-import-not-at-top
from cht_jax import models  # pylint: disable=g-import-not-at-top
from cht_jax.methods import cht  # pylint: disable=g-import-not-at-top
from cht_jax.models import hypertransformer as ht_lib  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS


def _define_flags():
  """Only when run as a script (tests import `run`)."""
  config_flags.DEFINE_config_file(
      'config', os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'configs',
                             'omniglot_t1.py:tiny'), 'The model (its episode sizes too).')
  flags.DEFINE_integer('ways', 5, 'Classes per task.')
  flags.DEFINE_integer('planes', 3, 'Image channels: the relevant one and the others.')
  flags.DEFINE_integer('steps', 1500, 'Adam steps of each model.')
  flags.DEFINE_integer('batch', 8, 'Tasks per step.')
  flags.DEFINE_float('learning_rate', 2e-3, 'Adam learning rate of both models.')
  flags.DEFINE_integer('eval_tasks', 256, 'Fresh tasks to score.')
  flags.DEFINE_integer('seed', 0, 'Seed of the tasks and the initialisation.')


def make_tasks(key: jax.Array, num_tasks: int, ways: int, queries_per_class: int,
               image_size: int, planes: int, texture: float = 0.5, noise: float = 0.1):
  """`num_tasks` toy tasks: (support [N, K, H, W, C], queries [N, K*Q, H, W, C], query
  labels [N, K*Q], relevant plane [N]); support image k is class k."""
  k_plane, k_perm, k_support, k_query, k_noise = jax.random.split(key, 5)
  values = jnp.linspace(-1.0, 1.0, ways)
  relevant = jax.random.randint(k_plane, (num_tasks,), 0, planes)
  class_value = jax.vmap(lambda k: values[jax.random.permutation(k, ways)])(
      jax.random.split(k_perm, num_tasks))  # [N, K]
  query_labels = jnp.tile(jnp.repeat(jnp.arange(ways), queries_per_class), (num_tasks, 1))
  one_hot = jax.nn.one_hot(relevant, planes)[:, None]  # [N, 1, C]

  def planes_of(key, labels):  # [N, M] labels -> [N, M, C] plane values
    others = values[jax.random.randint(key, labels.shape + (planes,), 0, ways)]
    own = jnp.take_along_axis(class_value, labels, 1)[..., None]
    return one_hot * own + (1 - one_hot) * others

  def images_of(plane_values, key):
    shape = plane_values.shape[:2] + (image_size, image_size, planes)
    return (plane_values[:, :, None, None, :]
            + noise * jax.random.normal(key, shape))

  support_labels = jnp.tile(jnp.arange(ways), (num_tasks, 1))
  k_sn, k_qn = jax.random.split(k_noise)
  support = images_of(planes_of(k_support, support_labels), k_sn)
  checkerboard = (-1.0) ** (jnp.arange(image_size)[:, None] + jnp.arange(image_size))
  support += texture * checkerboard[None, None, :, :, None] * one_hot[:, :, None, None]
  queries = images_of(planes_of(k_query, query_labels), k_qn)
  return support, queries, query_labels, relevant


def prototype_loss(cnn, theta, support, queries, query_labels):
  """Cross-entropy and accuracy of one K-way 1-shot task under the CNN `theta`."""
  prototypes = cnn.apply({'params': theta}, support)  # support image k is class k.
  logits = losses.negative_squared_distances(cnn.apply({'params': theta}, queries),
                                             prototypes)
  return losses.cross_entropy_and_accuracy(logits, query_labels)


def generate(ht, params, support, ways):
  """theta_0 written from one task's support set."""
  image_shape = support.shape[1:]
  return ht.apply({'params': params}, support, jnp.arange(ways),
                  ht_lib.zeros_theta(ht.cnn, image_shape))


def run(config, ways: int = 5, planes: int = 3, steps: int = 1500, batch: int = 8,
        learning_rate: float = 2e-3, eval_tasks: int = 256, seed: int = 0) -> dict:
  """Trains both models; their accuracies on `eval_tasks` fresh tasks, with 95% CIs."""
  config = config.copy_and_resolve_references()
  with config.unlocked():
    config.episode.ways = ways
    config.episode.shots = 1
  ht = models.build_hypertransformer(config)
  cnn = ht.cnn
  image_size, queries_per_class = config.data.image_size, config.episode.queries_per_class
  tasks = functools.partial(make_tasks, ways=ways, queries_per_class=queries_per_class,
                            image_size=image_size, planes=planes)
  key_init, key_cnn, key_train, key_eval = jax.random.split(jax.random.key(seed), 4)
  support0 = tasks(key_init, 1)[0][0]
  # Jitted, here and below: one program each, not an XLA program per operation.
  ht_params = jax.jit(ht.init)(key_init, support0, jnp.arange(ways),
                               ht_lib.zeros_theta(cnn, support0.shape[1:]))['params']
  cnn_params = jax.jit(cnn.init)(key_cnn, support0)['params']

  def ht_loss(params, support, queries, query_labels):
    theta = generate(ht, params, support, ways)
    return prototype_loss(cnn, theta, support, queries, query_labels)

  def cnn_loss(params, support, queries, query_labels):
    return prototype_loss(cnn, params, support, queries, query_labels)

  def train(loss_fn, params):
    optimizer = optax.adam(learning_rate)

    def step(carry, key):
      params, state = carry
      support, queries, query_labels, _ = tasks(key, batch)
      batch_loss = lambda p: jnp.mean(jax.vmap(
          lambda s, q, l: loss_fn(p, s, q, l)[0])(support, queries, query_labels))
      loss, grads = jax.value_and_grad(batch_loss)(params)
      updates, state = optimizer.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), loss

    (params, _), loss_curve = jax.lax.scan(step, (params, optimizer.init(params)),
                                           jax.random.split(key_train, steps))
    return params, loss_curve

  ht_params, ht_curve = jax.jit(functools.partial(train, ht_loss))(ht_params)
  cnn_params, cnn_curve = jax.jit(functools.partial(train, cnn_loss))(cnn_params)

  method = cht.CHT(ml_collections.FrozenConfigDict(config), ht=ht)

  @jax.jit
  def task_accuracies(ht_params, cnn_params):
    support, queries, query_labels, relevant = tasks(key_eval, eval_tasks)
    # Task i is A and task i+1 is B of pair i, scored as the evaluation scores any model.
    pair = lambda x: jnp.stack([x, jnp.roll(x, -1, axis=0)], axis=1)
    episodes = {'support_images': pair(support),
                'support_labels': jnp.tile(jnp.arange(ways), (eval_tasks, 2, 1)),
                'query_images': pair(queries)[:, None], 'query_labels': pair(query_labels)}
    own, swapped, _ = jax.vmap(lambda e: method.task_specificity(ht_params, e))(episodes)
    fixed = jax.vmap(lambda s, q, l: prototype_loss(cnn, cnn_params, s, q, l)[1])(
        support, queries, query_labels)
    return own, swapped, fixed, relevant != jnp.roll(relevant, -1)

  own, swapped, fixed, other_plane = map(np.asarray, task_accuracies(ht_params, cnn_params))
  # The pairs whose relevant planes differ: where a written CNN that reads the relevant plane
  # alone must fail.
  scores = {'hypertransformer': own, 'hypertransformer_swapped': swapped[other_plane],
            'fixed_cnn': fixed}
  ci95 = lambda x: float(metrics.mean_and_ci(x)[1])
  result = {name: {'mean': float(np.mean(v)), 'ci95': ci95(v)} for name, v in scores.items()}
  result['task_specificity'] = evaluate.summarize_specificity(
      {'own': own, 'swapped': swapped, 'theta': {}})
  result['chance'] = 1.0 / ways
  result['final_loss'] = {'hypertransformer': float(np.mean(ht_curve[-50:])),
                          'fixed_cnn': float(np.mean(cnn_curve[-50:]))}
  return result


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  result = run(FLAGS.config, FLAGS.ways, FLAGS.planes, FLAGS.steps, FLAGS.batch,
               FLAGS.learning_rate, FLAGS.eval_tasks, FLAGS.seed)
  print(f'{FLAGS.ways}-way 1-shot toy tasks, {FLAGS.planes} planes, {FLAGS.steps} steps of '
        f'{FLAGS.batch} tasks; accuracy on {FLAGS.eval_tasks} fresh tasks '
        f'(chance {100 * result["chance"]:.0f}):')
  for name in ('hypertransformer', 'hypertransformer_swapped', 'fixed_cnn'):
    print(f'  {name:26s} {100 * result[name]["mean"]:.1f} +- {100 * result[name]["ci95"]:.1f}')
  specificity = result['task_specificity']
  print(f'  own - swapped over all {specificity["num_pairs"]} pairs (the evaluation\'s task '
        f'specificity): {100 * specificity["difference"]:+.1f} +- '
        f'{100 * specificity["ci95"]:.1f} points')
  print(f'  final training loss: {result["final_loss"]}')


if __name__ == '__main__':
  _define_flags()
  app.run(main)
