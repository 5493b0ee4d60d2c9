"""Goodput so far (elastic.observability.goodput): the pure ratio and the clock a checkpoint carries."""

from __future__ import annotations

import pytest

from elastic.observability.goodput import GoodputClock, goodput_so_far


@pytest.mark.parametrize(
    "productive, wall, expected",
    [(45.0, 60.0, 0.75), (0.0, 10.0, 0.0), (10.0, 10.0, 1.0), (10.2, 10.0, 1.0), (5.0, 0.0, None), (-1.0, 4.0, 0.0)],
)
def test_goodput_is_productive_over_wall_time(productive, wall, expected):
    assert goodput_so_far(productive, wall) == expected


def test_clock_adds_steps_less_stalls_and_spans_a_restart():
    clock = GoodputClock()
    clock.start(1000.0)
    for _ in range(10):
        clock.add_step(0.5)
    clock.add_stall(1.0)  # a checkpoint blocked the loop for 1 s inside those intervals
    assert clock.productive_seconds == pytest.approx(4.0)
    assert clock.goodput(1008.0) == pytest.approx(0.5)
    saved = clock.state_dict()

    # The next placement starts later; the restored clock keeps the run's start and its productive time, so
    # the gap between placements counts as wall time and goodput drops.
    resumed = GoodputClock()
    resumed.start(1030.0)
    resumed.load_state_dict(saved)
    assert resumed.run_started == 1000.0
    resumed.add_step(6.0)
    assert resumed.goodput(1040.0) == pytest.approx(10.0 / 40.0)


def test_a_clock_with_no_start_has_no_goodput():
    assert GoodputClock().goodput(5.0) is None
