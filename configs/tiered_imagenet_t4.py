"""tieredImageNet, T=4 tasks of 5-way 5-shot (paper, "Experiments")."""

from configs import tiered_imagenet_base


def get_config(variant=None):
  return tiered_imagenet_base.get_config(num_tasks=4, variant=variant)
