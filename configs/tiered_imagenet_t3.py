"""tieredImageNet, T=3 tasks of 5-way 5-shot (DESIGN.md 1.1-1.5)."""

from configs import tiered_imagenet_base


def get_config(variant=None):
  return tiered_imagenet_base.get_config(num_tasks=3, variant=variant)
