"""`elastic bench ...`: checkpoint, overhead, packing and recovery benchmarks."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable
from dataclasses import asdict

import click
from rich.table import Table

from elastic.cli.common import console, print_json
from elastic.cli.remote import finish, remote_options, run_remotely
from elastic.driver.remote import remote_address
from elastic.errors import UserError


@click.group("bench")
def bench_group() -> None:
    """Benchmarks: ours and the baseline side by side in one run, as ratios (run them on your own bucket)."""


def _bench_target(uri: str | None, folder: str) -> str:
    """--uri, else the local stack's bucket (whose endpoint and credentials this process then uses)."""

    from elastic.local import stack as local

    state = local.running_state()
    if state is not None:
        state.use_storage()
    if uri:
        return uri
    if state is None:
        raise UserError("no --uri and no local stack; pass --uri s3://BUCKET/PREFIX or run `elastic local up`")
    return f"s3://{state.bucket}/{folder}"


def _show_bench(title: str, result: dict, ratios: dict[str, float]) -> None:
    table = Table("measure", "value")
    for key, value in result.items():
        table.add_row(key, str(value))
    console.print(f"[bold]{title}[/]")
    console.print(table)
    for key, target in ratios.items():
        value = result[key]
        lower = key in (
            "stall_ratio",
            "overhead_ratio",
            "harness_vs_agreed",
            "ckpt_overhead_ratio",
            "recovery_ratio",
            "read_amplification",
            "bytes_per_rank_ratio",
        )
        ok = value <= target if lower else value >= target
        console.print(f"{key} = {value} ({'meets' if ok else 'MISSES'} the target {'<=' if lower else '>='} {target})")


def parallelism_option(fsdp_means: str):
    return click.option(
        "--parallelism",
        type=click.Choice(["ddp", "fsdp"]),
        default="ddp",
        show_default=True,
        help=f"fsdp: {fsdp_means}.",
    )


@bench_group.command("checkpoint")
@click.option("--uri", help="Where to write (default: the local stack's s3://BUCKET/bench).")
@click.option("--size-mb", default=256.0, show_default=True, type=click.FloatRange(min=1), help="State size.")
@click.option("--workers", default=2, show_default=True, type=click.IntRange(1), help="Ranks (local processes).")
@click.option(
    "--repeats",
    default=7,
    show_default=True,
    type=click.IntRange(1),
    help="Timed repeats; ratios are the median of each repeat's paired ratio.",
)
@parallelism_option(
    "the state sharded with FSDP2 (each rank saves its own shards), measured beside ddp in the same run"
)
@click.option("--json", "as_json", is_flag=True)
@remote_options
def bench_checkpoint_cmd(
    uri: str | None,
    size_mb: float,
    workers: int,
    repeats: int,
    parallelism: str,
    as_json: bool,
    address: str | None,
    detach: bool,
) -> None:
    """Sharded async save and load against raw parallel multipart put/get of the same bytes, with torch's own
    path (DCP's FsspecWriter/FsspecReader and dcp.async_save) measured beside ours in the same run (torch_*).

    \b
    Examples:
      elastic bench checkpoint --size-mb 256 --workers 2 --json
      elastic bench checkpoint --parallelism fsdp --json   # bytes_per_rank_ratio, and the ratios beside ddp's
    """

    def measure() -> dict:
        from elastic.bench.checkpointing import bench_checkpoint

        target = _bench_target(uri, "bench")
        result = asdict(bench_checkpoint(target, size_mb, workers, repeats, parallelism=parallelism))
        if parallelism == "fsdp":  # the same state under ddp, in the same run: the ratios side by side
            ddp = asdict(bench_checkpoint(target, size_mb, workers, repeats, parallelism="ddp"))
            result["ddp"] = {k: ddp[k] for k in ("throughput_ratio", "load_ratio", "stall_ratio", "size_mb")}
            result["throughput_ratio_vs_ddp"] = round(result["throughput_ratio"] - ddp["throughput_ratio"], 3)
            result["load_ratio_vs_ddp"] = round(result["load_ratio"] - ddp["load_ratio"], 3)
        return result

    def show(result: dict) -> None:
        targets = {"throughput_ratio": 0.9, "load_ratio": 0.9, "stall_ratio": 0.02}
        if parallelism == "fsdp":
            targets["bytes_per_rank_ratio"] = round(1 / workers + 0.05, 3)
        _show_bench("checkpoint", result, targets)

    _run_bench("checkpoint", address, detach, as_json, measure, show)


