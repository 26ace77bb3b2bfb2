"""Layer-by-layer weight generation: support set (+ theta_{t-1}) in, CNN weights out.

The paper's section 4 ("Continual HyperTransformer", eq. 1, Figure 2) with the
HT setup of its "Experiments". Each generated layer has its own activation
feature extractor, label and weight embeddings and transformer; the image
feature extractor is shared.

Tokens of layer l (width E = max(emb + block, emb + features)), weight tokens first:
  weight token i:  [weight_embedding(i) | slice i of theta_{t-1} | 0 ...]
  support token:   [label_embedding(y) | activation features | image features | 0 ...]
The output at weight token i, from position `embedding_dim` on, is slice i of
the new layer (one token per output channel or unit). With theta_{t-1} = 0 the
tokens are the original HT's; putting theta_{t-1} there is our reading of the
paper (the CHT code is unpublished). Unlabeled support images (semi-supervised
HT) add tokens with the (K+1)-th label embedding; they are a BatchNorm batch of
their own, so they reach theta_t only through attention.
"""

import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from cht_jax.models import cnn as cnn_lib
from cht_jax.models import features as features_lib
from cht_jax.models import transformer as transformer_lib

Theta = Any  # The `params` pytree of `cnn_lib.CNN`.
# Small: at initialisation the image features barely vary over a support set.
FEATURE_NORM_EPSILON = 1e-8
_glorot = nn.initializers.glorot_uniform()  # As `cnn_lib.CNN` initialises its kernels.


def block_to_slices(block: dict, generate_bn: bool) -> jax.Array:
  """Conv block params -> [C_out, k*k*C_in (+2)] rows read in (kh, kw, c_in) order."""
  kernel = block['kernel']
  rows = kernel.reshape(-1, kernel.shape[-1]).T
  if generate_bn:
    rows = jnp.concatenate([rows, block['scale'][:, None], block['bias'][:, None]], axis=1)
  return rows


def slices_to_block(rows: jax.Array, kernel_shape: Sequence[int], generate_bn: bool) -> dict:
  """Inverse of `block_to_slices` for the generated leaves of a conv block."""
  kh, kw, c_in, c_out = kernel_shape
  size = kh * kw * c_in
  block = {'kernel': rows[:, :size].T.reshape(kh, kw, c_in, c_out)}
  if generate_bn:
    block['scale'] = rows[:, size]
    block['bias'] = rows[:, size + 1]
  return block


def head_to_slices(head: dict) -> jax.Array:
  """Dense head -> [D_out, D_in + 1] rows: a kernel column, then its bias."""
  return jnp.concatenate([head['kernel'].T, head['bias'][:, None]], axis=1)


def slices_to_head(rows: jax.Array) -> dict:
  return {'kernel': rows[:, :-1].T, 'bias': rows[:, -1]}


