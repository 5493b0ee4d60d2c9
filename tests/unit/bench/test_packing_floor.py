"""The floor of `bench packing` without a cluster: ours over plain Tune, and the memory of Ray's workers."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from elastic.bench import packing_floor as floor
from elastic.local.processes import MARKER_VARIABLE


def test_ratios_are_ours_over_plain_tune_and_none_where_unmeasured():
    ours = {"ram_per_trial_mb": 1200.0, "driver_to_worker_seconds": 30.0}
    assert floor.floor_ratios(ours, {"ram_per_trial_mb": 400.0, "driver_to_worker_seconds": 12.0}) == {
        "ram_per_trial_vs_plain_tune": 3.0,
        "start_vs_plain_tune": 2.5,
    }
    assert floor.floor_ratios(ours, {"ram_per_trial_mb": None, "driver_to_worker_seconds": 0}) == {
        "ram_per_trial_vs_plain_tune": None,
        "start_vs_plain_tune": None,
    }


def test_the_sampler_sees_a_ray_worker_process_come_and_counts_it_per_trial():
    """A process named like a Ray worker (`ray::...` as its argv[0]) of this stack (its marker in the
    environment) holding ~64 MB of its own memory; another stack's is not counted."""
    code = "import sys, time; x = bytearray(64 * 1024 * 1024); sys.stdout.write('up\\n'); sys.stdout.flush(); time.sleep(30)"

    def start(marker: str):
        env = {**os.environ, MARKER_VARIABLE: marker}
        proc = subprocess.Popen(
            ["ray::FakeTrial", "-c", code], executable=sys.executable, stdout=subprocess.PIPE, env=env
        )
        assert proc.stdout.readline() == b"up\n"
        return proc

    with floor.RayMemorySampler("ours", every=0.2) as memory, floor.RayMemorySampler("other", every=0.2) as other:
        procs = [start("ours")]
        try:
            time.sleep(1.0)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    assert memory.per_trial_mb(2) >= 30  # ~64 MB over 2 trials
    assert other.per_trial_mb(2) is None  # not this stack's
    assert floor.RayMemorySampler(None).per_trial_mb(2) is None
    assert floor.mean_of([1.0, 2.0]) == 1.5 and floor.mean_of([]) is None