@bench_group.command("overhead")
@click.option("--uri", help="Checkpoint root for the harness (default: the local stack's s3://BUCKET/bench).")
@click.option("--workers", default=2, show_default=True, type=click.IntRange(1))
@click.option(
    "--rounds",
    default=12,
    show_default=True,
    type=click.IntRange(1),
    help="Timed blocks per variant (one of each per round, in rotating order).",
)
@click.option(
    "--steps",
    default=40,
    show_default=True,
    type=click.IntRange(20),
    help="Steps per block (a multiple of the checkpoint interval, 20).",
)
@click.option("--width", default=1024, show_default=True, type=click.IntRange(8), help="MLP width (model size).")
@click.option("--batch", default=256, show_default=True, type=click.IntRange(1), help="Batch per worker.")
@parallelism_option("the bare loop is FSDP2 (fully_shard on each layer and the root) and the harness runs fsdp")
@click.option("--json", "as_json", is_flag=True)
@remote_options
def bench_overhead_cmd(
    uri: str | None,
    workers: int,
    rounds: int,
    steps: int,
    width: int,
    batch: int,
    parallelism: str,
    as_json: bool,
    address: str | None,
    detach: bool,
) -> None:
    """Harness step time against a bare Ray Train DDP (or FSDP2) loop: checkpoints off, and async every 20 steps.

    \b
    Example:
      elastic bench overhead --json
    """

    def measure() -> dict:
        from elastic.bench.overhead import bench_overhead

        target = _bench_target(uri, "bench")
        return asdict(
            bench_overhead(
                target, workers=workers, rounds=rounds, steps=steps, width=width, batch=batch, parallelism=parallelism
            )
        )

    def show(result: dict) -> None:
        if result.get("harness_vs_agreed") is not None:  # fsdp: its target, and its floor's
            targets = {"overhead_ratio": 1.05, "harness_vs_agreed": 1.05, "ckpt_overhead_ratio": 1.05}
        else:
            targets = {"overhead_ratio": 1.02, "ckpt_overhead_ratio": 1.05}
        _show_bench("overhead", result, targets)

    _run_bench("overhead", address, detach, as_json, measure, show)


def _run_bench(
    name: str, address: str | None, detach: bool, as_json: bool, measure: Callable[[], dict], show: Callable
) -> None:
    """Measure here, or, given a job API address, run this benchmark there as a Ray job; show it either way."""
    if address := remote_address(address):
        result = run_remotely(address, f"bench {name}", as_json, detach)
        if result is None:
            return
    else:
        result = measure()
    finish(result, as_json, show)


