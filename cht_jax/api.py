"""Generate and update a CNN from your own few examples with a trained CHT.

No training: a checkpoint's HyperTransformer writes the CNN's weights from a labelled support
set, then rewrites them for each new task (paper, eq. 1; prototypes: eq. 4).

  from cht_jax import api
  model = api.load_model('workdirs/omniglot_t5')   # the training workdir
  theta, prototypes = api.learn_task(model, images_0, labels_0)                    # task 0
  theta, prototypes = api.learn_task(model, images_1, labels_1, theta, prototypes)  # task 1
  labels = api.classify(model, theta, prototypes, query_images, task=0)  # task-incremental
  tasks, labels = api.classify(model, theta, prototypes, query_images)   # class-incremental

Images are [N, H, W, C] (or [N, H, W]): uint8 0..255 or floats normalised as x / 128 - 1.
Labels are 0..K-1, every class at least once. The CNN's BatchNorm uses each batch's statistics
(as in the paper): classify batches like training's query sets, not single images.
"""

import functools
import os
import re
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from cht_jax import continual
from cht_jax import evaluate
from cht_jax import losses
from cht_jax import methods
from cht_jax import models
from cht_jax.data import datasets
from cht_jax.data import episodes as episodes_lib
from cht_jax.models import hypertransformer as ht_lib
from cht_jax.runtime import checkpoints
from cht_jax.runtime import workdir as workdir_lib


class Model(NamedTuple):
  """A trained HyperTransformer `ht` (`ht.cnn`: the generated CNN), its `params` and
  `compile_generator(ht, params)`; from `model_from_params` or `load_model`."""
  ht: ht_lib.HyperTransformer
  params: Any
  image_shape: tuple[int, int, int]
  step: int | None
  generate: Callable[..., tuple[Any, jax.Array]]

  @property
  def num_ways(self) -> int:
    return self.ht.num_ways


class Memory(NamedTuple):
  """After tasks 0..t: theta_t and prototypes [t+1, K, D] (row tau from theta_tau, frozen)."""
  theta: Any
  prototypes: jax.Array


def compile_generator(ht: ht_lib.HyperTransformer, params: Any):
  """`generate(support_images, support_labels, theta_prev, unlabeled_images=None)
  -> (theta_t, prototypes [K, D])`: `continual.generate_task` jitted with the parameters as
  constants, which XLA folds (faster per task, docs/performance.md; equal up to rounding)."""
  return jax.jit(lambda images, labels, theta_prev, unlabeled=None: continual.generate_task(
      ht, params, images, labels, theta_prev, unlabeled))


def model_from_params(config: ml_collections.ConfigDict, params: Any,
                      step: int | None = None) -> Model:
  """A `Model` of `config` with the given HyperTransformer parameters."""
  ht = models.build_hypertransformer(config)
  return Model(ht, params, datasets.image_shape(config), step, compile_generator(ht, params))


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """The config training recorded in `workdir` (`<workdir>/config.json`, with the changes a
  resume accepted since, `config_history.jsonl`)."""
  recorded = workdir_lib.recorded_config_tree(workdir)
  if recorded is None:
    raise FileNotFoundError(
        f'{os.path.join(workdir, "config.json")} not found: pass the config the model was '
        'trained with, e.g. load_model(workdir, omniglot_t5.get_config()) with '
        'configs/omniglot_t5.py.')
  return ml_collections.ConfigDict(recorded)


def load_model(workdir: str, config: ml_collections.ConfigDict | None = None,
               step: int | None = None) -> Model:
  """Loads the HyperTransformer of a training workdir's checkpoint (`step`; None: latest) and
  `config` (None: `<workdir>/config.json`). Raises FileNotFoundError or CheckpointError."""
  if not os.path.isdir(workdir):
    raise FileNotFoundError(
        f'load_model: the workdir {os.path.abspath(workdir)} does not exist. Pass the '
        "folder a training run wrote its checkpoints to, e.g. "
        "load_model('workdirs/omniglot_t5').")
  if config is None:
    config = load_config(workdir)
  if methods.method_name(config) != 'cht':
    raise ValueError(f'{workdir} holds a {methods.display_name(config)} model; the API '
                     'generates weights with a trained CHT (config.method = cht).')
  try:
    params, step = evaluate.restore_params(workdir, config, step)
  except checkpoints.CheckpointError as e:
    raise checkpoints.CheckpointError(_python_words(str(e))) from None
  return model_from_params(config, params, step)


# The command-line words of checkpoint errors, and what a caller of `load_model` passes instead.
_PYTHON_WORDS = (
    (r'Evaluate with the config \(and --config\.\* overrides\) the model was trained with; '
     r'training saved it as (\S+)\.(?=\s|$)',
     r'Pass load_model the config the model was trained with (config=...), or config=None '
     r'for the copy training saved as \1.'),
    (r'--checkpoint_step', 'load_model(..., step=N)'),
    (r'the --workdir\b', 'the workdir'),
    (r'--config\.\* overrides', 'changes to the config'),
)


def _python_words(message: str) -> str:
  """A checkpoint error's message with load_model's arguments for the CLI flags."""
  for pattern, words in _PYTHON_WORDS:
    message = re.sub(pattern, words, message)
  return message


# Normalised images lie in [-1, 1); floats beyond this are taken for unnormalised pixels.
NORMALISED_BOUND = 1.5


