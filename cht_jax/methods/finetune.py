"""Pretraining + fine-tuning: the Table 1 baseline that fine-tunes a pretrained CNN.

Training pretrains the CNN with a head over all C training classes. Evaluation
replaces the head by a fresh K*T one (`fresh_head`) and fine-tunes task after
task: baseline.inner_steps SGD steps on each S(t) (`finetune_rule`).
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from cht_jax import config_validation
from cht_jax import losses
from cht_jax.data import datasets
from cht_jax.data import episodes as episodes_lib
from cht_jax.methods import base
from cht_jax.methods import sequential
from cht_jax.models import cnn as cnn_lib
from cht_jax.models import ops

HEAD_INITS = ('zeros', 'glorot')


def build_cnn(config: ml_collections.ConfigDict, num_outputs: int) -> cnn_lib.CNN:
  """The config's CNN with `num_outputs` logits ('patches' for MAML++'s second order)."""
  model = config.model
  conv_impl = ops.resolve_conv_impl(model.conv_impl, second_order=config.method == 'maml')
  return cnn_lib.CNN(channels=(model.channels,) * model.num_blocks,
                     embedding_dim=num_outputs, conv_impl=conv_impl,
                     compute_dtype=model.compute_dtype)


def init_theta(cnn: cnn_lib.CNN, key: jax.Array, image_shape: tuple[int, int, int]) -> Any:
  """Initial params for [H, W, C] images: Glorot kernels, BatchNorm 1 and 0, zero bias."""
  return cnn.init(key, jnp.zeros((1, *image_shape)))['params']


def sample_batch(key: jax.Array, class_images: jax.Array, batch_size: int, rotate: bool):
  """B random (class, image) pairs of uint8 `class_images` [C, M, H, W, D], with replacement,
  rotated by random multiples of 90 degrees if `rotate`: (normalised images, labels int32 [B])."""
  num_classes, num_images = class_images.shape[:2]
  class_key, image_key, rotate_key = jax.random.split(key, 3)
  labels = jax.random.randint(class_key, (batch_size,), 0, num_classes)
  images = jnp.asarray(class_images)[labels, jax.random.randint(
      image_key, (batch_size,), 0, num_images)]
  if rotate:
    images = episodes_lib.rotate90(images[:, None],
                                   jax.random.randint(rotate_key, (batch_size,), 0, 4))[:, 0]
  return episodes_lib.normalize(images), labels.astype(jnp.int32)


def batch_loss(cnn: cnn_lib.CNN, theta: Any, images: jax.Array, labels: jax.Array):
  """(mean cross-entropy over all C classes, accuracy) of one batch."""
  return losses.cross_entropy_and_accuracy(cnn.apply({'params': theta}, images), labels)


def fresh_head(theta: Any, num_outputs: int, init: str = 'zeros',
               key: jax.Array | None = None) -> Any:
  """theta with a fresh head of `num_outputs` logits: zero bias, kernel `init`
  'zeros' or 'glorot' (from `key`)."""
  in_dim = theta['head']['kernel'].shape[0]
  dtype = theta['head']['kernel'].dtype
  if init == 'zeros':
    kernel = jnp.zeros((in_dim, num_outputs), dtype)
  elif init == 'glorot':
    kernel = nn.initializers.glorot_uniform()(key, (in_dim, num_outputs), dtype)
  else:
    raise ValueError(f'Unknown head init {init!r}; expected one of {HEAD_INITS}.')
  return {**theta, 'head': {'kernel': kernel, 'bias': jnp.zeros((num_outputs,), dtype)}}


def finetune_rule(cnn: cnn_lib.CNN, ways: int, num_steps: int,
                  learning_rate: float) -> sequential.UpdateFn:
  """Plain fine-tuning: k SGD steps on S(t); no state."""
  def update(theta, state, images, labels, t):
    loss = lambda th: sequential.support_loss(cnn, th, images, labels, t, ways)
    theta, _ = sequential.sgd_steps(loss, theta, learning_rate, num_steps)
    return theta, state, theta
  return update


@dataclasses.dataclass(frozen=True)
class Finetune(base.SequentialMethod):
  """Pretraining on the training classes, then fine-tuning on each task."""
  num_train_classes: int = 0  # C, the pretraining head's width.
  name = 'finetune'
  display_name = 'Pretraining + fine-tuning'
  batch_size = 1  # One batch of images: split over devices, BatchNorm would see less.

  @classmethod
  def from_config(cls, config, num_train_classes=None) -> 'Finetune':
    """`num_train_classes`: C of the training split; None reads it from the config."""
    if num_train_classes is None:
      num_train_classes = config_validation.nominal_split_classes(config)['train'][0]
    return cls(config, num_train_classes=num_train_classes)

  def pretraining_cnn(self):
    return build_cnn(self.config, self.num_train_classes)

  def init(self, key) -> Any:
    return init_theta(self.pretraining_cnn(), key, datasets.image_shape(self.config))

  def grads(self, params, data, key, **unused):
    """The cross-entropy over all C classes of one random batch of training images."""
    del unused
    cnn, b = self.pretraining_cnn(), self.config.baseline

    def loss_fn(params):
      images, labels = sample_batch(key, data, b.pretrain_batch_size, self.config.data.rotate)
      loss, accuracy = batch_loss(cnn, params, images, labels)
      return loss, {'loss': loss, 'accuracy': accuracy}

    return jax.grad(loss_fn, has_aux=True)(params)

  def trained_tasks(self, num_eval_tasks: int) -> int:
    return num_eval_tasks  # Pretraining never sees a task sequence: nothing extrapolates.

  def update_rule(self, cnn, num_tasks: int, theta):
    """(rule, its initial state) for `sequential.run_sequence`."""
    del num_tasks, theta
    b = self.config.baseline
    return finetune_rule(cnn, self.config.episode.ways, b.inner_steps,
                         b.inner_learning_rate), ()

  def sequence_learner(self, params, num_tasks: int):
    """(cnn with a K*num_tasks head, learn(support_images [T, S, ...], support_labels
    [T, S]) -> theta_0..theta_{T-1}, leaves [T, ...]) of the pretrained `params`."""
    num_outputs = self.config.episode.ways * num_tasks
    cnn = build_cnn(self.config, num_outputs)
    theta = fresh_head(params, num_outputs, self.config.baseline.head_init,
                       jax.random.fold_in(jax.random.key(self.config.seed), 1))
    rule, state = self.update_rule(cnn, num_tasks, theta)
    return cnn, lambda images, labels: sequential.run_sequence(rule, theta, state, images,
                                                               labels)
