r"""How much could per-task weights add to a trained CHT's generated CNN?

  python diagnostics/adaptation_headroom.py --workdir=workdirs/omniglot_t2 [--num_tasks=40]

An oracle around the trained model, for the question diagnostics/task_specificity.py
leaves open: when the generated CNN is the same for every task, how much does that
cost? On tasks of Omniglot test classes, theta_0 is generated as usual from one image
per class, and every variant is scored on the same held-out images of those classes:

  generated            prototypes of the 1-shot support set: the usual task-0 accuracy;
  generated, N-shot    prototypes of --adapt_shots labelled images per class, theta_0
                       unchanged;
  adapted (part)       theta_0 fine-tuned on those N-shot images by Adam on a
                       leave-one-out prototypical loss (all of theta, the head, or the
                       conv kernels), then N-shot prototypes.

adapted - (generated, N-shot) is what per-task weights found by gradient descent, with N
times the labels of the 1-shot task, add to the trained CNN. Near 0, writing one CNN for
every task costs little around this solution (a generator trained with the CNN could
still reach a different one).
"""

import functools
import os
import sys
from typing import Callable

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

# This folder holds task_specificity, examples/ generate_weights, the root cht_jax.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'examples'))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from cht_jax import api  # pylint: disable=g-import-not-at-top
import generate_weights  # pylint: disable=g-import-not-at-top
import task_specificity  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS

# Which arrays of theta each adapted variant trains (by their path, e.g. 'block_1/kernel').
PARTS = {
    'all': lambda path: True,
    'head': lambda path: path.startswith('head/'),
    'conv_kernels': lambda path: path.endswith('/kernel') and not path.startswith('head/'),
}


def _define_flags():
  """Only when run as a script (tests import `run`)."""
  generate_weights.define_model_flags()
  flags.DEFINE_integer('step', None, 'Checkpoint step; default the latest.')
  flags.DEFINE_integer('num_tasks', 40, 'Tasks (each of its own test classes) to average.')
  flags.DEFINE_integer('adapt_shots', 5, 'Labelled images per class to adapt theta on.')
  flags.DEFINE_integer('queries_per_class', 15, 'Held-out images per class to score.')
  flags.DEFINE_integer('adapt_steps', 100, 'Adam steps of the adaptation.')
  flags.DEFINE_float('learning_rate', 1e-3, 'Adam learning rate of the adaptation.')


def leave_one_out_loss(cnn, theta, images: jax.Array) -> jax.Array:
  """Prototypical loss of [K, N, H, W, C] images (N >= 2), one BatchNorm batch: each
  image against the mean of the other N-1 of its class and the means of the other
  classes."""
  num_classes, shots = images.shape[:2]
  embeddings = cnn.apply({'params': theta}, images.reshape((-1,) + images.shape[2:]))
  embeddings = embeddings.reshape(num_classes, shots, -1)
  own_prototype = (embeddings.sum(1, keepdims=True) - embeddings) / (shots - 1)
  distances = jnp.sum((embeddings[:, :, None] - embeddings.mean(1)[None, None]) ** 2, -1)
  own = jnp.sum((embeddings - own_prototype) ** 2, -1)  # [K, N]
  labels = jnp.arange(num_classes)
  distances = distances.at[labels, :, labels].set(own)  # [K, N, K]
  return optax.softmax_cross_entropy_with_integer_labels(
      -distances, jnp.broadcast_to(labels[:, None], (num_classes, shots))).mean()


def adapt(model: api.Model, theta, images: jax.Array, trainable: Callable[[str], bool],
          steps: int, learning_rate: float):
  """theta after `steps` Adam steps of `leave_one_out_loss` on the arrays `trainable`
  names; the others stay as they are. Returns (theta, [loss before each step])."""
  theta, losses = _adapt(model.ht.cnn, theta, images, trainable, steps, learning_rate)
  return theta, [float(loss) for loss in losses]


# One compilation per (network, part, steps, rate), reused across tasks.
@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5))
def _adapt(cnn, theta, images, trainable, steps, learning_rate):
  labels = jax.tree_util.tree_map_with_path(
      lambda path, _: 'train' if trainable(jax.tree_util.keystr(
          path, simple=True, separator='/')) else 'freeze', theta)
  optimizer = optax.multi_transform(
      {'train': optax.adam(learning_rate), 'freeze': optax.set_to_zero()}, labels)

  def step(carry, _):
    theta, state = carry
    loss, grads = jax.value_and_grad(
        lambda t: leave_one_out_loss(cnn, t, images))(theta)
    updates, state = optimizer.update(grads, state, theta)
    return (optax.apply_updates(theta, updates), state), loss

  (theta, _), losses = jax.lax.scan(step, (theta, optimizer.init(theta)), None, length=steps)
  return theta, losses


def run(model: api.Model, test_images: np.ndarray, num_tasks: int, adapt_shots: int,
        queries_per_class: int, adapt_steps: int, learning_rate: float, seed: int) -> dict:
  """Mean accuracy (and 95% CI over tasks) of each variant in the module docstring."""
  ways = model.num_ways
  scores = {'generated': [], 'generated_n_shot': [], **{f'adapted_{p}': [] for p in PARTS}}
  for task in range(num_tasks):
    ((support, support_labels, queries, query_labels),) = generate_weights.make_tasks(
        test_images, 1, ways, adapt_shots, queries_per_class, seed * 1_000_003 + task)
    by_class = support.reshape((ways, adapt_shots) + support.shape[1:])
    one_shot, one_shot_labels = by_class[:, 0], np.arange(ways)
    theta = api.learn_task(model, one_shot, one_shot_labels).theta
    score = lambda theta, support, labels: task_specificity.accuracy_with(
        model, theta, support, labels, queries, query_labels)
    scores['generated'].append(score(theta, one_shot, one_shot_labels))
    scores['generated_n_shot'].append(score(theta, support, support_labels))
    images = api.preprocess(model, support).reshape((ways, adapt_shots) + model.image_shape)
    for part, trainable in PARTS.items():
      adapted, _ = adapt(model, theta, images, trainable, adapt_steps, learning_rate)
      scores[f'adapted_{part}'].append(score(adapted, support, support_labels))
  ci95 = lambda x: float(1.96 * np.std(x) / np.sqrt(len(x)))
  base = np.asarray(scores['generated_n_shot'])
  # gain: paired over the same tasks and held-out images, against the N-shot prototypes.
  return {name: {'mean': float(np.mean(v)), 'ci95': ci95(v),
                 'gain': float(np.mean(np.asarray(v) - base)),
                 'gain_ci95': ci95(np.asarray(v) - base)} for name, v in scores.items()}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  _, model, test_images = generate_weights.load(FLAGS.workdir, FLAGS.config, FLAGS.data_dir,
                                                FLAGS.step)
  result = run(model, test_images, FLAGS.num_tasks, FLAGS.adapt_shots,
               FLAGS.queries_per_class, FLAGS.adapt_steps, FLAGS.learning_rate, FLAGS.seed)
  print(f'{FLAGS.workdir}, step {model.step}, {FLAGS.num_tasks} tasks of test classes, '
        f'{FLAGS.queries_per_class} held-out images per class:')
  for name, value in result.items():
    gain = (f'   {100 * value["gain"]:+.2f} +- {100 * value["gain_ci95"]:.2f} (paired) '
            'against generated_n_shot' if name.startswith('adapted') else '')
    print(f'  {name:22s} {100 * value["mean"]:.1f} +- {100 * value["ci95"]:.1f}{gain}')


if __name__ == '__main__':
  _define_flags()
  app.run(main)
