"""Continual-learning summaries of an accuracy matrix, and confidence intervals.

An accuracy matrix `A` is [..., T, T]: A[t, tau] is the accuracy of theta_t (generated after
task t, 0-based) on the queries of task tau. Only tau <= t is defined; entries above the
diagonal are ignored. Summaries needing T >= 2 are NaN for T = 1.

  average_accuracy ACC = 1/T sum_{tau=0}^{T-1} A[T-1, tau] (Lopez-Paz & Ranzato 2017, "GEM").
  average_incremental_accuracy AIA = 1/T sum_{t=0}^{T-1} 1/(t+1) sum_{tau<=t} A[t, tau]
      (Rebuffi et al. 2017, "iCaRL").
  backward_transfer BWT = 1/(T-1) sum_{tau=0}^{T-2} (A[T-1, tau] - A[tau, tau]) (GEM).
  forgetting F = 1/(T-1) sum_{tau=0}^{T-2} max_{t=tau..T-2} (A[t, tau] - A[T-1, tau])
      (Chaudhry et al. 2018, "RWalk"; negative when the final theta is the best).
"""

import numpy as np

CI_Z = 1.96  # Two-sided 95% normal quantile.


def _check_square(matrix: np.ndarray) -> np.ndarray:
  matrix = np.asarray(matrix, np.float64)
  if matrix.ndim < 2 or matrix.shape[-1] != matrix.shape[-2]:
    raise ValueError(f'An accuracy matrix must be [..., T, T], got shape {matrix.shape}.')
  return matrix


def lower_triangle(num_tasks: int) -> np.ndarray:
  """bool [T, T]: True where tau <= t (the defined entries)."""
  return np.tril(np.ones((num_tasks, num_tasks), bool))


def average_accuracy(matrix: np.ndarray) -> np.ndarray:
  """ACC: mean of the last row, [..., T, T] -> [...]."""
  matrix = _check_square(matrix)
  return matrix[..., -1, :].mean(axis=-1)


def average_incremental_accuracy(matrix: np.ndarray) -> np.ndarray:
  """AIA: mean over t of the mean of row t over tau <= t, [..., T, T] -> [...]."""
  matrix = _check_square(matrix)
  num_tasks = matrix.shape[-1]
  rows = np.where(lower_triangle(num_tasks), matrix, 0.0).sum(axis=-1)
  return (rows / np.arange(1, num_tasks + 1)).mean(axis=-1)


def backward_transfer(matrix: np.ndarray) -> np.ndarray:
  """BWT: mean over tau < T-1 of A[T-1, tau] - A[tau, tau], [..., T, T] -> [...]."""
  matrix = _check_square(matrix)
  num_tasks = matrix.shape[-1]
  if num_tasks < 2:
    return np.full(matrix.shape[:-2], np.nan)
  final = matrix[..., -1, :-1]
  just_learned = np.diagonal(matrix, axis1=-2, axis2=-1)[..., :-1]
  return (final - just_learned).mean(axis=-1)


def forgetting(matrix: np.ndarray) -> np.ndarray:
  """F: mean over tau < T-1 of max_{tau<=t<T-1} A[t, tau] - A[T-1, tau], [..., T, T] -> [...]."""
  matrix = _check_square(matrix)
  num_tasks = matrix.shape[-1]
  if num_tasks < 2:
    return np.full(matrix.shape[:-2], np.nan)
  earlier = np.where(lower_triangle(num_tasks)[:-1, :-1], matrix[..., :-1, :-1], -np.inf)
  best = earlier.max(axis=-2)  # [..., T-1]: max over t of column tau.
  return (best - matrix[..., -1, :-1]).mean(axis=-1)


SUMMARIES = {fn.__name__: fn for fn in (average_accuracy, average_incremental_accuracy,
                                         backward_transfer, forgetting)}


def summaries(matrix: np.ndarray) -> dict[str, float]:
  """Every summary of one [T, T] matrix, as floats (NaN where undefined)."""
  return {name: float(fn(matrix)) for name, fn in SUMMARIES.items()}


def cumulative_accuracy(per_task: np.ndarray) -> np.ndarray:
  """C[t, k] = 1/(k+1) sum_{tau<=k} A[t, tau], theta_t's accuracy on tasks 0..k (as many queries
  each), NaN above the diagonal; class-incremental C[t, t] is the paper's Table 1 "0-t"."""
  per_task = _check_square(per_task)
  num_tasks = per_task.shape[-1]
  lower = lower_triangle(num_tasks)
  sums = np.cumsum(np.where(lower, per_task, 0.0), axis=-1)
  return np.where(lower, sums / np.arange(1, num_tasks + 1), np.nan)


def mean_and_ci(values: np.ndarray, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Mean and 95% CI half-width along `axis` (1.96 * s / sqrt(n), ddof=1; NaN where n < 2)."""
  values = np.asarray(values, np.float64)
  n = values.shape[axis]
  mean = values.mean(axis=axis)
  if n < 2:
    return mean, np.full_like(mean, np.nan)
  return mean, CI_Z * values.std(axis=axis, ddof=1) / np.sqrt(n)