class HyperTransformer(nn.Module):
  """Generates the weights of `cnn_lib.CNN` for one task; fields as the config's
  (configs/omniglot_base.py), each layer's transformer taking `transformer.Encoder`'s.

  Attributes:
    num_ways: K, classes per task (K + 1 label embeddings, the last unlabeled).
    activation_features: filters of each activation extractor (None: the CNN's width).
    generate_bn: generate BatchNorm scale/offset rather than train them shared.
    head_scale: > 0: the generated head times a learned `head_output_scale`.
    learned_base: > 0: each generated layer is a learned base (initialised as
      `CNN`'s) plus the transformer's output times a learned
      `{layer}_generated_scale`; `head_scale` then scales the whole head.
    feature_norm: normalise sample features over the support set (unlabeled too).
    trained_layers: N > 0 (HT's `number_of_trained_cnn_layers`): the first N
      CNN layers (blocks, then head) are trained, shared by every task; N < 0:
      the last |N|. theta_{t-1} does not reach them.
  """
  num_ways: int
  # Set by the config, their one place: no defaults here.
  channels: Sequence[int]
  cnn_embedding_dim: int
  embedding_dim: int
  image_features: int
  num_layers: int
  num_heads: int
  query_key_fraction: float
  value_fraction: float
  inner_fraction: float
  activation: str
  generate_bn: bool
  head_scale: float
  learned_base: float
  feature_norm: bool
  trained_layers: int
  compute_dtype: str
  # Not in the config (kernel_size), or defaults for direct construction.
  kernel_size: int = 3
  conv_impl: str = 'patches'
  activation_features: int | None = None
  encoder_impl: str = 'xla'

  @property
  def cnn(self) -> cnn_lib.CNN:
    return cnn_lib.CNN(channels=tuple(self.channels),
                       embedding_dim=self.cnn_embedding_dim,
                       conv_impl=self.conv_impl, kernel_size=self.kernel_size,
                       compute_dtype=self.compute_dtype)

  def _is_trained(self, index: int) -> bool:
    """Whether layer `index` (0..num_blocks; the head last) is trained, not written."""
    if self.trained_layers >= 0:
      return index < self.trained_layers
    return index >= len(self.channels) + 1 + self.trained_layers

  def _generate_layer(self, name: str, activations, image_features, labels,
                      prev_slices, num_extractor_convs: int):
    """Runs layer `name`'s transformer; returns its [tokens, block] slices."""
    num_tokens, block_size = prev_slices.shape
    act_features = features_lib.ActivationFeatureExtractor(
        features=self.activation_features or max(self.channels),
        num_layers=num_extractor_convs, kernel_size=self.kernel_size,
        conv_impl=self.conv_impl, compute_dtype=self.compute_dtype,
        name=f'{name}_activation_features')(activations)
    sample_features = jnp.concatenate([act_features, image_features], axis=-1)
    if self.feature_norm:
      sample_features = self._normalize_over_samples(name, sample_features)
    emb = self.embedding_dim
    width = max(emb + block_size, emb + sample_features.shape[-1])

    label_embedding = self.param(f'{name}_label_embedding', nn.initializers.normal(1.0),
                                 (self.num_ways + 1, emb))
    weight_embedding = self.param(f'{name}_weight_embedding', nn.initializers.normal(1.0),
                                  (num_tokens, emb))
    pad = lambda x: jnp.pad(x, ((0, 0), (0, width - x.shape[-1])))
    weight_tokens = pad(jnp.concatenate([weight_embedding, prev_slices], axis=-1))
    support_tokens = pad(jnp.concatenate([label_embedding[labels], sample_features], axis=-1))
    tokens = jnp.concatenate([weight_tokens, support_tokens], axis=0)
    outputs = transformer_lib.Encoder(**transformer_lib.encoder_settings(self),
                                      name=f'{name}_transformer')(tokens)
    return outputs[:num_tokens, emb:emb + block_size]

  def _normalize_over_samples(self, name: str, features: jax.Array) -> jax.Array:
    """[S, F] -> [S, F]: a batch-statistics BatchNorm over the S samples."""
    scale = self.param(f'{name}_feature_norm_scale', nn.initializers.ones, features.shape[-1:])
    bias = self.param(f'{name}_feature_norm_bias', nn.initializers.zeros, features.shape[-1:])
    return cnn_lib.batch_stat_norm(features, scale, bias, epsilon=FEATURE_NORM_EPSILON)

  def _add_base(self, name: str, rows: jax.Array, init_rows) -> jax.Array:
    """With `learned_base`: base + scale * rows, both learned; else rows."""
    if not self.learned_base:
      return rows
    base = self.param(f'{name}_base', init_rows)
    scale = self.param(f'{name}_generated_scale', nn.initializers.constant(self.learned_base), ())
    return base + scale * rows

  @nn.compact
  def __call__(self, support_images: jax.Array, support_labels: jax.Array,
               theta_prev: Theta, with_support_embeddings: bool = False,
               unlabeled_images: jax.Array | None = None):
    """theta_t from S(t): `support_images` [S, H, W, C] float32, `support_labels` [S] int32
    in 0..K-1, `unlabeled_images` [U, H, W, C] (None or U = 0: none), and theta_{t-1} (zeros
    for t = 0). With `with_support_embeddings`, (theta_t, the labelled support images'
    embeddings under theta_t [S, cnn_embedding_dim])."""
    if unlabeled_images is not None and not unlabeled_images.shape[0]:
      unlabeled_images = None
    unlabeled_labels = None
    if unlabeled_images is not None:  # Label K, the "unlabeled" embedding.
      unlabeled_labels = jnp.full(unlabeled_images.shape[:1], self.num_ways, jnp.int32)
    labels = _labelled_then_unlabeled(support_labels, unlabeled_labels)
    image_features = features_lib.ImageFeatureExtractor(
        features=self.image_features, kernel_size=self.kernel_size,
        conv_impl=self.conv_impl, compute_dtype=self.compute_dtype, name='image_features')(
            _labelled_then_unlabeled(support_images, unlabeled_images))
    # Activations of the labelled and the unlabeled images: two BatchNorm batches.
    theta, x, x_unlabeled = {}, support_images, unlabeled_images
    for i, c_out in enumerate(self.channels):
      name = f'block_{i}'
      kernel_shape = (self.kernel_size, self.kernel_size, x.shape[-1], c_out)
      trained = self._is_trained(i)
      if trained:
        block = {'kernel': self.param(f'{name}_kernel', _glorot, kernel_shape)}
      else:
        rows = self._generate_layer(
            name, _labelled_then_unlabeled(x, x_unlabeled), image_features, labels,
            block_to_slices(theta_prev[name], self.generate_bn), num_extractor_convs=2)
        rows = self._add_base(name, rows, lambda key, shape=kernel_shape: block_to_slices(
            {'kernel': _glorot(key, shape), 'scale': jnp.ones(shape[-1]),
             'bias': jnp.zeros(shape[-1])}, self.generate_bn))
        block = slices_to_block(rows, kernel_shape, self.generate_bn)
      if not self.generate_bn or trained:
        block['scale'] = self.param(f'{name}_scale', nn.initializers.ones, (c_out,))
        block['bias'] = self.param(f'{name}_bias', nn.initializers.zeros, (c_out,))
      theta[name] = block
      x = cnn_lib.conv_block(x, block, self.conv_impl, self.compute_dtype)
      if x_unlabeled is not None:
        x_unlabeled = cnn_lib.conv_block(x_unlabeled, block, self.conv_impl,
                                         self.compute_dtype)
    if self._is_trained(len(self.channels)):
      head_shape = (math.prod(x.shape[1:]), self.cnn_embedding_dim)
      theta['head'] = {'kernel': self.param('head_kernel', _glorot, head_shape),
                       'bias': self.param('head_bias', nn.initializers.zeros, head_shape[1:])}
    else:
      rows = self._generate_layer('head', _labelled_then_unlabeled(x, x_unlabeled),
                                  image_features, labels,
                                  head_to_slices(theta_prev['head']), num_extractor_convs=1)
      head_shape = (rows.shape[1] - 1, rows.shape[0])
      rows = self._add_base('head', rows, lambda key: head_to_slices(
          {'kernel': _glorot(key, head_shape), 'bias': jnp.zeros(head_shape[1])}))
      theta['head'] = slices_to_head(rows)
    if self.head_scale:
      scale = self.param('head_output_scale', nn.initializers.constant(self.head_scale), ())
      theta['head'] = jax.tree.map(lambda leaf: leaf * scale, theta['head'])
    if with_support_embeddings:
      return theta, cnn_lib.dense_head(x, theta['head'])
    return theta


def _labelled_then_unlabeled(labelled: jax.Array, unlabeled: jax.Array | None) -> jax.Array:
  """[S, ...] and [U, ...] -> [S + U, ...], the order of the sample tokens."""
  return labelled if unlabeled is None else jnp.concatenate([labelled, unlabeled], axis=0)


def zeros_theta(cnn: cnn_lib.CNN, image_shape: Sequence[int]) -> Theta:
  """theta_{-1}: zeros with the structure of `cnn`'s params for [H, W, C] images."""
  shapes = jax.eval_shape(cnn.init, jax.random.key(0), jnp.zeros((1, *image_shape)))
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes['params'])

