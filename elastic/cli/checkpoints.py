"""`elastic checkpoints ...`: list and verify a run's checkpoints."""

from __future__ import annotations

import sys

import click
from rich.table import Column, Table

from elastic.cli.common import console, print_json, resolve_run_uri
from elastic.errors import UserError


@click.group("checkpoints")
def checkpoints_group() -> None:
    """Inspect a run's checkpoints: RUN is a run URI (s3://bucket/runs/NAME) or a run name under --root."""


def _store(run: str, root: str | None):
    from elastic.checkpoint.store import CheckpointStore

    return CheckpointStore(resolve_run_uri(run, root))


@checkpoints_group.command("ls")
@click.argument("run")
@click.option("--root", help="Runs root (the job's checkpoint.uri); default: the local stack's s3://BUCKET/runs.")
@click.option("--json", "as_json", is_flag=True)
def checkpoints_ls(run: str, root: str | None, as_json: bool) -> None:
    """List checkpoints: step, time, size, shards, committed or not, and why each was written.

    \b
    Example:
      elastic checkpoints ls digits-ddp
    """
    import datetime

    store = _store(run, root)
    infos = store.list()
    if as_json:
        print_json([i.to_json() for i in infos])
        return
    if not infos:
        click.echo(f"no checkpoints under {store.run_uri}")
        return
    # Fits 80 columns (a pipe, a CI log): the year is left out of the time, `--json` has the timestamp.
    table = Table(
        "step",
        Column("time (UTC)", no_wrap=True),
        "size",
        "shards",
        "workers",
        "commit",
        Column("reason", no_wrap=True),
    )
    for info in infos:
        when = (
            datetime.datetime.fromtimestamp(info.time, datetime.timezone.utc).strftime("%m-%d %H:%M:%S")
            if info.time
            else "-"
        )
        table.add_row(
            str(info.step),
            when,
            f"{info.size_bytes / 1e6:.2f} MB",
            str(info.shards),
            str(info.world_size or "-"),
            "yes" if info.committed else "[red]no[/]",
            info.reason or "-",
        )
    console.print(table)


@checkpoints_group.command("verify")
@click.argument("run")
@click.argument("step", required=False, type=int)
@click.option("--root", help="Runs root (the job's checkpoint.uri).")
def checkpoints_verify(run: str, step: int | None, root: str | None) -> None:
    """Check every shard of a checkpoint (default: the latest committed) is present and sized as recorded.
    Exits 1 naming the missing pieces otherwise."""
    store = _store(run, root)
    if step is None:
        latest = store.latest_committed()
        if latest is None:
            raise UserError(f"no committed checkpoint under {store.run_uri}")
        step = latest.step
    problems = store.verify(step)
    if problems:
        for problem in problems:
            click.echo(f"{store.uri(step)}: {problem}", err=True)
        sys.exit(1)
    info = store.info(step)
    click.echo(f"{info.uri}: ok ({info.shards} shards, {info.size_bytes / 1e6:.2f} MB, {info.world_size} workers)")
