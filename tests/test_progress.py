"""runtime/progress.py: when the training and evaluation loops say how far they are."""

from cht_jax.runtime import progress as progress_lib


class FakeClock:

  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


def test_a_line_every_interval_with_the_speed_since_the_last_and_the_time_left():
  clock = FakeClock()
  progress = progress_lib.Progress(1000, 'steps', done=100, interval=30, clock=clock)
  clock.now += 29.9
  assert not progress.due()
  clock.now += 0.1
  assert progress.due()
  assert progress.status(160) == '2 steps/s, 7 min left'  # 60 steps in 30 s; 840 to go.
  assert not progress.due()  # A line resets the interval.
  clock.now += 40
  assert progress.due()
  assert progress.status(180) == '0.5 steps/s, 27 min left'  # The speed of the last 40 s.


def test_a_restart_leaves_a_first_step_that_compiled_out_of_the_speed():
  clock = FakeClock()
  progress = progress_lib.Progress(10, 'episodes', clock=clock)
  clock.now += 95  # Compilation and the first batch.
  assert progress.seconds() == 95
  progress.restart(2)
  assert progress.status(2) == 'episodes/s from the next line on'
  clock.now += 4
  assert progress.status(6) == '1 episodes/s, 4 s left'


def test_durations_read_as_a_person_says_them():
  assert [progress_lib.duration(s) for s in (0, 45, 89, 90, 3000, 5400, 7500, 47 * 3600,
                                             50 * 3600, 400 * 86400)] == [
      '0 s', '45 s', '89 s', '2 min', '50 min', '1 h 30 min', '2 h 05 min', '47 h 00 min',
      '2 days 2 h', '400 days 0 h']
