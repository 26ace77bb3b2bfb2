"""The mini-batch experiment (paper section 5.1), on Omniglot by default.

  --config=configs/omniglot_minibatch.py:ARM[,variant]   e.g. :one_at_a_time,smoke

Four 1-shot support batches S1..S4 of the same classes, cross-entropy loss:
  all_at_once     theta(a) = HT(S1+S2+S3+S4): T=1 task with 4 shots
  two_plus_two    theta(b) = HT(S3+S4, HT(S1+S2)): CHT, T=2 tasks of 2 shots
  one_at_a_time   theta(c) = HT(S4, HT(S3, HT(S2, HT(S1)))): CHT, T=4 tasks of 1 shot
  ht_one          HT given S1 only: T=1, 1 shot
  ht_two          HT given S1+S2: T=1, 2 shots

Compare the task-incremental accuracy of the last theta_{T-1}. The paper used
tieredImageNet 5-way (configs/tiered_imagenet_minibatch.py).
"""

from configs import omniglot_base

ARMS = {'all_at_once': (1, 4), 'two_plus_two': (2, 2), 'one_at_a_time': (4, 1),  # (T, shots)
        'ht_one': (1, 1), 'ht_two': (1, 2)}


def apply_arm(config, arm: str):
  """Sets the episode, loss and head of mini-batch arm `arm` on any base config."""
  if arm not in ARMS:
    raise ValueError(f'Unknown mini-batch arm {arm!r}; expected one of {tuple(ARMS)}.')
  num_tasks, shots = ARMS[arm]
  config.episode.num_tasks = num_tasks
  config.episode.shots = shots
  config.episode.task_classes = 'same'
  # New images in every task (a batch repeats none of another's): no original code to follow.
  config.episode.independent_draws = False
  config.loss = 'cross_entropy'
  config.model.cnn_embedding_dim = config.episode.get_ref('ways')
  return config


def parse_arm(arg: str | None) -> tuple[str, str, int]:
  """'ARM[,variant]' -> (arm, variant, T of the arm); the arm is checked by `apply_arm`."""
  parts = [p.strip() for p in (arg or 'one_at_a_time').split(',')]
  arm, variant = parts[0], (parts[1] if len(parts) > 1 else '')
  return arm, variant, ARMS.get(arm, (1, 1))[0]


def get_config(arg=None):
  arm, variant, num_tasks = parse_arm(arg)
  config = omniglot_base.get_config(
      num_tasks=num_tasks, learning_rate=omniglot_base.paper_learning_rate(num_tasks),
      variant=variant)
  return apply_arm(config, arm)
