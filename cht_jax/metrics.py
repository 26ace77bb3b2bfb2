"""Continual-learning summaries of an accuracy matrix, and confidence intervals.

An accuracy matrix `A` is [..., T, T] (any leading batch axes): A[t, tau] is the
accuracy of theta_t (the weights generated after task t) on the queries of task
tau. Only the lower triangle (tau <= t) is defined; whatever lies above the
diagonal (NaN in the evaluation's matrices) is ignored. Indices are 0-based:
theta_0 has seen task 0 only, theta_{T-1} all T tasks.

Definitions (T >= 1; those that need T >= 2 are NaN for T = 1):

  average_accuracy             ACC  = 1/T sum_{tau=0}^{T-1} A[T-1, tau]
      (the final theta on every task; Lopez-Paz & Ranzato 2017, "GEM").
  average_incremental_accuracy AIA  = 1/T sum_{t=0}^{T-1} (1/(t+1) sum_{tau<=t} A[t, tau])
      (the mean, over the T stages, of the accuracy on the tasks seen so far;
      Rebuffi et al. 2017, "iCaRL").
  backward_transfer            BWT  = 1/(T-1) sum_{tau=0}^{T-2} (A[T-1, tau] - A[tau, tau])
      (how much the final theta gained (> 0) or lost (< 0) on a task since
      the theta generated right after it; GEM).
  forgetting                   F    = 1/(T-1) sum_{tau=0}^{T-2}
                                          max_{t=tau..T-2} (A[t, tau] - A[T-1, tau])
      (the drop from the best accuracy an earlier theta reached on the task
      to the final one, averaged over all tasks but the last; Chaudhry et al.
      2018, "RWalk"). Can be negative when the final theta is the best.

The last task enters ACC and AIA but neither BWT nor F.
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


def mask_upper(matrix: np.ndarray) -> np.ndarray:
  """A copy of `matrix` [..., T, T] with NaN above the diagonal."""
  matrix = _check_square(matrix)
  return np.where(lower_triangle(matrix.shape[-1]), matrix, np.nan)


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


SUMMARIES = {
    'average_accuracy': average_accuracy,
    'average_incremental_accuracy': average_incremental_accuracy,
    'backward_transfer': backward_transfer,
    'forgetting': forgetting,
}


def summaries(matrix: np.ndarray) -> dict[str, float]:
  """Every summary of one [T, T] matrix, as floats (NaN where undefined)."""
  return {name: float(fn(matrix)) for name, fn in SUMMARIES.items()}


def cumulative_accuracy(per_task: np.ndarray) -> np.ndarray:
  """Accuracy of theta_t on the union of the queries of tasks 0..k.

  With the same number of queries in every task (as in every episode here),
  the accuracy on the union is the mean of the per-task accuracies.

  Args:
    per_task: [..., T, T], A[t, tau] as above.

  Returns:
    [..., T, T]: C[t, k] = 1/(k+1) sum_{tau<=k} A[t, tau] for k <= t, NaN
    above the diagonal. For the class-incremental matrix, C[t, t] is the
    paper's Table 1 entry "0-t".
  """
  per_task = _check_square(per_task)
  num_tasks = per_task.shape[-1]
  lower = lower_triangle(num_tasks)
  sums = np.cumsum(np.where(lower, per_task, 0.0), axis=-1)
  return np.where(lower, sums / np.arange(1, num_tasks + 1), np.nan)


def mean_and_ci(values: np.ndarray, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Mean and half-width of its 95% confidence interval along `axis`.

  ci95 = 1.96 * s / sqrt(n), with s the sample standard deviation (ddof=1)
  of the n values (in the evaluation: per-episode accuracies, each already
  averaged over its query draws). NaN where n < 2. NaN values (undefined
  matrix entries) stay NaN.
  """
  values = np.asarray(values, np.float64)
  n = values.shape[axis]
  mean = values.mean(axis=axis)
  if n < 2:
    return mean, np.full_like(mean, np.nan)
  return mean, CI_Z * values.std(axis=axis, ddof=1) / np.sqrt(n)
