"""Unit tests for elastic/placement/packing.py: the pure packing policy."""

from __future__ import annotations

import os

import pytest

from elastic.placement.packing import (
    GB,
    Probe,
    bigger_share,
    concurrency_cap,
    fixed_plan,
    max_overlap,
    memory_cap,
    plan_packing,
    rank_placement,
)


def probe(peak_gb: float, device_gb: float = 80, source: str = "measured") -> Probe:
    return Probe(int(peak_gb * GB), int(device_gb * GB), 0.01, source)


def test_small_trial_packs_several_with_headroom():
    plan = plan_packing(probe(15), headroom=0.15, context_bytes=0, max_per_gpu=8)
    assert plan.trials_per_gpu == 4 and plan.share == 0.25  # 15 x 1.15 = 17.25 GB: 4 fit in 80, 5 do not
    assert plan.memory_fraction == 0.25


def test_headroom_and_context_reduce_the_count():
    assert plan_packing(probe(15), headroom=0.0, context_bytes=0).trials_per_gpu == 5
    plan = plan_packing(probe(15), headroom=0.15, context_bytes=int(3 * GB))
    assert plan.trials_per_gpu == 3 and plan.share == 0.3333
    # the allocator cap leaves the context (outside the allocator) inside the share
    assert plan.memory_fraction == pytest.approx(0.3333 - 3 / 80, abs=1e-4)


def test_capped_at_max_per_gpu():
    plan = plan_packing(probe(0.5), headroom=0.15, context_bytes=0, max_per_gpu=8)
    assert plan.trials_per_gpu == 8 and plan.share == 0.125 and "capped" in plan.reason


def test_too_big_gets_a_whole_gpu_and_says_so():
    plan = plan_packing(probe(90), headroom=0.1, context_bytes=0)
    assert plan.trials_per_gpu == 1 and plan.share == 1.0 and "exceeds" in plan.reason


def test_shares_tile_a_gpu_exactly():
    for n in range(1, 9):
        plan = plan_packing(probe(80 / n / 1.0001), headroom=0, context_bytes=0, max_per_gpu=8)
        assert plan.trials_per_gpu == n and plan.share * n <= 1.0


def test_declared_source_is_reported():
    assert plan_packing(probe(15, source="declared"), context_bytes=0).reason.startswith("declared peak")


def test_bigger_share_halves_trials_per_gpu():
    assert bigger_share(0.125) == 0.25 and bigger_share(0.25) == 0.5 and bigger_share(0.5) == 1.0
    assert bigger_share(0.3333) == 1.0 and bigger_share(1.0) == 1.0


def test_ddp_ranks_on_shared_gpus_spread_across_nodes():
    assert rank_placement(2, 0.25) == "STRICT_SPREAD"
    assert rank_placement(2, 1.0) == "PACK"  # whole GPUs are distinct devices
    assert rank_placement(1, 0.25) == "PACK"


def test_fixed_plan_and_caps():
    plan = fixed_plan(0.25)
    assert plan.trials_per_gpu == 4 and plan.memory_fraction == 0.25
    assert memory_cap(1.5) == 1.0 and memory_cap(-0.1) == 0.01
    assert concurrency_cap(4, 4, 1) == 16 and concurrency_cap(4, 4, 2) == 8 and concurrency_cap(4, 0, 1) == 1


def test_max_overlap():
    assert max_overlap([(0, 10), (1, 5), (2, 3), (6, 7)]) == 3
    assert max_overlap([(0, 1), (1, 2)]) == 1  # touching intervals do not overlap
    assert max_overlap([]) == 0


def test_oom_injection_knob_parses():
    from elastic.worker.sharing import _parse_injection

    assert _parse_injection("") is None
    assert _parse_injection("12:0.5") == (12, 0.5)
    assert _parse_injection("7") == (7, 1.01)  # no share: fires at any share
    with pytest.raises(ValueError, match="expected STEP:SHARE"):
        _parse_injection("x:y")


def test_injected_oom_fires_only_below_the_share():
    import torch

    from elastic.errors import ProbeDone
    from elastic.worker.sharing import _StepWatch

    class FakeSession:  # what _StepWatch uses of a session: add_step_hook; step() calls the hooks
        def __init__(self):
            self.step_count, self.hooks = 0, []

        def add_step_hook(self, hook):
            self.hooks.append(hook)

        def step(self, metrics=None):
            self.step_count += 1
            for hook in self.hooks:
                hook(self.step_count, metrics)

    os.environ["ELASTIC_INJECT_OOM"] = "2:0.5"
    try:
        small, big = FakeSession(), FakeSession()
        _StepWatch(small, 0.25, None), _StepWatch(big, 0.5, None)
        small.step()
        with pytest.raises(torch.OutOfMemoryError):
            small.step()
        big.step(), big.step(), big.step()
        assert big.step_count == 3
        probe = FakeSession()
        _StepWatch(probe, 1.0, 3)
        probe.step(), probe.step()
        with pytest.raises(ProbeDone):
            probe.step()  # the probe ends after its steps
    finally:
        del os.environ["ELASTIC_INJECT_OOM"]
