"""HT with the cross-entropy loss over T tasks on Omniglot (paper appendix A.1).

  --config=configs/omniglot_ht_ce.py:T[,variant]   e.g. :5 or :2,smoke

CHT trained with HT's own loss: the final layer is K class logits, so tasks
collide on the same labels. Task-incremental accuracy comes from those logits,
class-incremental from prototypes of them.
"""

from configs import omniglot_base


def get_config(arg=None):
  num_tasks, variant = omniglot_base.parse_arguments(arg, ('num_tasks',), (5,))
  config = omniglot_base.get_config(
      num_tasks=num_tasks, learning_rate=omniglot_base.paper_learning_rate(num_tasks),
      variant=variant)
  config.loss = 'cross_entropy'
  config.model.cnn_embedding_dim = config.episode.get_ref('ways')
  return config
