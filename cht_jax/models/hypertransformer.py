"""Layer-by-layer weight generation: support set (+ theta_{t-1}) in, CNN weights out.

The paper's section 4 ("Continual HyperTransformer", eq. 1, Figure 2) with
the HT setup of its "Experiments". Each generated layer has its own activation
feature extractor, label and weight embeddings and transformer; only the image
feature extractor is shared. Layer l reads the support activations that come
out of the layers generated before it; once its weights exist the support
batch is pushed through it to feed layer l+1.

Tokens of layer l (width E = max(emb + block, emb + features)):
  weight token i:  [weight_embedding(i) | slice i of theta_{t-1} | 0 ...]
  support token:   [label_embedding(y) | activation features | image features | 0 ...]
Weight tokens first, then support tokens. The output at weight token i, from
position `embedding_dim` on, is slice i of the new layer ("per output channel"
allocation: one token per output channel of a conv, per output unit of the
dense head).

With theta_{t-1} = 0 the weight tokens are those of the original HT, so one
module serves HT (T = 1) and CHT. Putting the slice of theta_{t-1} where HT puts
zeros is our reading of the paper (the CHT code is unpublished).

Unlabeled support images (HT's semi-supervised setting) add one sample token
each after the labelled ones, built the same way but with the (K+1)-th label
embedding, the one for "unlabeled". They go through the generated layers as a
BatchNorm batch of their own, as every query set does, so the labelled
support activations, embeddings and prototypes are computed exactly as
without them: the unlabeled images reach theta_t only through the
transformer's attention.
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
# Small: the image features' spread over an Omniglot support set starts near 1e-3.
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
  """Generates the weights of `cnn_lib.CNN` for one task.

  Its fields are the model's settings; `models.build_hypertransformer` sets
  them from the config's fields of the same names, and each layer's
  transformer takes those that are `transformer.Encoder`'s. The values,
  the paper's among them, are written once, in the config
  (configs/omniglot_base.py): the fields the config sets have no default.

  Attributes:
    num_ways: K, classes per task (K + 1 label embeddings, the last unlabeled).
    channels, cnn_embedding_dim, kernel_size, conv_impl: the generated CNN.
    compute_dtype: 'float32' (the paper), or 'bfloat16': every convolution (the
      generated CNN's and the feature extractors') with bfloat16 operands and
      float32 accumulation (`ops.conv2d`); the transformers stay float32.
    embedding_dim: width of label and weight embeddings (32 in the paper).
    image_features: width of the shared image feature extractor.
    activation_features: filters of each per-layer activation extractor
      (None: the CNN's width, as in HT).
    num_layers, num_heads, *_fraction, activation, encoder_impl: each layer's
      transformer (`transformer.Encoder`).
    generate_bn: generate BatchNorm scale/offset (2 numbers more per conv
      token) instead of training them as shared parameters.
    head_scale: 0 (the paper): the head as the transformer writes it. > 0 (a
      departure, the ':fast' recipe): the generated head kernel and bias times
      a learned scalar `head_output_scale` that starts at this value. The
      transformer's outputs are LayerNorm-scaled, O(1) each, so the paper's
      first embeddings are O(sqrt(channels)) per dimension and the first
      squared distances O(100): the loss starts in the hundreds.
    learned_base: 0 (the paper): each layer is what the transformer writes.
      > 0 (a departure, to let the transformer spend itself on what differs
      between tasks): each generated layer is a learned, task-independent
      base (initialised as `cnn_lib.CNN` initialises its own params) plus
      the transformer's output times a learned per-layer scalar
      `{layer}_generated_scale` that starts at this value; `head_scale`
      then scales the whole head.
    feature_norm: False (the paper). True (a departure): each layer's sample
      features (activation and image features) are normalised over the
      support set, feature by feature, before they enter the tokens. At
      initialisation the image and activation features vary across Omniglot
      samples orders of magnitude less than the label embeddings, which are
      the same in every task: the tokens, and so the generated weights,
      hardly depend on the images (docs/results.md, section 8; on in the
      ':fast' recipe). Unlabeled samples are normalised together with the
      labelled ones, so with this option they also change the labelled
      samples' tokens.
    trained_layers: 0 (the paper): the transformers write every layer. N > 0
      (the original HT's `number_of_trained_cnn_layers`): the first N of the
      CNN's layers (its conv blocks, then its head) are ordinary trained
      parameters, the same for every task, and only the others are written;
      N < 0: the last |N|. A trained layer has no transformer or activation
      feature extractor, and theta_{t-1} does not reach it.
  """
  num_ways: int
  # Set by the config (configs/omniglot_base.py), their one place: no defaults here.
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
  # Not in the config (kernel_size), or the plain form where the config asks for
  # 'auto' (conv_impl, encoder_impl) or a width of its own (activation_features).
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
    """[S, F] -> [S, F], each feature with mean 0 and variance 1 over the S samples, then
    a learned scale and offset (a batch-statistics BatchNorm over the support set)."""
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
    """Generates theta_t from S(t) and theta_{t-1}.

    Args:
      support_images: [S, H, W, C] float32.
      support_labels: [S] int32 in 0..num_ways-1.
      theta_prev: theta_{t-1}, the CNN's params pytree (zeros for t = 0).
      with_support_embeddings: also return the support images' embeddings
        under theta_t, `self.cnn.apply({'params': theta_t}, support_images)`:
        generating theta_t has pushed them through every block already.
      unlabeled_images: [U, H, W, C] float32 support images without labels,
        or None (or U = 0) for none: the computation is then exactly that
        of a fully labelled support set.

    Returns:
      theta_t, with the structure of `self.cnn`'s params; with
      `with_support_embeddings`, (theta_t, [S, cnn_embedding_dim]) (the
      labelled images only).
    """
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

