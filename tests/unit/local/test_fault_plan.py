"""The S3 fault proxy's plan (elastic.local.fault_plan): seeded draws, rates, windows and what they match."""

from __future__ import annotations

import pytest

from elastic.local.fault_plan import ERROR_500, LATENCY, RESET, SLOW_DOWN, FaultPlan, Match, Rates, Window


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def kinds(plan: FaultPlan, requests: int, method: str = "PUT", path: str = "/b/k") -> list:
    return [plan.decide(method, path).kind for _ in range(requests)]


def test_the_same_seed_gives_the_same_faults_and_another_seed_others():
    rates = Rates(error_500=0.1, slow_down=0.1, reset=0.1, latency=0.1)
    first = kinds(FaultPlan(seed=7, rates=rates), 200)
    assert first == kinds(FaultPlan(seed=7, rates=rates), 200)
    assert first != kinds(FaultPlan(seed=8, rates=rates), 200)
    assert {ERROR_500, SLOW_DOWN, RESET, LATENCY, None} == set(first)


def test_rates_are_probabilities_per_request():
    plan = FaultPlan(seed=1, rates=Rates(slow_down=0.25))
    drawn = kinds(plan, 4000)
    assert 0.2 < drawn.count(SLOW_DOWN) / 4000 < 0.3
    assert set(drawn) == {SLOW_DOWN, None}
    assert plan.snapshot()["injected"][SLOW_DOWN] == drawn.count(SLOW_DOWN)
    assert plan.snapshot()["requests"] == 4000


def test_latency_carries_its_delay_and_no_rates_inject_nothing():
    slow = FaultPlan(rates=Rates(latency=1.0, latency_seconds=2.5)).decide("GET", "/b/k")
    assert (slow.kind, slow.delay) == (LATENCY, 2.5)
    plan = FaultPlan(seed=3)
    assert kinds(plan, 100) == [None] * 100
    assert sum(plan.snapshot()["injected"].values()) == 0


def test_a_window_fails_every_matching_request_until_its_count_is_spent():
    plan = FaultPlan(seed=0)
    plan.open_window(Window(RESET, Match(methods=("PUT",), path_contains="/step-"), requests=3))
    assert plan.decide("GET", "/b/run/step-000000010/__0_0.distcp").kind is None  # not a PUT
    assert plan.decide("PUT", "/b/run/audit/x.json").kind is None  # not under a step folder
    assert kinds(plan, 4, "PUT", "/b/run/step-000000010/__0_0.distcp") == [RESET, RESET, RESET, None]
    assert plan.snapshot()["open_windows"] == 0


def test_a_window_closes_after_its_seconds_or_by_hand():
    clock = Clock()
    plan = FaultPlan(seed=0, clock=clock)
    plan.open_window(Window(SLOW_DOWN, seconds=5))
    clock.now += 4.9
    assert plan.decide("GET", "/b/k").kind == SLOW_DOWN
    clock.now += 0.2
    assert plan.decide("GET", "/b/k").kind is None
    plan.open_window(Window(ERROR_500))  # no limit: open until closed
    clock.now += 1000
    assert plan.decide("GET", "/b/k").kind == ERROR_500
    assert plan.close_windows() == 1
    assert plan.decide("GET", "/b/k").kind is None


def test_windows_do_not_shift_the_seeded_draws_of_later_requests():
    rates = Rates(reset=0.3)
    plain = FaultPlan(seed=5, rates=rates)
    windowed = FaultPlan(seed=5, rates=rates)
    windowed.open_window(Window(ERROR_500, requests=10))
    assert kinds(plain, 50)[10:] == kinds(windowed, 50)[10:]


@pytest.mark.parametrize(
    "data, message",
    [
        ({"slow_down": 0.7, "reset": 0.6}, "add up to at most 1"),
        ({"error_500": -0.1}, "must be >= 0"),
        ({"slowdown": 0.1}, "unknown fault rate fields ['slowdown']"),
    ],
)
def test_bad_rates_are_refused_with_the_reason(data, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Rates.from_json(data)


def test_a_window_of_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="use one of 500, 503, reset"):
        Window.from_json({"kind": "404"})
    assert Window.from_json({"kind": "reset", "requests": 2, "match": {"methods": ["put"]}}).match.methods == ("PUT",)
