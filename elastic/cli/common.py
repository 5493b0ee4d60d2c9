"""What the verb modules share: the console, JSON output and worker-count lists."""

from __future__ import annotations

import json

import click
from rich.console import Console

from elastic.errors import UserError

console = Console(stderr=False, highlight=False, soft_wrap=True)


def print_json(data) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


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
