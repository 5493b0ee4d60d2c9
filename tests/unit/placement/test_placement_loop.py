"""The driver loop's decisions (elastic/placement/loop.py) and its messages (elastic/placement/messages.py),
driven one event at a time in a process where `import ray` fails: the loop is pure."""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from types import SimpleNamespace

import pytest


class _NoRay(importlib.abc.MetaPathFinder):
    """Makes `import ray` (and torch) fail, as on a machine without them."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ray", "torch"):
            raise ImportError(f"{name} is blocked: the placement loop must not need it")
        return None


@pytest.fixture
def pure():
    """elastic.placement.loop and .messages imported afresh with ray and torch unimportable; the modules loaded
    before (ray included, by other tests) are put back afterwards."""
    saved = dict(sys.modules)
    blocker = _NoRay()
    for name in list(sys.modules):
        if name.split(".")[0] in ("ray", "torch", "elastic"):
            del sys.modules[name]
    sys.meta_path.insert(0, blocker)
    try:
        with pytest.raises(ImportError):
            importlib.import_module("ray")
        loop = importlib.import_module("elastic.placement.loop")
        messages = importlib.import_module("elastic.placement.messages")
        spec = importlib.import_module("elastic.config.spec")
        assert not any(name.split(".")[0] in ("ray", "torch") for name in sys.modules)
        yield SimpleNamespace(loop=loop, messages=messages, EndKind=messages.EndKind, JobSpec=spec.JobSpec)
    finally:
        sys.meta_path.remove(blocker)
        sys.modules.clear()
        sys.modules.update(saved)


def job(pure, market: str = "spot", min_workers: int = 2, max_workers: int = 2, swap_to_spot: bool = True, **failure):
    return pure.JobSpec.model_validate(
        {
            "name": "t",
            "entrypoint": "m:f",
            "workers": {
                "min": min_workers,
                "max": max_workers,
                "cpus": 1,
                "market": market,
                "spot_wait_seconds": 60,
                "swap_to_spot": swap_to_spot,
            },
            "checkpoint": {"uri": "/tmp/ckpt", "every_steps": 10},
            "failure": failure,
        }
    )


def test_a_noticed_reclaim_starts_the_next_placement_ahead_once_due_and_settled(pure):
    L, kind = pure.loop, pure.EndKind
    run = L.PlacementLoop(job(pure, "spot", max_preemptions=5))
    first = run.step(L.RunStarting())
    assert isinstance(first, L.Start) and first.market == "spot" and not first.swappable
    assert first.placement_reason == "workers.market is spot"

    # The just-in-time checkpoint is due in 30 s: too early to start ahead.
    far = run.step(L.EndingSoon(eta=1030.0, noticed_at=990.0, nodes=("a", "b"), now=1000.0))
    assert isinstance(far, L.KeepRunning)
    # Due within START_AHEAD_SECONDS but the notice is 2 s old: a correlated reclaim may still be coming.
    fresh = run.step(L.EndingSoon(eta=1010.0, noticed_at=998.0, nodes=("a", "b"), now=1000.0))
    assert isinstance(fresh, L.KeepRunning)
    ahead = run.step(L.EndingSoon(eta=1010.0, noticed_at=994.0, nodes=("a", "b", "b"), now=1000.0))
    assert isinstance(ahead, L.StartAhead) and ahead.market == "spot"
    assert ahead.released == {"a": 1, "b": 2} and ahead.placement_reason == "resumed after a reclaim"

    after = run.step(L.PlacementEnded(step=40, kind=kind.PREEMPTION, nodes=("a", "b", "b")))
    assert isinstance(after, L.Start) and after.market == "spot"
    assert after.placement_reason == "resumed after a reclaim at step 40"  # the one started ahead takes it
    assert "preemption 1 of 5" in after.reason and run.preemptions == 1
    assert isinstance(run.step(L.RunFinished()), L.Finish)


def test_a_hard_kill_is_rays_restart_and_the_run_goes_on(pure):
    """A node killed with no notice: Ray Train restarts the worker group inside the same fit(); the driver sees
    no acknowledgement and nothing is counted here. A notice whose just-in-time save then failed: the placement
    went on, so the run's end comes with no acknowledgement (the driver calls the one started ahead off)."""
    L = pure.loop
    run = L.PlacementLoop(job(pure, "on-demand"))
    assert isinstance(run.step(L.RunStarting()), L.Start)
    assert isinstance(run.step(L.EndingSoon(eta=1005.0, noticed_at=990.0, nodes=("a",), now=1000.0)), L.StartAhead)
    done = run.step(L.RunFinished())
    assert isinstance(done, L.Finish) and run.preemptions == 0 and run.failures == 0


def test_spot_first_falls_back_to_on_demand_swaps_back_and_chooses_again_after_a_reclaim(pure):
    L, kind = pure.loop, pure.EndKind
    run = L.PlacementLoop(job(pure, "spot-first"))
    assert isinstance(run.step(L.RunStarting()), L.WaitForCapacity)
    fallback = run.step(L.SpotDecided("on-demand", "spot capacity was not granted within 60 s"))
    assert isinstance(fallback, L.Start) and fallback.market == "on-demand" and fallback.swappable
    assert fallback.placement_reason == "spot capacity was not granted within 60 s"
    # Spot-first never starts ahead: it chooses its market again after the reclaim.
    assert isinstance(run.step(L.EndingSoon(eta=1005.0, noticed_at=990.0, nodes=("a",), now=1000.0)), L.KeepRunning)

    swap = run.step(L.PlacementEnded(step=20, kind=kind.SWAP))
    assert isinstance(swap, L.SwapToSpot) and swap.market == "spot" and not swap.swappable
    assert swap.placement_reason == "swapped from on-demand at step 20" and run.preemptions == 0

    reclaimed = run.step(L.PlacementEnded(step=50, kind=kind.PREEMPTION))
    assert isinstance(reclaimed, L.WaitForCapacity) and "step 50" in reclaimed.reason and run.market is None
    again = run.step(L.SpotDecided("spot", "spot capacity for 2 worker(s) is free"))
    assert isinstance(again, L.Start) and again.market == "spot" and not again.swappable


