"""Omniglot CHT with C channels and T tasks (paper, appendix figures for 4, 6, 16, 32 channels).

  --config=configs/omniglot_channels.py:C,T[,variant]   e.g. :16,5 or :4,2,smoke

The rest is omniglot_base's, with the paper's learning rate for T.
"""

from configs import omniglot_base


def get_config(arg=None):
  channels, num_tasks, variant = omniglot_base.parse_arguments(
      arg, ('channels', 'num_tasks'), (8, 5))
  config = omniglot_base.get_config(
      num_tasks=num_tasks, learning_rate=omniglot_base.paper_learning_rate(num_tasks),
      variant=variant)
  config.model.channels = channels  # activation_features follows (a reference).
  return config
