"""Shared settings of the tieredImageNet experiments (paper, "Experiments").

Not a config file itself. `omniglot_base` changed where the paper (and HT's
tieredImageNet settings) differs; episodes come from the host pipeline. Variant
`tiny`: for tests on a generated dataset.
"""

from configs import omniglot_base
from configs import variants

VARIANTS = ('', 'tiny')


def get_config(num_tasks: int, learning_rate: float = 5e-6, variant: str | None = None):
  """Builds the config of the tieredImageNet T=`num_tasks` experiment."""
  variant = variants.check(variant, VARIANTS)
  config = omniglot_base.get_config(num_tasks, learning_rate)
  data = config.data
  data.dataset = 'tiered_imagenet'
  data.pipeline = 'host'
  data.manual_dir = ''  # The download ('' = <data_dir>/downloads/manual/tiered_imagenet).
  data.image_size = 84
  data.rotate = False
  data.images_per_class = 60  # Per validation / test class, kept in memory.
  data.binarize = False  # Omniglot's only.
  data.check_class_counts = True  # Insist on 351 / 97 / 160 classes.
  data.augment.flip = True
  data.augment.hue = 0.05  # Up to 18 degrees of hue rotation.
  data.augment.brightness = 0.1
  data.augment.contrast = 0.2
  data.augment.crop_min_scale = 0.8

  config.episode.ways = 5
  config.episode.shots = 5
  config.episode.queries_per_class = 20

  model = config.model
  model.channels = 64
  model.cnn_embedding_dim = 40
  model.image_features = 16
  model.num_layers = 1
  model.num_heads = 8
  model.value_fraction = 0.5
  model.inner_fraction = 0.5
  model.activation = 'leaky_relu'

  config.train.eval_episodes = 16
  if variant == 'tiny':
    variants.tiny(config, channels=4, num_steps=3, log_every_steps=1, checkpoint_every_steps=3)
    data.check_class_counts = False
    data.images_per_class = 4
    config.episode.ways = 2
    config.episode.shots = 1
    config.episode.queries_per_class = 2
  return config
