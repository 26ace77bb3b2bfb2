"""Models: the generated CNN, its weight generator and their parts."""

import dataclasses

import ml_collections

from cht_jax.models.hypertransformer import HyperTransformer

# Values (all off) of fields that an older saved config.json lacks; configs/ sets every field.
SAVED_BEFORE_THE_FIELD = {'head_scale': 0.0, 'learned_base': 0.0, 'feature_norm': False,
                          'trained_layers': 0, 'compute_dtype': 'float32'}


def build_hypertransformer(config: ml_collections.ConfigDict) -> HyperTransformer:
  """The weight generator (and, through `.cnn`, the CNN it fills) of a config: the
  `config.model` fields it has, `channels` repeated `num_blocks` times."""
  model = config.model
  fields = {field.name for field in dataclasses.fields(HyperTransformer)}
  settings = dict(SAVED_BEFORE_THE_FIELD)
  settings.update((name, value) for name, value in model.items() if name in fields)
  settings['channels'] = (model.channels,) * model.num_blocks
  return HyperTransformer(num_ways=config.episode.ways, **settings)
