"""What the verb modules share: the console, JSON output and worker-count lists."""

from __future__ import annotations

import json
import os

import click
from rich.console import Console

from elastic.errors import UserError

console = Console(stderr=False, highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)  # progress, so stdout stays parseable


def print_json(data) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def resolve_run_uri(run: str, root: str | None) -> str:
    """A run (or sweep) URI from what the user typed: a URI or absolute path as is, else a name under `root`
    (default: $ELASTIC_RUNS_URI, then the local stack's s3://BUCKET/runs, whose storage this process then uses)."""
    from elastic.local import stack as local  # deferred: the stack's state is read only for a run name

    state = local.running_state()
    if state is not None:
        state.use_storage()
    if "://" in run or run.startswith("/"):
        return run.rstrip("/")
    root = root or os.environ.get("ELASTIC_RUNS_URI") or (f"s3://{state.bucket}/runs" if state else None)
    if not root:
        raise UserError(
            f"'{run}' is a run name but no runs root is known; pass --root s3://BUCKET/PREFIX or a full run URI"
        )
    return f"{root.rstrip('/')}/{run}"


def worker_counts(text: str | None, default: int) -> list[int]:
    """--workers: a count or the counts a run moves through, e.g. 2 or 2,1,2 (default: [default])."""
    if not text:
        return [default]
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or any(c < 1 for c in counts):
        raise UserError(f"--workers {text!r}: expected a count or counts like 2 or 2,1,2")
    return counts