@bench_group.command("packing")
@click.option(
    "--share",
    default=0.25,
    show_default=True,
    type=click.FloatRange(0, 1, min_open=True),
    help="GPU share of each trial.",
)
@click.option("--trials", type=click.IntRange(1), help="Trials (default: 1/share per GPU of the cluster).")
@click.option(
    "--hold",
    "hold_s",
    default=180.0,
    show_default=True,
    type=click.FloatRange(1),
    help="Longest a trial waits at the barrier for the others.",
)
@click.option(
    "--cpus",
    default=0.05,
    show_default=True,
    type=click.FloatRange(0, min_open=True),
    help="CPUs per trial worker (logical accounting).",
)
@click.option(
    "--market",
    default="any",
    show_default=True,
    type=click.Choice(["any", "spot", "on-demand"]),
    help="Worker nodes whose GPUs the trials share.",
)
@click.option(
    "--floor/--no-floor",
    "with_floor",
    default=True,
    show_default=True,
    help="Also run the same hold as plain Tune function trainables: memory per trial and start, ours over theirs.",
)
@click.option(
    "--light/--no-light",
    default=True,
    show_default=True,
    help="Our trials as light ones (in the trainable's process) or each with a Ray Train worker group.",
)
@click.option("--compare", is_flag=True, help="Real GPUs: auto against whole-GPU trials (trials/hour, GPU util).")
@click.option("--steps", default=300, show_default=True, type=click.IntRange(1), help="--compare: steps per trial.")
@click.option("--width", default=1024, show_default=True, type=click.IntRange(8), help="--compare: MLP width.")
@click.option("--batch", default=256, show_default=True, type=click.IntRange(1), help="--compare: batch size.")
@click.option(
    "--gpu-memory-gb",
    type=click.FloatRange(0, min_open=True),
    help="--compare without CUDA (dry run): declared peak per trial on a 16 GB logical GPU.",
)
@click.option("--uri", help="Storage root (default: the local stack's s3://BUCKET/bench).")
@click.option("--json", "as_json", is_flag=True)
@remote_options
def bench_packing_cmd(
    share: float,
    trials: int | None,
    hold_s: float,
    cpus: float,
    market: str,
    with_floor: bool,
    light: bool,
    compare: bool,
    steps: int,
    width: int,
    batch: int,
    gpu_memory_gb: float | None,
    uri: str | None,
    as_json: bool,
    address: str | None,
    detach: bool,
) -> None:
    """GPU sharing: concurrency reached against requested, and Tune's scheduling overhead (logical GPUs work);
    with --compare, trials per hour and GPU utilization of `auto` against whole-GPU trials (real GPUs).

    \b
    Example:
      elastic local up --spot 2 --on-demand 1 --gpus-per-node 2 --cpus-per-node 2
      elastic bench packing --share 0.25 --json
    """

    def measure() -> dict:
        from elastic.bench import packing as bench_packing
        from elastic.sweep import runner as sweeps

        target = _bench_target(uri, "bench")
        sweeps.connect()
        say = lambda m: click.echo(f"[bench] {m}", err=True)
        with contextlib.redirect_stdout(sys.stderr):  # Tune prints its own banners
            if compare:
                result = bench_packing.bench_compare(target, trials or 8, steps, width, batch, gpu_memory_gb, say)
            else:
                result = bench_packing.bench_concurrency(
                    target, share, trials, hold_s, cpus, say, market, with_floor, light
                )
            sweeps.disconnect()
        return result

    def show(result: dict) -> None:
        _show_bench("packing", {k: json.dumps(v) if isinstance(v, dict) else v for k, v in result.items()}, {})

    _run_bench("packing", address, detach, as_json, measure, show)


@bench_group.command("recovery")
@click.option("--notice", default=20.0, show_default=True, type=click.FloatRange(1), help="Seconds of notice.")
@click.option("--workers", default=2, show_default=True, type=click.IntRange(1))
@click.option("--minutes", type=click.FloatRange(0), help="Also measure goodput over a run this long ...")
@click.option(
    "--every",
    default=120.0,
    show_default=True,
    type=click.FloatRange(10),
    help="... with a noticed reclaim every this many seconds.",
)
@click.option("--json", "as_json", is_flag=True)
@remote_options
def bench_recovery_cmd(
    notice: float, workers: int, minutes: float | None, every: float, as_json: bool, address: str | None, detach: bool
) -> None:
    """What a spot reclaim costs on the local cluster, ours against Ray Train's own restart of a bare loop:
    steps lost with and without notice, seconds from node death to the first resumed step, and goodput.

    \b
    Example (about 5 minutes; with --minutes 10, 15):
      elastic local up --spot 3 --on-demand 1
      elastic bench recovery --json
      elastic bench recovery --minutes 10 --every 120 --json
    """

    def measure() -> dict:
        from elastic.bench import recovery as bench_recovery

        log = (lambda line: click.echo(line, err=True)) if as_json else click.echo
        return asdict(
            bench_recovery.bench_recovery(notice=notice, workers=workers, minutes=minutes, every=every, log=log)
        )

    def show(result: dict) -> None:
        targets = {"recovery_ratio": 1.1}
        _show_bench("recovery", result, targets)
        console.print(f"lost_steps_notice = {result['lost_steps_notice']} (target 0)")
        if result["goodput"] is not None:
            console.print(f"goodput = {result['goodput']} (target >= 0.9)")

    _run_bench("recovery", address, detach, as_json, measure, show)


