"""What the verb modules share: the console and JSON output."""

from __future__ import annotations

import json

import click
from rich.console import Console

console = Console(stderr=False, highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)  # progress, so stdout stays parseable


def print_json(data) -> None:
    click.echo(json.dumps(data, indent=2, default=str))
