"""Episodes of fewer tasks first (`train.curriculum_steps`; not the paper's).

Over the first `train.curriculum_steps` steps the training episodes have 1, 2,
..., T-1 tasks in equal parts, then `episode.num_tasks`. An episode of fewer tasks
is a cheaper step (one task is 2.25x cheaper than two on the CPU) that trains the
same single-task generation. Each change of the task count restarts the
learning-rate warmup (`train.rewarmed`).
"""

import ml_collections


def tasks_at(config: ml_collections.ConfigDict, step: int) -> int:
  """Tasks per training episode at `step` (1-based)."""
  num_tasks = config.episode.num_tasks
  steps = config.train.get('curriculum_steps', 0)  # Absent from older runs' config.json.
  if step > steps or num_tasks == 1:
    return num_tasks
  return 1 + (step - 1) * (num_tasks - 1) // steps


def switch_steps(config: ml_collections.ConfigDict) -> list[int]:
  """The steps whose episodes have more tasks than the step before's.

  k + 1 tasks start at the first step s with (s - 1) (T - 1) // steps >= k, that is
  s = 1 + ceil(k steps / (T - 1)); counts that get no step (curriculum_steps < T - 1)
  share their switch with the next.
  """
  num_tasks = config.episode.num_tasks
  steps = config.train.get('curriculum_steps', 0)
  if not steps:
    return []
  return sorted({1 + -(-k * steps // (num_tasks - 1)) for k in range(1, num_tasks)})
