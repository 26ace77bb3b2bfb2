"""Continual-learning summaries on hand-built accuracy matrices (cht_jax.metrics)."""

import numpy as np
import pytest

from cht_jax import metrics

X = 99.0  # Above the diagonal: must never be read.
# A[t, tau]. Task 0 peaks under theta_1 (not right after it was learnt), task 1
# improves under theta_2: forgetting and backward transfer disagree here.
A = np.array([[0.7, X, X],
              [0.9, 0.8, X],
              [0.6, 0.85, 0.5]])


def test_average_accuracy_is_the_mean_of_the_last_row():
  assert metrics.average_accuracy(A) == pytest.approx((0.6 + 0.85 + 0.5) / 3)


def test_average_incremental_accuracy_averages_the_seen_tasks_of_each_stage():
  stages = [0.7, (0.9 + 0.8) / 2, (0.6 + 0.85 + 0.5) / 3]
  assert metrics.average_incremental_accuracy(A) == pytest.approx(np.mean(stages))


def test_backward_transfer_compares_with_the_diagonal():
  # Last task (tau = 2) excluded: ((0.6 - 0.7) + (0.85 - 0.8)) / 2.
  assert metrics.backward_transfer(A) == pytest.approx(-0.025)


def test_forgetting_compares_with_the_best_earlier_theta():
  # tau = 0: max(0.7, 0.9) - 0.6 = 0.3; tau = 1: max(0.8) - 0.85 = -0.05.
  assert metrics.forgetting(A) == pytest.approx(0.125)


def test_upper_triangle_is_ignored():
  for junk in (np.nan, -5.0, 1e9):
    other = np.where(metrics.lower_triangle(3), A, junk)
    assert metrics.summaries(other) == pytest.approx(metrics.summaries(A))


def test_one_task_and_two_tasks():
  one = np.array([[0.4]])
  assert metrics.average_accuracy(one) == pytest.approx(0.4)
  assert metrics.average_incremental_accuracy(one) == pytest.approx(0.4)
  assert np.isnan(metrics.backward_transfer(one)) and np.isnan(metrics.forgetting(one))
  two = np.array([[0.5, X], [0.7, 0.6]])
  assert metrics.summaries(two) == pytest.approx({
      'average_accuracy': 0.65, 'average_incremental_accuracy': (0.5 + 0.65) / 2,
      'backward_transfer': 0.2, 'forgetting': -0.2})


def test_no_change_means_no_transfer_and_no_forgetting():
  constant = np.tril(np.full((4, 4), 0.8))
  assert metrics.backward_transfer(constant) == pytest.approx(0.0)
  assert metrics.forgetting(constant) == pytest.approx(0.0)


def test_batched_matrices():
  batch = np.stack([A, np.tril(np.ones((3, 3)))])
  np.testing.assert_allclose(metrics.forgetting(batch), [0.125, 0.0])
  np.testing.assert_allclose(metrics.average_accuracy(batch), [0.65, 1.0])


def test_cumulative_accuracy_is_the_accuracy_on_the_union_of_tasks():
  rng = np.random.default_rng(0)
  correct = rng.random((3, 3, 40)) < 0.7  # [theta t, task tau, query]: equal query counts.
  per_task = correct.mean(-1)
  cumulative = metrics.cumulative_accuracy(per_task)
  for t in range(3):
    for k in range(3):
      if k <= t:
        union = correct[t, :k + 1].reshape(-1).mean()
        assert cumulative[t, k] == pytest.approx(union)
      else:
        assert np.isnan(cumulative[t, k])
  # Table 1 ("0-t") is the diagonal; the last one is the average accuracy.
  assert metrics.cumulative_accuracy(A)[2, 2] == pytest.approx(metrics.average_accuracy(A))
  assert metrics.cumulative_accuracy(A)[2, 1] == pytest.approx((0.6 + 0.85) / 2)


def test_mean_and_ci():
  mean, ci = metrics.mean_and_ci(np.array([0.0, 1.0, 0.0, 1.0]))
  assert mean == pytest.approx(0.5)
  assert ci == pytest.approx(1.96 * np.sqrt(1 / 3) / 2)
  mean, ci = metrics.mean_and_ci(np.array([[0.3, np.nan]]))
  assert mean[0] == pytest.approx(0.3) and np.isnan(ci).all()


def test_not_square_is_an_error():
  with pytest.raises(ValueError, match=r'\[\.\.\., T, T\]'):
    metrics.average_accuracy(np.zeros((2, 3)))
