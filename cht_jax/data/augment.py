"""Training augmentations in pure JAX: flip, hue, brightness, contrast, crop.

tieredImageNet's training augmentation, traceable, run inside the jitted step
with its own random draw per image. Images are normalized [..., H, W, D] as
`episodes.normalize` makes them; the output is clipped back to [-1, 0.9921875].
On the [0, 1) scale u = (x + 1) / 2 = pixel / 256 used inside:
* flip: left-right with probability 1/2;
* hue (D = 3): the chroma (I, Q of YIQ) rotated by 2 pi * delta, delta ~ U[-hue, hue];
* brightness: u + delta, delta ~ U[-brightness, brightness];
* contrast: (u - mean) * f + mean, f ~ U[1 - contrast, 1 + contrast], the mean
  per image and channel (as tf.image.adjust_contrast);
* crop: a box of side fractions s ~ U[crop_min_scale, 1] at a uniform position,
  resized back to H x W (bilinear).
A strength of 0 (crop_min_scale 1, flip False) leaves the images unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_MAX_U = 255.0 / 256.0  # Largest value of the [0, 1) scale: pixel 255.
# RGB <-> YIQ (NTSC). NumPy: a jnp constant at import would start the JAX backend.
_RGB_TO_YIQ = np.array([[0.299, 0.587, 0.114],
                        [0.595716, -0.274453, -0.321263],
                        [0.211456, -0.522591, 0.311135]])
_YIQ_TO_RGB = np.linalg.inv(_RGB_TO_YIQ)


class AugmentSpec(NamedTuple):
  """Strengths of the augmentations (all off by default), as in the module docstring: `hue` a
  fraction of a full turn, `brightness` on the [0, 1) scale, `crop_min_scale` 1: no crop."""
  flip: bool = False
  hue: float = 0.0
  brightness: float = 0.0
  contrast: float = 0.0
  crop_min_scale: float = 1.0

  @property
  def is_identity(self) -> bool:
    return (not self.flip and self.hue == 0 and self.brightness == 0 and
            self.contrast == 0 and self.crop_min_scale >= 1)


def _hue(u: jax.Array, delta: jax.Array) -> jax.Array:
  """Rotates the chroma of u [H, W, 3] by 2 pi * delta."""
  angle = 2 * jnp.pi * delta
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  rotation = jnp.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
  rotation = rotation.at[1, 1].set(cos).at[1, 2].set(-sin)
  rotation = rotation.at[2, 1].set(sin).at[2, 2].set(cos)
  matrix = jnp.asarray(_YIQ_TO_RGB, jnp.float32) @ rotation @ jnp.asarray(_RGB_TO_YIQ, jnp.float32)
  return u @ matrix.T


def _crop(u: jax.Array, scale: jax.Array, where: jax.Array) -> jax.Array:
  """Crops u [H, W, D] to a box of side fraction `scale` at `where` [2], resized back."""
  height, width, _ = u.shape
  size = jnp.array([height, width], jnp.float32)
  offset = where * (1.0 - scale) * size  # Top-left corner, in pixels.
  return jax.image.scale_and_translate(
      u, u.shape, (0, 1), jnp.full((2,), 1.0 / scale), -offset / scale,
      method='linear', antialias=False)


def _augment_one(key: jax.Array, u: jax.Array, spec: AugmentSpec) -> jax.Array:
  """One image u [H, W, D] on the [0, 1) scale."""
  keys = jax.random.split(key, 6)
  if spec.crop_min_scale < 1:
    scale = jax.random.uniform(keys[0], (), minval=spec.crop_min_scale, maxval=1.0)
    u = _crop(u, scale, jax.random.uniform(keys[1], (2,)))
  if spec.flip:
    u = jnp.where(jax.random.bernoulli(keys[2]), u[:, ::-1], u)
  if spec.hue > 0 and u.shape[-1] == 3:
    u = _hue(u, jax.random.uniform(keys[3], (), minval=-spec.hue, maxval=spec.hue))
  if spec.brightness > 0:
    u = u + jax.random.uniform(keys[4], (), minval=-spec.brightness, maxval=spec.brightness)
  if spec.contrast > 0:
    factor = jax.random.uniform(keys[5], (), minval=1 - spec.contrast, maxval=1 + spec.contrast)
    mean = jnp.mean(u, axis=(0, 1), keepdims=True)
    u = (u - mean) * factor + mean
  return jnp.clip(u, 0.0, _MAX_U)


def augment(key: jax.Array, images: jax.Array, spec: AugmentSpec) -> jax.Array:
  """Every image of normalized images [..., H, W, D] augmented independently: float32
  [..., H, W, D], or `images` itself when `spec.is_identity`."""
  if spec.is_identity:
    return images
  shape = images.shape
  flat = images.reshape(-1, *shape[-3:]).astype(jnp.float32)
  keys = jax.random.split(key, flat.shape[0])
  out = jax.vmap(lambda k, x: _augment_one(k, (x + 1.0) / 2.0, spec))(keys, flat)
  return (out * 2.0 - 1.0).reshape(shape)


def augment_episodes(key: jax.Array, episodes: dict[str, jax.Array],
                     spec: AugmentSpec) -> dict[str, jax.Array]:
  """Augments the support, query (and unlabeled) images of an episode (batch) dict."""
  if spec.is_identity:
    return episodes
  support_key, query_key = jax.random.split(key)
  out = dict(episodes)
  out['support_images'] = augment(support_key, episodes['support_images'], spec)
  out['query_images'] = augment(query_key, episodes['query_images'], spec)
  if 'unlabeled_images' in episodes:  # A key of their own: without them, the same numbers.
    out['unlabeled_images'] = augment(jax.random.fold_in(key, 2), episodes['unlabeled_images'],
                                      spec)
  return out
