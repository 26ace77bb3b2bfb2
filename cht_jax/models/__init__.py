"""Models: the generated CNN, its weight generator and their parts."""

import ml_collections

from cht_jax.models.hypertransformer import HyperTransformer


def build_hypertransformer(config: ml_collections.ConfigDict) -> HyperTransformer:
  """The weight generator (and, through `.cnn`, the CNN it fills) of a config."""
  model = config.model
  return HyperTransformer(
      num_ways=config.episode.ways,
      channels=(model.channels,) * model.num_blocks,
      cnn_embedding_dim=model.cnn_embedding_dim,
      conv_impl=model.conv_impl,
      embedding_dim=model.embedding_dim,
      image_features=model.image_features,
      activation_features=model.activation_features,
      num_layers=model.num_layers,
      num_heads=model.num_heads,
      query_key_fraction=model.query_key_fraction,
      value_fraction=model.value_fraction,
      inner_fraction=model.inner_fraction,
      activation=model.activation,
      encoder_impl=model.encoder_impl,
      generate_bn=model.generate_bn,
  )
