"""Multi-domain, T=2 tasks of 5-way 1-shot, each from its own domain (paper 5.3).

The paper's six TFDS datasets (data/multidomain.py). Not stated in the paper,
so chosen here: 84x84 RGB, the tieredImageNet transformer, 10 queries per class,
no augmentation. Variant `tiny`: for tests under tfds.testing.mock_data.
"""

from configs import tiered_imagenet_base
from configs import variants
from cht_jax.data import multidomain

VARIANTS = ('', 'tiny')


def get_config(variant=None):
  variant = variants.check(variant, VARIANTS)
  config = tiered_imagenet_base.get_config(num_tasks=2)
  data = config.data
  data.dataset = 'multidomain'
  data.pipeline = 'device'
  data.domains = multidomain.DOMAINS
  data.domain_split = (0.7, 0.15, 0.15)
  data.images_per_class = 20
  data.check_class_counts = True
  data.augment.flip = False
  data.augment.hue = data.augment.brightness = data.augment.contrast = 0.0
  data.augment.crop_min_scale = 1.0
  config.episode.ways = 5
  config.episode.shots = 1
  config.episode.queries_per_class = 10
  config.episode.task_classes = 'domain'
  config.model.channels = 16
  config.model.cnn_embedding_dim = 32
  if variant == 'tiny':
    variants.tiny(config, channels=4, num_steps=2, log_every_steps=1, checkpoint_every_steps=2)
    data.images_per_class = 4
    data.domain_split = (0.5, 0.25, 0.25)
    config.episode.ways = 2
    config.episode.queries_per_class = 2
  return config
