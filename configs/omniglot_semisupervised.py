"""Semi-supervised CHT on Omniglot: M unlabeled images per class in every support set.

  --config=configs/omniglot_semisupervised.py:M,T[,variant]   e.g. :2,1 or :4,2,smoke

Beyond the paper: HT's semi-supervised few-shot learning (Zhmoginov et al.,
ICML 2022) carried over to continual learning. M = 0 is `omniglot_t{T}.py`;
Omniglot allows M <= 20 - 1 - 3 = 16. The sweep: docs/semisupervised.md.
"""

from configs import omniglot_base


def get_config(arg=None):
  unlabeled, num_tasks, variant = omniglot_base.parse_arguments(
      arg, ('unlabeled_per_class', 'num_tasks'), (2, 1))
  config = omniglot_base.get_config(
      num_tasks=num_tasks, learning_rate=omniglot_base.paper_learning_rate(num_tasks),
      variant=variant)
  config.episode.unlabeled_per_class = unlabeled
  return config