def preprocess(model: Model, images, name: str = 'images') -> jax.Array:
  """[N, H, W, C] (or [N, H, W]) uint8 or normalised float -> float32 [N, H, W, C]."""
  images = jnp.asarray(images)
  if images.ndim == 3:
    images = images[..., None]
  if images.ndim != 4 or tuple(images.shape[1:]) != tuple(model.image_shape):
    raise ValueError(f'{name} must be [N, {", ".join(map(str, model.image_shape))}] '
                     f'for this model, got shape {tuple(images.shape)}. Resize them '
                     '(Omniglot: bilinear to the config\'s data.image_size).')
  if images.dtype == jnp.uint8:
    return episodes_lib.normalize(images)
  if images.size:
    low, high = float(jnp.min(images)), float(jnp.max(images))
    if not -NORMALISED_BOUND <= low <= high <= NORMALISED_BOUND:
      raise ValueError(
          f'{name} are {images.dtype} with values in [{low:g}, {high:g}], not normalised '
          f'images (about -1..1). Pass uint8 pixels 0..255, or normalise them as '
          'x / 128 - 1.')
  return images.astype(jnp.float32)


def check_labels(model: Model, labels, num_images: int) -> jax.Array:
  """int32 [S] labels of a support set: integers, every class 0..K-1 at least once."""
  labels = np.asarray(labels)
  if not labels.size or not num_images:  # An empty list is float64: say what is missing.
    raise ValueError(
        f'learn_task got {num_images} support images and {labels.size} labels: a task needs '
        f'at least one labelled image of each class 0..{model.num_ways - 1} (the model is '
        f'{model.num_ways}-way).')
  if labels.dtype.kind not in 'iu':
    raise ValueError(f'support_labels must be integers 0..{model.num_ways - 1}, got '
                     f'dtype {labels.dtype}. Pass an int array (e.g. labels.astype(int)).')
  if labels.shape != (num_images,):
    raise ValueError(f'support_labels must be [{num_images}], one per support image, got '
                     f'shape {labels.shape}.')
  found = np.unique(labels)
  if found.size and (found.min() < 0 or found.max() >= model.num_ways):
    raise ValueError(f'support_labels must be in 0..{model.num_ways - 1} '
                     f'(the model is {model.num_ways}-way), got {found.tolist()}.')
  missing = sorted(set(range(model.num_ways)) - set(found.tolist()))
  if missing:
    raise ValueError(
        f'support_labels have no image of class{"es" if len(missing) > 1 else ""} '
        f'{", ".join(map(str, missing))}: the model is {model.num_ways}-way and each '
        "class's prototype is the mean of its labelled images, so every class 0.."
        f'{model.num_ways - 1} needs at least one.')
  return jnp.asarray(labels, jnp.int32)


@functools.partial(jax.jit, static_argnums=0)
def _embed(cnn, theta, images):
  return cnn.apply({'params': theta}, images)


def learn_task(model: Model, support_images, support_labels, theta: Any = None,
               prototypes: jax.Array | None = None, unlabeled_images=None) -> Memory:
  """Memory(theta_t, prototypes [t+1, K, D]) from task t's `support_images` [S, H, W, C] and
  `support_labels` int [S] in 0..K-1, and what `learn_task` returned for task t-1 (None for the
  first). `unlabeled_images` [U, H, W, C] reach the HyperTransformer only (of use to a model
  meta-trained with episode.unlabeled_per_class)."""
  if (theta is None) != (prototypes is None):
    raise ValueError('Pass both theta and prototypes of the earlier tasks, or neither.')
  images = preprocess(model, support_images, 'support_images')
  labels = check_labels(model, support_labels, images.shape[0])
  unlabeled = (None if unlabeled_images is None
               else preprocess(model, unlabeled_images, 'unlabeled_images'))
  if theta is None:
    theta = ht_lib.zeros_theta(model.ht.cnn, model.image_shape)
  # Placed like the parameters, so that theta_{-1} and a generated theta hit one compilation.
  theta = jax.device_put(theta, jax.tree.leaves(model.params)[0].sharding)
  new_theta, new_prototypes = model.generate(images, labels, theta, unlabeled)
  new_prototypes = new_prototypes[None]
  if prototypes is not None:
    new_prototypes = jnp.concatenate([prototypes, new_prototypes], axis=0)
  return Memory(new_theta, new_prototypes)


def embed(model: Model, theta: Any, images) -> jax.Array:
  """f_theta(images): [N, D] embeddings (one BatchNorm batch)."""
  images = preprocess(model, images)
  if not images.shape[0]:  # BatchNorm's mean over no image divides by zero inside JAX.
    raise ValueError(f'images has no image (shape {tuple(images.shape)}): pass at least one, '
                     "best a batch like training's query sets (the CNN's BatchNorm uses each "
                     "batch's statistics).")
  return _embed(model.ht.cnn, theta, images)


def classify(model: Model, theta: Any, prototypes: jax.Array, images,
             task: int | None = None):
  """Labels of `images` [N, H, W, C] (one batch) by nearest prototype: int32 [N] of `task` (eq. 5),
  or with task None, (tasks, labels) int32 [N] over all classes of tasks 0..t (eq. 6)."""
  embeddings = embed(model, theta, images)
  num_tasks, num_ways = prototypes.shape[:2]
  if task is not None:
    if not 0 <= task < num_tasks:
      raise ValueError(f'task must be in 0..{num_tasks - 1} (the tasks learnt so far), '
                       f'got {task}.')
    return jnp.argmax(losses.task_incremental_logits(embeddings, prototypes, task), axis=-1)
  logits = losses.class_incremental_logits(embeddings, prototypes, num_tasks - 1)
  best = jnp.argmax(logits, axis=-1)
  return best // num_ways, best % num_ways
