"""`elastic bench recovery`'s goodput arithmetic on timelines with known answers (the benchmark itself runs end
to end in tests/integration/test_preemption_e2e.py)."""

from __future__ import annotations

import pytest

from elastic.bench.recovery import _goodput


class Timeline:
    def __init__(self, attempts: list[dict]):
        self._attempts = attempts

    def attempts(self) -> list[dict]:
        return self._attempts


def steps(first: int, last: int, at: float, every: float = 1.0) -> list[tuple[int, float]]:
    return [(step, at + (step - first) * every) for step in range(first, last + 1)]


def test_a_resume_from_the_last_step_loses_only_the_gap():
    # Steps 1-10 one second apart, a reclaim, then 11-20 from t=20: 20 s of steps in 29 s of wall time.
    run = Timeline([{"start": 0, "steps": steps(1, 10, 0.0)}, {"start": 10, "steps": steps(11, 20, 20.0)}])
    goodput, reclaims, gaps = _goodput(run)
    assert goodput == pytest.approx(20 / 29)
    assert reclaims == 1 and gaps == [11.0]


def test_steps_a_later_attempt_resumed_from_before_do_not_count():
    # The second attempt resumed from step 8: steps 9 and 10 of the first were computed for nothing.
    run = Timeline([{"start": 0, "steps": steps(1, 10, 0.0)}, {"start": 8, "steps": steps(9, 18, 20.0)}])
    goodput, _, _ = _goodput(run)
    assert goodput == pytest.approx(18 / 29)


def test_an_attempt_that_died_before_its_first_step_counts_as_a_reclaim_and_its_time_as_lost():
    run = Timeline(
        [
            {"start": 0, "steps": steps(1, 10, 0.0, every=0.5)},
            {"start": 10, "steps": []},
            {"start": 10, "steps": steps(11, 20, 30.0, every=0.5)},
        ]
    )
    goodput, reclaims, gaps = _goodput(run)
    assert goodput == pytest.approx(10 / 34.5)  # 20 steps of 0.5 s over 34.5 s
    assert reclaims == 2 and gaps == [25.5]
