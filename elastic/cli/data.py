"""`elastic data ...`: datasets in buckets (prepare, index, inspect), thin over elastic.data."""

from __future__ import annotations

import click
from rich.table import Table

from elastic.cli.common import console, print_json


@click.group("data")
def data_group() -> None:
    """Datasets in buckets: sharded Parquet committed by a manifest, streamed by elastic.data.StreamingDataset."""


def _use_stack_storage() -> None:
    """The local stack's bucket for s3:// URIs, unless another S3 endpoint is set."""
    from elastic.local import stack as local

    state = local.running_state()
    if state is not None:
        state.use_storage()


@data_group.command("prepare")
@click.argument("source")
@click.argument("dest")
@click.option("--shard-mb", default=128.0, show_default=True, type=click.FloatRange(min=0.01), help="Shard size.")
@click.option(
    "--row-group-mb", default=4.0, show_default=True, type=click.FloatRange(min=0.001), help="Row group size."
)
@click.option("--shuffle-seed", type=int, help="Shuffle all rows once, globally, before writing.")
@click.option("--json", "as_json", is_flag=True, help="Print the dataset's summary as JSON.")
def data_prepare(
    source: str, dest: str, shard_mb: float, row_group_mb: float, shuffle_seed: int | None, as_json: bool
) -> None:
    """Write SOURCE (Parquet, CSV, JSON lines, .npy/.npz, or module:function yielding dicts) to DEST as Parquet
    shards with a manifest. Safe to re-run.

    \b
    Examples:
      elastic data prepare data/digits.npz s3://elastic/datasets/digits --row-group-mb 0.05
      elastic data prepare corpus.jsonl s3://elastic/datasets/corpus --shuffle-seed 0
      elastic data prepare jobs/gen.py:rows ./dataset
    """
    from elastic.data.prepare import prepare

    _use_stack_storage()
    manifest = prepare(source, dest, shard_mb=shard_mb, row_group_mb=row_group_mb, shuffle_seed=shuffle_seed)
    _show(manifest.summary(), as_json)


@data_group.command("index")
@click.argument("uri")
@click.option("--json", "as_json", is_flag=True)
def data_index(uri: str, as_json: bool) -> None:
    """Build (or rebuild) the manifest of Parquet files written by anyone (Spark, pandas, Ray Data) from their
    footers.

    \b
    Example:
      elastic data index s3://elastic/datasets/events
    """
    from elastic.data.manifest import index

    _use_stack_storage()
    _show(index(uri).summary(), as_json)


@data_group.command("inspect")
@click.argument("uri")
@click.option("--json", "as_json", is_flag=True)
def data_inspect(uri: str, as_json: bool) -> None:
    """Rows, files, row groups, bytes, fingerprint and schema of a dataset (its manifest is built if missing).

    \b
    Example:
      elastic data inspect s3://elastic/datasets/digits --json
    """
    from elastic.data.manifest import load

    _use_stack_storage()
    _show(load(uri).summary(), as_json)


def _show(summary: dict, as_json: bool) -> None:
    if as_json:
        print_json(summary)
        return
    console.print(
        f"{summary['uri']}: {summary['rows']:,} rows in {summary['files']} file(s), {summary['row_groups']} row "
        f"group(s), {summary['bytes'] / 2**20:,.1f} MiB; fingerprint {summary['fingerprint']}"
    )
    table = Table("column", "type")
    for name, kind in summary["columns"].items():
        table.add_row(name, kind)
    console.print(table)
