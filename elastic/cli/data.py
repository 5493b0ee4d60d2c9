"""`elastic data ...`: datasets in buckets (prepare, index, inspect), thin over elastic.data."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

import click
from rich.table import Table

from elastic.cli.common import console, print_json
from elastic.errors import ClusterError


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
@click.option("--shuffle-seed", type=int, help="Shuffle all rows once, globally, before writing (not with --address).")
@click.option(
    "--address",
    help="Convert as Ray tasks on this cluster (its GCS address HOST:6379, ray://HOST:10001, or auto), a task per "
    "source file or group of small files, written straight to DEST: SOURCE and DEST must be storage the nodes reach.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the dataset's summary as JSON.")
def data_prepare(
    source: str,
    dest: str,
    shard_mb: float,
    row_group_mb: float,
    shuffle_seed: int | None,
    address: str | None,
    as_json: bool,
) -> None:
    """Write SOURCE (Parquet, CSV, JSON lines, .npy/.npz, or module:function yielding dicts) to DEST as Parquet
    shards with a manifest. Safe to re-run.

    \b
    Examples:
      elastic data prepare data/digits.npz s3://elastic/datasets/digits --row-group-mb 0.05
      elastic data prepare corpus.jsonl s3://elastic/datasets/corpus --shuffle-seed 0
      elastic data prepare jobs/gen.py:rows ./dataset
      elastic data prepare s3://raw/events/ s3://elastic/datasets/events --address auto
    """
    if address:
        from elastic.data.prepare_ray import check_distributable

        check_distributable(source, shuffle_seed)  # before connecting: these need no cluster to be refused
        connected_here = _connect(address)
        import ray

        from elastic.data.prepare_ray import prepare_on_ray

        try:
            manifest = prepare_on_ray(source, dest, shard_mb=shard_mb, row_group_mb=row_group_mb)
        finally:
            if connected_here:
                ray.shutdown()
        _show(manifest.summary(), as_json)
        return
    from elastic.data.prepare import prepare

    _use_stack_storage()
    manifest = prepare(source, dest, shard_mb=shard_mb, row_group_mb=row_group_mb, shuffle_seed=shuffle_seed)
    _show(manifest.summary(), as_json)


def _connect(address: str) -> bool:
    """Join the cluster at `address` as a driver (ray.init) with its token auth, as the sweep's driver does
    (elastic.sweep.runner.connect); one line and exit 2 when it cannot. False when this process was connected
    already (it stays so)."""
    from elastic.driver.auth import auth_failure
    from elastic.local import stack as local

    if address.startswith(("http://", "https://")):
        raise ClusterError(
            f"--address {address} is a job API URL; give the cluster's GCS address (HOST:6379), ray://HOST:10001, "
            "or auto on a node of the cluster"
        )
    state = local.running_state()
    if state is not None and (
        address == state.ray_address
        or (address == "auto" and os.environ.get("RAY_ADDRESS") in (None, "", state.ray_address))
    ):
        state.use_storage()  # the stack's bucket (unless another endpoint is set) and its Ray auth, before `import ray`
        address = state.ray_address
    if address != "auto":
        _check_reachable(address)
    import ray  # only now: Ray reads RAY_AUTH_MODE once, when it is imported

    from elastic.data.prepare_ray import job_runtime_env

    if ray.is_initialized():
        return False
    try:
        ray.init(address=address, log_to_driver=False, runtime_env=job_runtime_env())
    except Exception as err:  # ConnectionError, auth refusals, a port that is not Ray's: all "cannot use it"
        refused = auth_failure(err, f"the Ray cluster at {address}")
        if refused is not None:
            raise refused from None
        first = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise ClusterError(
            f"cannot join the Ray cluster at {address} ({first}); start one (`elastic local up`) or pass its GCS "
            "address, HOST:6379"
        ) from None
    return True


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """One line within `timeout` for a HOST:PORT nothing answers at (ray.init would wait far longer)."""
    parsed = urlparse(address if "://" in address else f"gcs://{address}")
    try:
        host, port = parsed.hostname, parsed.port
    except ValueError:
        host, port = None, None
    if not host or not port:
        raise ClusterError(
            f"--address {address}: expected HOST:PORT (the GCS, e.g. 10.0.0.1:6379), ray://HOST:PORT or auto"
        )
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        why = err.strerror or str(err) or type(err).__name__
        raise ClusterError(
            f"cannot reach the Ray cluster at {address} ({why}); check --address "
            "(the head's GCS address, HOST:6379), that the cluster is up, and any tunnel"
        ) from None


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
