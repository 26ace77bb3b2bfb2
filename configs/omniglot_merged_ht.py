"""Merged HT baseline on Omniglot (paper section 5.2, the stars of Figure 4).

  --config=configs/omniglot_merged_ht.py:T[,variant]   e.g. :3 or :2,smoke

One HT trained on each episode's T tasks merged into one 20*T-way task; only the
class-incremental accuracy of theta_{T-1} is the baseline (one run per T).
"""

from configs import omniglot_base


def get_config(arg=None):
  num_tasks, variant = omniglot_base.parse_arguments(arg, ('num_tasks',), (2,))
  config = omniglot_base.get_config(
      num_tasks=num_tasks, learning_rate=omniglot_base.paper_learning_rate(num_tasks),
      variant=variant)
  config.method = 'merged_ht'
  return config
