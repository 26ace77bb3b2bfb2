"""CHT trained with the task-incremental objective (eq. 5) on Omniglot (paper appendix A.2).

  --config=configs/omniglot_task_incremental.py:T[,variant]   e.g. :5 or :2,smoke

Compare with configs/omniglot_t{T}.py (class-incremental objective, eq. 6).
"""

from configs import omniglot_base


def get_config(arg=None):
  num_tasks, variant = omniglot_base.parse_arguments(arg, ('num_tasks',), (5,))
  config = omniglot_base.get_config(
      num_tasks=num_tasks, learning_rate=omniglot_base.paper_learning_rate(num_tasks),
      variant=variant)
  config.loss = 'task_incremental'
  return config
