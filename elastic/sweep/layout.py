"""Where a sweep keeps its state in storage: <root>/<sweep>/ is Tune's experiment folder;
<root>/<sweep>/elastic-sweep.json holds the packing plan (so a restored sweep keeps it); trial runs live in
<root>/<sweep>/train/<run name>/ with `elastic-trial.json` (attempts, shares, the checkpoint step each attempt
resumed from)."""

from __future__ import annotations

import json
from typing import Any

from elastic.config.spec import JobSpec
from elastic.config.sweep_spec import SweepSpec
from elastic.storage import fsspec_filesystem, parse_uri

PLAN_FILE = "elastic-sweep.json"
TRIAL_FILE = "elastic-trial.json"


def experiment_uri(sweep: SweepSpec, job: JobSpec) -> str:
    return parse_uri(sweep.storage or job.checkpoint.uri).child(sweep.name).uri


def train_root(sweep: SweepSpec, job: JobSpec) -> str:
    return parse_uri(experiment_uri(sweep, job)).child("train").uri


def read_json(uri: str) -> Any:
    fs, path = fsspec_filesystem(uri)
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as handle:
        return json.load(handle)


def write_json(uri: str, data: Any) -> None:
    fs, path = fsspec_filesystem(uri)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "w") as handle:
        json.dump(data, handle, indent=2, default=str)
