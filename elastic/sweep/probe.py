"""A probe: a short run of a job on a whole GPU that measures its step time and, on CUDA, its peak device memory
(elastic.worker.sharing writes `probe.json`). Sweeps probe their first configuration, packs every job."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from elastic.checkpoint.store import run_directory
from elastic.config.spec import JobSpec
from elastic.driver.fitting import fit_run
from elastic.placement import packing
from elastic.storage import parse_uri
from elastic.sweep.layout import read_json
from elastic.worker.sharing import PROBE_FILE, TrialSharing

GB = 1024**3


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
    measured = read_json(parse_uri(run_directory(job, run_name)).child(PROBE_FILE).uri) or {}
    say(f"probe: done in {time.monotonic() - started:.0f} s: {json.dumps(measured)}")
    return measured


def measured_probe(measured: dict) -> packing.Probe | None:
    """The probe's CUDA measure as a packing.Probe; None without CUDA (no device memory was measured)."""
    if not measured.get("cuda"):
        return None
    return packing.Probe(measured["peak_bytes"], measured["device_bytes"], measured["step_seconds"], "measured")