def test_swap_to_spot_off_keeps_an_on_demand_fallback_unswappable(pure):
    L = pure.loop
    run = L.PlacementLoop(job(pure, "spot-first", swap_to_spot=False))
    run.step(L.RunStarting())
    assert not run.step(L.SpotDecided("on-demand", "no spot")).swappable


def test_an_elastic_run_regrows_on_the_same_market(pure):
    L, kind = pure.loop, pure.EndKind
    run = L.PlacementLoop(job(pure, "spot", min_workers=1, max_workers=4))
    run.step(L.RunStarting())
    grow = run.step(L.PlacementEnded(step=30, kind=kind.GROW, nodes=("a",)))
    assert isinstance(grow, L.Grow) and grow.market == "spot" and grow.placement_reason == "grown at step 30"
    assert grow.reason == "ended at the checkpoint of step 30 to grow" and run.preemptions == 0


def test_the_preemption_budget_running_out_fails_the_run_with_its_reason(pure):
    L, kind = pure.loop, pure.EndKind
    run = L.PlacementLoop(job(pure, "spot", max_preemptions=1))
    run.step(L.RunStarting())
    assert isinstance(run.step(L.PlacementEnded(step=10, kind=kind.PREEMPTION)), L.Start)
    failed = run.step(L.PlacementEnded(step=20, kind=kind.PREEMPTION))
    assert isinstance(failed, L.Fail)
    assert failed.reason == "preempted 2 times, over failure.max_preemptions (1); raise it to keep going"

    unlimited = L.PlacementLoop(job(pure, "spot", max_preemptions=-1))
    unlimited.step(L.RunStarting())
    for step in range(1, 50):
        decision = unlimited.step(L.PlacementEnded(step=step, kind=kind.PREEMPTION))
        assert isinstance(decision, L.Start)
    assert "(preemption 49)" in decision.reason


def test_controller_errors_are_retried_within_max_failures_and_user_errors_never(pure):
    L = pure.loop
    run = L.PlacementLoop(job(pure, "spot", max_failures=1))
    run.step(L.RunStarting())
    retry = run.step(L.ControllerFailed("ControllerError", "worker group failed to start", retryable=True))
    assert isinstance(retry, L.Retry) and retry.market == "spot"
    assert retry.placement_reason == "restarted after a controller error (ControllerError)"
    assert "failure 1 of 1" in retry.reason
    over = run.step(L.ControllerFailed("ControllerError", "again", retryable=True))
    assert isinstance(over, L.Fail) and "over failure.max_failures (1)" in over.reason

    fresh = L.PlacementLoop(job(pure, "spot", max_failures=3))
    fresh.step(L.RunStarting())
    user = fresh.step(L.ControllerFailed("ValueError", "bad config", retryable=False))
    assert isinstance(user, L.Fail) and "not retried" in user.reason


def test_start_ahead_timing_and_budget_rules(pure):
    L = pure.loop
    due, settle = L.START_AHEAD_SECONDS, L.NOTICE_SETTLE_SECONDS
    assert L.start_ahead_due(eta=100 + due, noticed_at=100 - settle, now=100)
    assert not L.start_ahead_due(eta=100 + due + 0.1, noticed_at=100 - settle, now=100)
    assert not L.start_ahead_due(eta=100 + due, noticed_at=100 - settle + 0.1, now=100)
    assert L.over_budget(2, 1) and not L.over_budget(1, 1) and not L.over_budget(10**6, -1)
    assert L.market_after_reclaim(True, "spot") is None and L.market_after_reclaim(False, "spot") == "spot"
    with pytest.raises(TypeError):
        L.PlacementLoop(job(pure)).step(object())


def test_messages_round_trip_and_a_torn_file_reads_as_not_there_yet(pure):
    M, kind = pure.messages, pure.EndKind
    ack = M.Acknowledgement("p1", 40, kind.PREEMPTION, ("a", "b"), time=5.0)
    assert M.Acknowledgement.from_json(ack.to_json()) == ack
    assert '"kind": "preemption"' in ack.to_json() and '"nodes": ["a", "b"]' in ack.to_json()
    assert M.Acknowledgement.from_json('{"placement": "p1", "st') is None  # caught mid-write
    assert M.Acknowledgement.from_json('{"placement": "p1"}') is None  # a field missing
    # As the driver always read them: no kind is a swap, an unknown kind a grow.
    assert M.Acknowledgement.from_json('{"placement": "p", "step": 3}').kind is kind.SWAP
    assert M.Acknowledgement.from_json('{"placement": "p", "step": 3, "kind": "ended"}').kind is kind.GROW
    placement = M.Placement(id="x", market="spot", resizable=True, avoid_nodes=("n1",), follows="w")
    assert M.Placement.from_dict(placement.to_dict()) == placement and placement.endable
    assert M.Placement.from_dict({"id": "q", "extra": 1}) == M.Placement(id="q")  # unknown fields ignored
    for message in (
        M.EndRequest("p", kind.GROW, "why", time=1.0),
        M.EndingSoon("p", 12.5, ("a",), time=1.0),
        M.Cancel("p", time=1.0),
        M.Running("p", 3, time=1.0),
        M.DriverStatus("running", "d", time=1.0),
    ):
        assert type(message).from_json(message.to_json()) == message
    assert M.EndRequest.from_json('{"placement": "p", "kind": "nonsense"}') is None
