"""The network of the fine-tuning and EWC baselines, pretrained on the training classes.

`models.cnn.CNN` with a head over all C training classes, trained with
cross-entropy on random batches of the training split (sampled on the device
from the uint8 class images, as training does for CHT). For the task sequence
its conv blocks (and BatchNorm scales and offsets) are kept and the head is
replaced by a fresh K*T one (`fresh_head`).
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from cht_jax import losses
from cht_jax.data import episodes as episodes_lib
from cht_jax.models import cnn as cnn_lib
from cht_jax.models import ops

HEAD_INITS = ('zeros', 'glorot')


def build_cnn(config: ml_collections.ConfigDict, num_outputs: int) -> cnn_lib.CNN:
  """The config's CNN (channels, blocks, conv implementation) with `num_outputs` logits.

  MAML++ differentiates through its inner loop (second order), which the fused
  CPU kernel cannot: 'auto' gives 'patches' there.
  """
  model = config.model
  conv_impl = ops.resolve_conv_impl(model.conv_impl, second_order=config.method == 'maml')
  return cnn_lib.CNN(channels=(model.channels,) * model.num_blocks,
                     embedding_dim=num_outputs, conv_impl=conv_impl,
                     compute_dtype=model.compute_dtype)


def init_theta(cnn: cnn_lib.CNN, key: jax.Array, image_shape: tuple[int, int, int]) -> Any:
  """Glorot kernels, BatchNorm scale 1 and offset 0, zero head bias, for images of
  `image_shape` (H, W, channels)."""
  return cnn.init(key, jnp.zeros((1, *image_shape)))['params']


def sample_batch(key: jax.Array, class_images: jax.Array, batch_size: int, rotate: bool):
  """B random (class, image) pairs of the split, with replacement.

  Args:
    class_images: uint8 [C, M, H, W, D].
    rotate: rotate each image by a random multiple of 90 degrees (keeping its
      label), the augmentation CHT's episodes use.

  Returns:
    (images float32 [B, H, W, D] scaled x/128 - 1, labels int32 [B] in 0..C-1).
  """
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
  """theta with its head replaced by a new one of `num_outputs` logits.

  Args:
    init: 'zeros' (kernel and bias 0: every class starts equally likely) or
      'glorot' (Glorot-uniform kernel from `key`, zero bias).
  """
  in_dim = theta['head']['kernel'].shape[0]
  dtype = theta['head']['kernel'].dtype
  if init == 'zeros':
    kernel = jnp.zeros((in_dim, num_outputs), dtype)
  elif init == 'glorot':
    kernel = nn.initializers.glorot_uniform()(key, (in_dim, num_outputs), dtype)
  else:
    raise ValueError(f'Unknown head init {init!r}; expected one of {HEAD_INITS}.')
  return {**theta, 'head': {'kernel': kernel, 'bias': jnp.zeros((num_outputs,), dtype)}}
