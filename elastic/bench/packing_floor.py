"""The floor of `elastic bench packing`: what a GPU-sharing trial costs at the least, side by side with ours.

The same hold as our trials (a small model, registered at the barrier, held until every trial has arrived), as
a plain Ray Tune function trainable asking for the same CPU and GPU share on the same nodes: no trial driver,
Train controller or worker group. Both runs are measured the same way:

- `ram_per_trial_mb`: the unique memory (USS) of the cluster's Ray worker processes at the moment most trials
  are held, less what those processes held before the sweep, per trial. Read with psutil from this machine, of
  the processes that carry the local stack's marker (not another stack's on the same machine), so only on the
  local stack; elsewhere it is None.
- `driver_to_worker_seconds`: mean time from the sweep's fit() to each trial's training code holding at the
  barrier (a plain trainable's code is its own driver; ours starts a worker group unless the trial is light).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psutil

from elastic.local.processes import MARKER_VARIABLE
from elastic.placement.labels import worker_selector
from elastic.storage import fsspec_filesystem, parse_uri

MB = 1024**2


class RayMemorySampler:
    """Peak summed USS of the local stack's Ray worker processes (`ray::...` carrying its `marker`), sampled every
    `every` seconds in a thread, and the same sum once before the run starts (the baseline). Without a marker (a
    remote cluster) it measures nothing."""

    def __init__(self, marker: str | None, every: float = 1.0):
        self.marker, self.every = marker, every
        self.baseline = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.baseline = self.peak = ray_workers_uss(self.marker)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.peak = max(self.peak, ray_workers_uss(self.marker))

    def per_trial_mb(self, trials: int) -> float | None:
        return round((self.peak - self.baseline) / MB / trials, 1) if trials and self.peak > self.baseline else None


def ray_workers_uss(marker: str | None) -> int:
    """Summed unique memory of one local stack's Ray worker processes (Tune trainables, Train controllers and
    workers, Ray's helper actors and idle pool workers all show as `ray::...`; every process of the stack carries
    its marker in its environment, elastic.local.processes)."""
    if marker is None:
        return 0
    total = 0
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            cmdline = proc.info["cmdline"] or []
            if not (cmdline and cmdline[0].startswith("ray::")):
                continue
            if proc.environ().get(MARKER_VARIABLE) != marker:
                continue
            total += proc.memory_full_info().uss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return total


def hold_at_barrier(cfg: dict, name: str | None) -> dict:
    """Register `name` at the barrier (None: someone else of this trial does), hold until every requested trial
    has arrived (or `hold` seconds pass), then a moment longer, so overlaps are unambiguous. Returns arrived,
    left and how many were seen."""
    fs, root = fsspec_filesystem(cfg["barrier"])
    arrived = time.time()
    if name is not None:
        fs.makedirs(root, exist_ok=True)
        with fs.open(f"{root}/{name}", "w") as handle:
            handle.write(str(arrived))
    deadline = time.monotonic() + float(cfg["hold"])
    count = 0
    while time.monotonic() < deadline:
        count = len(fs.ls(root, refresh=True)) if fs.exists(root) else 0
        if count >= int(cfg["requested"]):
            break
        time.sleep(1.0)
    time.sleep(float(cfg.get("linger", 3)))
    return {"arrived": arrived, "left": time.time(), "seen": count}


def plain_hold(config: dict) -> None:
    """The floor's trial: a plain Tune function trainable doing what elastic.bench.packing.hold does."""
    import torch
    from ray import tune

    model = torch.nn.Linear(8, 8)
    torch.optim.SGD(model.parameters(), lr=0.1)
    tune.report(hold_at_barrier(config, f"plain-{config['seed']}"))


def bench_plain_tune(
    uri: str,
    name: str,
    share: float,
    trials: int,
    requested: int,
    hold_s: float,
    cpus: float,
    market: str,
    marker: str | None,
) -> dict:
    """The same hold as plain Tune function trainables at the same share: when each started, and the memory."""
    from ray import tune

    from elastic.storage import pyarrow_filesystem

    barrier = parse_uri(uri).child(f"{name}-plain", "barrier").uri
    resources = tune.PlacementGroupFactory(
        [{"CPU": cpus, "GPU": share}], bundle_label_selector=[worker_selector(market)]
    )
    root_fs, root_path = pyarrow_filesystem(uri)
    tuner = tune.Tuner(
        tune.with_resources(plain_hold, resources),
        param_space={
            "seed": tune.grid_search(list(range(trials))),
            "barrier": barrier,
            "hold": hold_s,
            "requested": requested,
        },
        tune_config=tune.TuneConfig(max_concurrent_trials=trials, reuse_actors=False),
        run_config=tune.RunConfig(name=f"{name}-plain", storage_path=root_path, storage_filesystem=root_fs, verbose=0),
    )
    started = time.time()
    with RayMemorySampler(marker) as memory:
        results = tuner.fit()
    arrivals = [r.metrics["arrived"] for r in results if r.metrics and "arrived" in r.metrics]
    return {
        "trials": trials,
        "errors": sum(r.error is not None for r in results),
        "ram_per_trial_mb": memory.per_trial_mb(trials),
        "driver_to_worker_seconds": mean_of([a - started for a in arrivals]),
    }


def floor_ratios(ours: dict, plain: dict) -> dict:
    """Ours over the floor, for the memory and the start (None where either is unmeasured)."""
    ratio: Callable[[str], float | None] = lambda key: (
        round(ours[key] / plain[key], 2) if ours.get(key) and plain.get(key) else None
    )
    return {
        "ram_per_trial_vs_plain_tune": ratio("ram_per_trial_mb"),
        "start_vs_plain_tune": ratio("driver_to_worker_seconds"),
    }


def mean_of(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 2) if values else None


def local_stack_marker() -> str | None:
    """The marker of the local stack this process drives, or None (a remote cluster: memory is not measured)."""
    import os

    from elastic.local import stack as local

    state = local.running_state()
    if state is None or os.environ.get("RAY_ADDRESS") not in (None, "", state.ray_address):
        return None
    return state.marker
