"""The mini-batch experiment (paper section 5.1) on tieredImageNet 5-way, as in the paper.

  --config=configs/tiered_imagenet_minibatch.py:ARM[,tiny]   e.g. :one_at_a_time

The arms of `configs/omniglot_minibatch.py` on `configs/tiered_imagenet_base.py`.
The paper's numbers: 67.9 / 68.0 / 68.3 %, HT 56.2 / 62.9 %.
"""

from configs import omniglot_minibatch
from configs import tiered_imagenet_base


def get_config(arg=None):
  arm, variant, num_tasks = omniglot_minibatch.parse_arm(arg)
  config = tiered_imagenet_base.get_config(num_tasks=num_tasks, variant=variant)
  if variant != 'tiny':
    config.data.images_per_class = 100  # One at a time: 4 * (1 + 20) = 84 per class.
  else:
    config.episode.queries_per_class = 1  # 4 tasks * (1 shot + 1 query) = 8 images.
    config.data.images_per_class = 8
  return omniglot_minibatch.apply_arm(config, arm)
