"""`elastic bench packing`: GPU-sharing sweeps measured on the cluster they run on.

- concurrency (any cluster, logical GPUs included): T trials at share S run through the real sweep path
  (Tune trial driver -> TorchTrainer -> worker asking for S of a GPU). Each worker, once started, registers at
  a barrier in storage and holds until all T have arrived (or `--hold` seconds pass). The concurrency reached
  is the largest number of workers holding at once, against the concurrency requested (T, or what the GPUs
  allow at S). Tune's scheduling overhead: from fit() to each trial's driver, and from driver to worker.
- compare (real GPUs): the same small training job swept with `gpu_share: auto` and with whole-GPU trials
  for the same number of trials, side by side in one run: trials per hour, and mean GPU utilization sampled
  with nvidia-smi during each sweep (none on logical GPUs).
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from elastic.bench import packing_floor as floor
from elastic.config.spec import JobSpec
from elastic.config.sweep_spec import SweepSpec
from elastic.errors import ClusterError
from elastic.placement import packing
from elastic.storage import parse_uri
from elastic.sweep.layout import TRIAL_FILE, read_json
from elastic.sweep.runner import market_gpus, run_sweep
from elastic.worker.sharing import GPUS_FILE

BARRIER = "barrier"


# ---------------------------------------------------------------------------------------------------------
# Worker side: the jobs the bench sweeps (entrypoints elastic.bench.packing:hold and :train_small)


def hold(session) -> None:
    """Register at the barrier, hold until every requested trial has arrived (or the timeout), report when."""
    import torch

    model = torch.nn.Linear(8, 8)
    session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    session.finish(floor.hold_at_barrier(session.config, session.run_name if session.is_chief else None))


def train_small(session) -> None:
    """A small MLP trained for a fixed number of steps (the trial of the GPU comparison)."""
    import torch
    import torch.nn.functional as F

    cfg = session.config
    width, batch = int(cfg.get("width", 1024)), int(cfg.get("batch", 256))
    torch.manual_seed(int(cfg.get("seed", 0)))
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )
    model, optimizer = session.prepare(model, torch.optim.AdamW(model.parameters(), lr=float(cfg.get("lr", 1e-3))))
    session.restore()
    x = torch.randn(batch, width, device=session.device)
    y = torch.randint(0, 10, (batch,), device=session.device)
    while session.step_count < int(cfg.get("steps", 300)):
        loss = F.cross_entropy(model(x), y)
        session.optimize(loss, {"loss": loss.item()})
    session.finish({"loss": loss.item()})


# ---------------------------------------------------------------------------------------------------------
# Driver side


def _job(name: str, entrypoint: str, uri: str, config: dict, cpus: float, market: str = "any") -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": name,
            "entrypoint": entrypoint,
            "config": config,
            "workers": {"min": 1, "cpus": cpus, "market": market},
            "checkpoint": {"uri": uri, "every_steps": 10**9},
            "failure": {"max_failures": 0},
        }
    )


def bench_concurrency(
    uri: str,
    share: float,
    trials: int | None,
    hold_s: float,
    cpus: float,
    say: Callable[[str], None],
    market: str = "any",
    with_floor: bool = True,
    light: bool = True,
) -> dict:
    """T trials holding at share S through the real sweep path; with the floor, the same hold as plain Tune
    function trainables right after (elastic.bench.packing_floor), and ours over theirs."""
    gpus = market_gpus(market)
    if gpus <= 0:
        raise ClusterError(
            "no GPUs on the cluster's worker nodes; start the local stack with --gpus-per-node 1 "
            "(logical GPUs) or run on a GPU cluster"
        )
    per_gpu = max(1, math.floor(1 / share + 1e-9))
    trials = trials or int(per_gpu * gpus)
    requested = min(trials, packing.concurrency_cap(per_gpu, gpus, 1))
    stamp = f"{time.strftime('%m%d%H%M%S')}-{uuid.uuid4().hex[:4]}"
    name = f"bench-packing-{stamp}"
    barrier = parse_uri(uri).child(name, BARRIER).uri
    job = _job(
        name,
        "elastic.bench.packing:hold",
        uri,
        {"hold": hold_s, "requested": requested, "barrier": barrier},
        cpus,
        market,
    )
    sweep = SweepSpec.model_validate(
        {
            "name": name,
            "job": "(built in)",
            "space": {"seed": {"grid": list(range(trials))}},
            "metric": "left",
            "mode": "max",
            "gpu_share": share,
            "max_concurrent": trials,
            "storage": uri,
            "max_failures": 0,
            "light_trials": light,
        }
    )
    say(
        f"bench packing: {trials} {'light' if light else 'worker-group'} trial(s) at share {share} on {gpus:g} "
        f"{market} GPU(s); requested concurrency "
        f"{requested}"
    )
    started = time.time()
    marker = floor.local_stack_marker()
    with floor.RayMemorySampler(marker) as memory:
        result = run_sweep(sweep, job, say=say)
    ended = time.time()
    summary = summarize_concurrency(result, uri, name, share, gpus, trials, requested, started, ended)
    summary["market"] = market
    summary["light_trials"] = light
    ours = {
        "ram_per_trial_mb": memory.per_trial_mb(trials),
        "driver_to_worker_seconds": summary.pop("_driver_to_worker_seconds"),
    }
    summary["ours"] = ours
    if with_floor:
        say(f"bench packing: the floor, {trials} plain Tune function trainable(s) at share {share}")
        plain = floor.bench_plain_tune(uri, name, share, trials, requested, hold_s, cpus, market, marker)
        summary.update({"plain_tune": plain, **floor.floor_ratios(ours, plain)})
    return summary


def summarize_concurrency(
    result: dict,
    uri: str,
    name: str,
    share: float,
    gpus: float,
    trials: int,
    requested: int,
    started: float,
    ended: float,
) -> dict:
    intervals, driver_delay, startup, per_gpu = [], [], [], {}
    for trial in result["trials"]:
        run = parse_uri(uri).child(name, "train", f"{name}-{trial['trial_id']}")
        record = read_json(run.child(TRIAL_FILE).uri) or {}
        gpus_seen = read_json(run.child(GPUS_FILE).uri) or []
        for entry in gpus_seen:
            for gpu in entry["gpus"]:
                per_gpu.setdefault(f"{entry['node'][:8]}:{gpu}", []).append(trial["trial_id"])
        metrics = trial.get("final_metrics") or {}
        if "arrived" in metrics:
            intervals.append((metrics["arrived"], metrics["left"]))
        if record.get("attempts"):
            first = record["attempts"][0]["started"]
            driver_delay.append(first - started)
            if "arrived" in metrics:
                startup.append(metrics["arrived"] - first)
    reached = packing.max_overlap(intervals)
    mean = floor.mean_of
    return {
        "_driver_to_worker_seconds": mean([a - started for a, _ in intervals]),
        "share": share,
        "gpus": gpus,
        "trials": trials,
        "requested_concurrency": requested,
        "reached_concurrency": reached,
        "trials_per_gpu": {k: len(v) for k, v in sorted(per_gpu.items())},
        "wall_s": round(ended - started, 1),
        "scheduling_overhead_s": {
            "fit_to_trial_driver_mean": mean(driver_delay),
            "fit_to_trial_driver_max": round(max(driver_delay), 2) if driver_delay else None,
            "driver_to_worker_mean": mean(startup),
            "driver_to_worker_max": round(max(startup), 2) if startup else None,
            "fit_to_all_workers": round(max(a for a, _ in intervals) - started, 2) if intervals else None,
        },
        "errors": result["errors"],
    }


# ---------------------------------------------------------------------------------------------------------
# Real GPUs: auto against whole-GPU trials


class UtilizationSampler:
    """Mean GPU utilization from nvidia-smi, sampled every second in a thread (None without nvidia-smi)."""

    def __init__(self):
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self):
        while not self._stop.wait(1.0):
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout
                values = [float(v) for v in out.split()]
                if values:
                    self.samples.append(sum(values) / len(values))
            except (OSError, ValueError, subprocess.SubprocessError):
                pass  # a missed sample: the mean uses the others

    @property
    def mean(self) -> float | None:
        return round(sum(self.samples) / len(self.samples), 1) if self.samples else None


def bench_compare(
    uri: str, trials: int, steps: int, width: int, batch: int, gpu_memory_gb: float | None, say: Callable[[str], None]
) -> dict:
    """The same sweep of small trials with gpu_share auto, then 1.0; trials per hour and GPU utilization."""
    stamp = f"{time.strftime('%m%d%H%M%S')}-{uuid.uuid4().hex[:4]}"
    rows: dict[str, Any] = {}
    for label, share in (("auto", "auto"), ("whole_gpu", 1.0)):
        name = f"bench-compare-{label.replace('_', '-')}-{stamp}"
        job = _job(
            name, "elastic.bench.packing:train_small", uri, {"steps": steps, "width": width, "batch": batch}, cpus=0.25
        )
        packing_cfg = {"max_per_gpu": 8, "probe_steps": 20, "max_oom_retries": 2}
        if gpu_memory_gb:
            packing_cfg.update(gpu_memory_gb=gpu_memory_gb, device_memory_gb=16)
        sweep = SweepSpec.model_validate(
            {
                "name": name,
                "job": "(built in)",
                "space": {"seed": {"grid": list(range(trials))}},
                "metric": "loss",
                "mode": "min",
                "gpu_share": share,
                "storage": uri,
                "packing": packing_cfg,
            }
        )
        say(f"bench compare: {label}: {trials} trials of {steps} steps")
        with UtilizationSampler() as sampler:
            started = time.monotonic()
            result = run_sweep(sweep, job, say=say)
            seconds = time.monotonic() - started
        finished = sum(t["state"] == "TERMINATED" for t in result["trials"])
        rows[label] = {
            "trials_finished": finished,
            "seconds": round(seconds, 1),
            "trials_per_hour": round(finished * 3600 / seconds, 1),
            "mean_gpu_util": sampler.mean,
            "trials_per_gpu": result["plan"]["trials_per_gpu"],
            "share": result["plan"]["share"],
            "oom_retries": sum(t["ooms"] for t in result["trials"]),
            "errors": result["errors"],
        }
    whole = rows["whole_gpu"]["trials_per_hour"] or 1e-9
    return {
        **rows,
        "speedup": round(rows["auto"]["trials_per_hour"] / whole, 2),
        "lost_to_oom": rows["auto"]["errors"] + rows["whole_gpu"]["errors"],
        "cuda": _cuda(),
    }


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def default_uri() -> str:
    return os.environ.get("ELASTIC_BENCH_URI", "")
