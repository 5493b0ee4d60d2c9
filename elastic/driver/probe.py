"""A probe: a short run of a job on a whole GPU that measures its step time and, on CUDA, its peak device memory
(elastic.worker.sharing writes `probe.json`). Sweeps probe their first configuration, packs every job, and a run
submitted with `workers.gpus: auto` itself, to size its GPU share (`auto_share`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from elastic.checkpoint.store import run_directory
from elastic.config.spec import JobSpec
from elastic.driver.fitting import fit_run
from elastic.errors import UserError
from elastic.placement import packing
from elastic.storage import fsspec_filesystem, parse_uri
from elastic.worker.sharing import PROBE_FILE, TrialSharing

GB = 1024**3
PROBE_STEPS = 20


def probe_run(job: JobSpec, run_name: str, steps: int, say: Callable[[str], None]) -> dict:
    """Fit `job` under `run_name` for `steps` optimizer steps on a whole GPU (no checkpoint is written); what
    its workers measured, or {} when they wrote nothing."""
    job = job.model_copy(
        update={"checkpoint": job.checkpoint.model_copy(update={"every_steps": 10**9, "every_seconds": None})}
    )
    say(f"probe: {steps} steps of {run_name} on a whole GPU")
    started = time.monotonic()
    fit_run(
        job,
        run_name,
        "",
        [],
        TrialSharing(
            share=1.0,
            memory_fraction=1.0,
            strategy=packing.rank_placement(job.workers.min, 1.0),
            probe_steps=steps,
        ),
    )
    measured = _read_json(parse_uri(run_directory(job, run_name)).child(PROBE_FILE).uri) or {}
    say(f"probe: done in {time.monotonic() - started:.0f} s: {json.dumps(measured)}")
    return measured


def measured_probe(measured: dict) -> packing.Probe | None:
    """The probe's CUDA measure as a packing.Probe; None without CUDA (no device memory was measured)."""
    if not measured.get("cuda"):
        return None
    return packing.Probe(measured["peak_bytes"], measured["device_bytes"], measured["step_seconds"], "measured")


def auto_share(job: JobSpec, run_name: str, say: Callable[[str], None]) -> tuple[float, str]:
    """`workers.gpus: auto`: probe the job on a whole GPU and size its share from its measured peak memory
    (elastic.placement.packing.plan_packing). Returns (share, reason). Logical GPUs measure no memory: a
    UserError naming the fix."""
    whole = job.model_copy(update={"workers": job.workers.model_copy(update={"gpus": 1.0})})
    probe = measured_probe(probe_run(whole, f"{run_name}-probe", PROBE_STEPS, say))
    if probe is None:
        raise UserError(
            "workers.gpus: auto sizes the share from the GPU memory a probe measures, and this cluster's GPUs "
            "measured none (no CUDA); give workers.gpus a fraction, e.g. 0.5"
        )
    plan = packing.plan_packing(probe)
    return plan.share, plan.reason


def _read_json(uri: str):
    fs, path = fsspec_filesystem(uri)
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as handle:
        return json.load(handle)
