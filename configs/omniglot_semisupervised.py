"""Semi-supervised CHT on Omniglot: M unlabeled images per class in every support set.

  --config=configs/omniglot_semisupervised.py:M,T[,variant]   e.g. :2,1 or :4,2,smoke

Beyond the paper: the semi-supervised few-shot learning of HT (Zhmoginov et
al., ICML 2022) carried over to continual learning: each task's 20-way
1-shot support set gets M more images of each of its classes without their
labels, which enter the HyperTransformer with the (K+1)-th, "unlabeled",
label embedding and never the prototypes or the loss
(cht_jax/models/hypertransformer.py). T=1 is plain semi-supervised HT. The
rest is omniglot_base's, with the same training budget for every M (steps and
episodes per step depend on T and the variant only). M = 0 is the supervised
model of `omniglot_t{T}.py`; Omniglot's 20 images per class allow
M <= 20 - 1 - 3 = 16 with 1 shot and 3 queries.

The sweep of docs/semisupervised.md: M in 0, 2, 4 at T = 1 and 2, `smoke`.
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