@bench_group.command("s3")
@click.option(
    "--server",
    "servers",
    multiple=True,
    type=click.Choice(["seaweedfs", "moto"]),
    help="A server to measure (repeatable; default: every one `elastic local up --s3` offers).",
)
@click.option("--size-mb", default=16.0, show_default=True, type=click.FloatRange(min=0.01), help="Object size.")
@click.option("--objects", default=32, show_default=True, type=click.IntRange(1), help="Objects put, then got.")
@click.option("--threads", default=4, show_default=True, type=click.IntRange(1), help="Concurrent requests.")
@click.option("--json", "as_json", is_flag=True)
def bench_s3_cmd(servers: tuple[str, ...], size_mb: float, objects: int, threads: int, as_json: bool) -> None:
    """The local S3 servers side by side: start time, put/get MB/s, server CPU per GB, peak memory, persistence.

    Each server is started fresh on 127.0.0.1 in a temp dir (not the stack's), so this runs with or without
    a local stack.

    \b
    Example:
      elastic bench s3 --json
    """
    from elastic.bench import s3 as bench
    from elastic.local import s3servers

    result = bench.bench_s3(list(servers) or list(s3servers.SERVERS), size_mb=size_mb, objects=objects, threads=threads)
    if as_json:
        print_json(result)
        return
    columns = ["server", "start_seconds", "put_mb_s", "get_mb_s", "cpu_seconds_per_gb", "peak_rss_mb"]
    table = Table(*columns, "pyarrow", "kept across restart")
    for row in result["servers"]:
        table.add_row(*[str(row[c]) for c in columns], str(row["pyarrow_round_trip"]), str(row["kept_across_restart"]))
    console.print(f"[bold]s3[/] ({objects} objects of {size_mb} MB, {threads} threads, through s3fs)")
    console.print(table)


@bench_group.command("data")
@click.argument("uri", required=False)
@click.option("--ranks", default=2, show_default=True, type=click.IntRange(1), help="Ranks reading one epoch.")
@click.option("--rows", default=200_000, show_default=True, type=click.IntRange(1), help="Rows of the generated set.")
@click.option("--row-bytes", default=1024, show_default=True, type=click.IntRange(32), help="Bytes a generated row.")
@click.option("--shuffle-window", default=64, show_default=True, type=click.IntRange(1), help="Row groups a window.")
@click.option("--synthetic-rows", type=float, help="Measure the epoch order alone on a manifest of this many rows.")
@click.option("--no-peers", is_flag=True, help="Skip the Ray Data and MosaicML Streaming reads of the same rows.")
@click.option("--json", "as_json", is_flag=True)
def bench_data_cmd(
    uri: str | None,
    ranks: int,
    rows: int,
    row_bytes: int,
    shuffle_window: int,
    synthetic_rows: float | None,
    no_peers: bool,
    as_json: bool,
) -> None:
    """Streaming a dataset from a bucket: sequential and block-shuffled rows/s beside raw parallel GETs, a
    pyarrow scan of the same files and the floor of fetching and decoding the same row groups, read
    amplification, a small DDP loop fed from the bucket beside the same loop fed from memory (and beside its
    floor); or (--synthetic-rows) the epoch order's memory and
    first-batch time at that size beside torch.randperm's.

    \b
    Examples:
      elastic bench data --json                       # a generated dataset in the local stack's bucket
      elastic bench data s3://my-bucket/datasets/x    # your own dataset (its manifest is built if missing)
      elastic bench data --synthetic-rows 1e9 --json
    """
    from elastic.bench import data as bench

    if synthetic_rows is not None:
        result = bench.bench_order(int(synthetic_rows), row_groups=max(1, int(synthetic_rows) // 10_000))
        ratios: dict[str, float] = {}
    else:
        if uri is None:
            uri = bench.generated_dataset(
                _bench_target(None, f"bench/data-{rows}-{row_bytes}-1mb-groups"), rows, row_bytes, row_group_mb=1.0
            )
        else:
            _bench_target(uri, "")
        result = bench.bench_data(uri, ranks=ranks, shuffle_window=shuffle_window, peers=not no_peers)
        ratios = {"shuffled_vs_raw": 0.8, "shuffled_vs_sequential": 0.9, "train_vs_memory": 0.8, "quality": 0.95}
        # Against the floors measured beside them (elastic.bench.data_floor): what the machine lets any reader do.
        ratios |= {"shuffled_vs_fetch_decode": 0.8, "train_vs_floor": 0.8}
        ratios["read_amplification"] = 1.1
    if as_json:
        print_json(result)
    else:
        _show_bench("data", result, ratios)
