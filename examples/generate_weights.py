r"""Generate and update a CNN from a few Omniglot test images with a trained CHT.

  python examples/generate_weights.py --workdir=workdirs/omniglot_t5 [--num_tasks=5]

Loads the model of a training workdir (its config from `<workdir>/config.json`
unless --config is given), then learns `num_tasks` tasks of new Omniglot test
classes one after the other with `cht_jax.api` (no training, no gradient):
each task's K-way N-shot support set, plus the weights and prototypes of the
tasks before, gives new weights and prototypes. After each task it prints the
task-incremental accuracy on every task so far and the class-incremental
accuracy over all of them, on held-out images of the same classes.
"""

import os
import sys
import time

from absl import app
from absl import flags
import numpy as np
from ml_collections import config_flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from cht_jax import api  # pylint: disable=g-import-not-at-top
from cht_jax.data import datasets  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS


def define_model_flags() -> None:
  """The flags of `load` (which model, its config and data) and of `make_tasks`'s seed."""
  flags.DEFINE_string('workdir', None, 'The training workdir of the model.', required=True)
  config_flags.DEFINE_config_file('config', None, 'Its config file; default '
                                  '<workdir>/config.json.')
  flags.DEFINE_string('data_dir', None, 'TFDS data dir; default the config\'s.')
  flags.DEFINE_integer('seed', 0, 'Picks the classes and images.')


def _define_flags():
  """Only when run as a script (tests import `run`)."""
  define_model_flags()
  flags.DEFINE_integer('num_tasks', 3, 'Tasks to learn one after the other.')
  flags.DEFINE_integer('queries_per_class', 5, 'Held-out images per class to classify.')


def make_tasks(test_images: np.ndarray, num_tasks: int, ways: int, shots: int,
               queries_per_class: int, seed: int):
  """Disjoint tasks of test classes: (support, support labels, queries, query labels)."""
  rng = np.random.default_rng(seed)
  classes = rng.choice(len(test_images), num_tasks * ways, replace=False).reshape(num_tasks, ways)
  tasks = []
  for task_classes in classes:
    picks = [rng.permutation(test_images.shape[1])[:shots + queries_per_class]
             for _ in task_classes]
    images = np.stack([test_images[c, p] for c, p in zip(task_classes, picks)])  # [K, N+Q, ...]
    labels = lambda n: np.repeat(np.arange(ways), n)
    tasks.append((images[:, :shots].reshape(-1, *images.shape[2:]), labels(shots),
                  images[:, shots:].reshape(-1, *images.shape[2:]), labels(queries_per_class)))
  return tasks


def run(model: api.Model, test_images: np.ndarray, shots: int, num_tasks: int,
        queries_per_class: int, seed: int, log=print) -> list[dict[str, float]]:
  """Learns the tasks one by one; returns, per task t, the accuracies after it."""
  tasks = make_tasks(test_images, num_tasks, model.num_ways, shots, queries_per_class, seed)
  theta, prototypes, history = None, None, []
  for t, (support, support_labels, _, _) in enumerate(tasks):
    start = time.perf_counter()
    theta, prototypes = api.learn_task(model, support, support_labels, theta, prototypes)
    seconds = time.perf_counter() - start
    row = {'seconds': seconds}
    for tau in range(t + 1):
      _, _, queries, labels = tasks[tau]
      predicted = api.classify(model, theta, prototypes, queries, task=tau)
      row[f'task_{tau}'] = float(np.mean(np.asarray(predicted) == labels))
    # Class-incremental: every query of tasks 0..t, each task's queries one batch.
    correct = []
    for tau in range(t + 1):
      _, _, queries, labels = tasks[tau]
      task_ids, predicted = api.classify(model, theta, prototypes, queries)
      correct.append((np.asarray(task_ids) == tau) & (np.asarray(predicted) == labels))
    row['class_incremental'] = float(np.mean(correct))
    history.append(row)
    log(f'After task {t} ({seconds:.2f} s to generate theta_{t}'
        f'{", with compilation" if t == 0 else ""}): task-incremental '
        + ', '.join(f'task {tau} {100 * row[f"task_{tau}"]:.1f}%' for tau in range(t + 1))
        + f'; class-incremental on tasks 0..{t}: {100 * row["class_incremental"]:.1f}%')
  return history


def load(workdir: str, config=None, data_dir: str | None = None, step: int | None = None):
  """(config, model, test class images) of a training workdir (config None: its config.json)."""
  config = config or api.load_config(workdir)
  if data_dir:
    config.data.data_dir = data_dir
  model = api.load_model(workdir, config, step)
  return config, model, datasets.load_dataset(config)['test']


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  config, model, test_images = load(FLAGS.workdir, FLAGS.config, FLAGS.data_dir)
  print(f'Loaded the {model.num_ways}-way model of step {model.step} from {FLAGS.workdir}.')
  run(model, test_images, config.episode.shots, FLAGS.num_tasks, FLAGS.queries_per_class,
      FLAGS.seed)


if __name__ == '__main__':
  _define_flags()
  app.run(main)
