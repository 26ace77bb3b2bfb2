"""Omniglot, T=1 tasks of 20-way 1-shot (paper, Table 1 / Figure 3)."""

from configs import omniglot_base


def get_config(variant=None):
  return omniglot_base.get_config(num_tasks=1, learning_rate=1e-4, variant=variant)
