"""A run's folder and its summary: where a run keeps its checkpoints (<checkpoint.uri>/<run name>) and the
summary the driver writes there at the end (read by `elastic status` and the demo)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from elastic.checkpoint.store import run_directory
from elastic.config.spec import JobSpec
from elastic.storage import fsspec_filesystem, parse_uri

SUMMARY_FILE = "elastic-summary.json"


@dataclass(frozen=True)
class RunSummary:
    run_name: str
    run_uri: str
    status: str
    metrics: dict
    checkpoint: str | None
    error: str | None
    seconds: float
    # spot-first: every placement in order, e.g. [{"market": "on-demand", "ended_at_step": 60, ...}, ...]
    placements: list = field(default_factory=list)


def read_summary(spec: JobSpec, run_name: str) -> dict | None:
    fs, path = fsspec_filesystem(run_directory(spec, run_name))
    target = f"{path}/{SUMMARY_FILE}"
    if not fs.exists(target):
        return None
    with fs.open(target, "r") as handle:
        return json.load(handle)


def write_summary(spec: JobSpec, run_name: str, summary: RunSummary) -> None:
    fs, path = fsspec_filesystem(run_directory(spec, run_name))
    fs.makedirs(path, exist_ok=True)
    with fs.open(f"{path}/{SUMMARY_FILE}", "w") as handle:
        json.dump(asdict(summary), handle, indent=2, default=str)


def checkpoint_uri(spec: JobSpec, checkpoint) -> str | None:
    if checkpoint is None:
        return None
    location = parse_uri(spec.checkpoint.uri)
    return f"{location.scheme}://{checkpoint.path}" if location.is_object_store else checkpoint.path
