"""The `elastic` command: thin; every verb calls library functions.

User errors print one line and exit 2; a job that fails exits 1.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Column, Table

from elastic.errors import ElasticError, JobFailed, UserError

console = Console(stderr=False, highlight=False, soft_wrap=True)


def _print_json(data) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="elastic-train")
def cli() -> None:
    """Elastic PyTorch training on spot and on-demand Ray clusters.

    \b
    Example:
      elastic local up
      elastic submit jobs/digits_ddp.yaml --follow
      elastic local down
    """


# ---------------------------------------------------------------------------------------------------------
# local


@cli.group("local")
def local_group() -> None:
    """The embedded local cluster: a Ray head, simulated spot/on-demand nodes and an S3 endpoint."""


@local_group.command("up")
@click.option("--spot", default=3, show_default=True, type=click.IntRange(0),
              help="Spot worker nodes (3: a 2-worker job plus one spare, so a reclaimed node's work goes on at once).")
@click.option("--on-demand", default=1, show_default=True, type=click.IntRange(0), help="On-demand worker nodes.")
@click.option("--cpus-per-node", default=1, show_default=True, type=click.IntRange(1), help="CPUs per worker node.")
@click.option("--gpus-per-node", default=0, show_default=True, type=click.IntRange(0),
              help="Logical GPUs per worker node (GPU-requesting paths run on a CPU-only machine).")
@click.option("--json", "as_json", is_flag=True, help="Print addresses and nodes as JSON.")
def local_up(spot: int, on_demand: int, cpus_per_node: int, gpus_per_node: int, as_json: bool) -> None:
    """Start the local stack (or show it if it is already up).

    \b
    Example:
      elastic local up --spot 2 --on-demand 1 --json
    """
    from elastic.local import stack as local

    state = local.up(spot=spot, on_demand=on_demand, gpus_per_node=gpus_per_node, cpus_per_node=cpus_per_node)
    if as_json:
        _print_json(state.summary())
    else:
        _show_stack(state.summary())
        console.print("Use it from this shell: [bold]eval \"$(elastic local env)\"[/]; stop it: [bold]elastic local down[/]")


@local_group.command("down")
def local_down() -> None:
    """Stop exactly what `elastic local up` started. Safe to run twice."""
    from elastic.local import stack as local

    stopped = local.down()
    click.echo(f"local stack stopped ({stopped} processes)" if stopped else "no local stack running")


@local_group.command("status")
@click.option("--json", "as_json", is_flag=True)
def local_status(as_json: bool) -> None:
    """Show the local stack's addresses, nodes and processes."""
    from elastic.local import stack as local

    info = local.status()
    if as_json:
        _print_json(info)
    elif not info["running"]:
        click.echo("no local stack running (start one with `elastic local up`)")
    else:
        _show_stack(info)
        dead = [role for role, alive in info["processes"].items() if not alive]
        if dead:
            console.print(f"[yellow]not running:[/] {', '.join(dead)}")


@local_group.command("env")
@click.option("--json", "as_json", is_flag=True)
def local_env(as_json: bool) -> None:
    """Print shell exports so Ray's CLI, boto3 and s3fs use the local stack: eval "$(elastic local env)"."""
    from elastic.local import stack as local

    state = local.running_state()
    if state is None:
        raise UserError("no local stack running; start one with `elastic local up`")
    if as_json:
        _print_json({"env": state.env()})
    else:
        for key, value in state.env().items():
            click.echo(f"export {key}={value}")


def _show_stack(info: dict) -> None:
    console.print(f"Ray:        {info['ray_address']}   job API: {info['dashboard_url']}")
    console.print(f"S3:         {info['s3_endpoint']}   bucket: {info['bucket']}")
    table = Table("node", "market", "role", "cpus", "gpus", "node id")
    for node in info["nodes"]:
        table.add_row(node["name"], node["market"], node["role"], str(node["cpus"]), str(node["gpus"]),
                      node["node_id"][:12])
    console.print(table)


# ---------------------------------------------------------------------------------------------------------
# specs


@cli.group("spec")
def spec_group() -> None:
    """Job spec tools."""


@spec_group.command("schema")
def spec_schema() -> None:
    """Print the JSON Schema of job files (for editors: yaml-language-server)."""
    from elastic.config.spec import dump_schema

    click.echo(dump_schema())


@spec_group.command("check")
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="FIELD=VALUE")
def spec_check(job_file: Path, overrides: tuple[str, ...]) -> None:
    """Validate a job file and print it with defaults filled in."""
    from elastic.config.spec import load_job_spec

    spec = load_job_spec(job_file, overrides)
    _print_json(spec.model_dump(mode="json"))


# ---------------------------------------------------------------------------------------------------------
# jobs


@cli.command("submit")
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--address", help="Ray job API, e.g. http://127.0.0.1:8265 (default: the local stack).")
@click.option("--suffix", help="Run name suffix: a separate run of the same job.")
@click.option("--set", "overrides", multiple=True, metavar="FIELD=VALUE",
              help="Override a spec field, e.g. --set config.epochs=2 --set workers.min=1.")
@click.option("--working-dir", type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="Folder uploaded with the job (default: the current directory).")
@click.option("--follow", is_flag=True, help="Stream logs and exit with the job's status.")
@click.option("--json", "as_json", is_flag=True)
def submit_cmd(job_file: Path, address: str | None, suffix: str | None, overrides: tuple[str, ...],
               working_dir: Path | None, follow: bool, as_json: bool) -> None:
    """Submit a job through Ray's job API. Submitting the same job again resumes its run.

    \b
    Example:
      elastic submit jobs/digits_ddp.yaml --follow
    """
    from elastic.config.spec import load_job_spec
    from elastic.driver import submit

    spec = load_job_spec(job_file, overrides)
    target = submit.resolve_target(address)
    submitted = submit.submit(spec, target, suffix=suffix, working_dir=working_dir)
    if as_json:
        _print_json({"run_name": submitted.run_name, "job_id": submitted.job_id, "address": submitted.address})
    else:
        click.echo(f"run {submitted.run_name}: submitted job {submitted.job_id} to {submitted.address}")
    if follow:
        status = submit.follow(target, submitted.job_id, out=sys.stderr if as_json else sys.stdout)
        click.echo(f"job {submitted.job_id} {status}", err=as_json)
        if status != "SUCCEEDED":
            raise JobFailed(submitted.job_id, status)


@cli.command("run", hidden=False)
@click.argument("job_file", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--run-name", help="Run name (default: from the spec).")
@click.option("--set", "overrides", multiple=True, metavar="FIELD=VALUE")
def run_cmd(job_file: Path | None, run_name: str | None, overrides: tuple[str, ...]) -> None:
    """Run a job in this process as the Ray driver (what `submit` starts on the cluster)."""
    from elastic.config.spec import load_job_spec
    from elastic.driver.fitting import run_job
    from elastic.driver.submit import spec_from_environment

    spec = load_job_spec(job_file, overrides) if job_file else spec_from_environment()
    run_job(spec, run_name or spec.run_name())


@cli.command("status")
@click.argument("run", required=False)
@click.option("--address")
@click.option("--json", "as_json", is_flag=True)
def status_cmd(run: str | None, address: str | None, as_json: bool) -> None:
    """List elastic runs on the cluster (newest job per run first)."""
    from elastic.driver import submit

    target = submit.resolve_target(address)
    rows = submit.list_runs(target)
    if run:
        rows = [r for r in rows if run in (r["run"], r["job_id"])]
        for row in rows[:1]:
            if row["status"] == "RUNNING":  # e.g. "waiting: waiting for capacity: 1 of 2 worker slot(s) free ..."
                driver = submit.driver_status(target, row["job_id"])
                if driver:
                    row["message"] = f"{driver['state']}: {driver['detail']}"
    if as_json:
        _print_json(rows)
        return
    table = Table("run", "job id", "status", "message")
    for row in rows:
        table.add_row(row["run"], row["job_id"], row["status"], (row["message"] or "")[:160])
    console.print(table)


@cli.command("logs")
@click.argument("run")
@click.option("--address")
def logs_cmd(run: str, address: str | None) -> None:
    """Print the logs of a run's newest job."""
    from elastic.driver import submit

    click.echo(submit.logs(submit.resolve_target(address), run), nl=False)


@cli.command("stop")
@click.argument("run")
@click.option("--address")
def stop_cmd(run: str, address: str | None) -> None:
    """Stop a run's newest job (its checkpoints stay; submit again to resume)."""
    from elastic.driver import submit

    job_id = submit.stop(submit.resolve_target(address), run)
    click.echo(f"stopping job {job_id}")


@cli.group("checkpoints")
def checkpoints_group() -> None:
    """Inspect a run's checkpoints: RUN is a run URI (s3://bucket/runs/NAME) or a run name under --root."""


def _store(run: str, root: str | None):
    import os

    from elastic.checkpoint.store import CheckpointStore
    from elastic.local import stack as local

    state = local.running_state()
    if state is not None and not os.environ.get("AWS_ENDPOINT_URL"):
        os.environ.update(state.env())  # the local stack's bucket, when no other endpoint is configured
    if "://" in run or run.startswith("/"):
        return CheckpointStore(run)
    root = root or os.environ.get("ELASTIC_RUNS_URI") or (f"s3://{state.bucket}/runs" if state else None)
    if not root:
        raise UserError(f"'{run}' is a run name but no runs root is known; pass --root s3://BUCKET/PREFIX "
                        "or a full run URI")
    return CheckpointStore(f"{root.rstrip('/')}/{run}")


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
        _print_json([i.to_json() for i in infos])
        return
    if not infos:
        click.echo(f"no checkpoints under {store.run_uri}")
        return
    # Fits 80 columns (a pipe, a CI log): the year is left out of the time, `--json` has the timestamp.
    table = Table("step", Column("time (UTC)", no_wrap=True), "size", "shards", "workers", "commit",
                  Column("reason", no_wrap=True))
    for info in infos:
        when = datetime.datetime.fromtimestamp(info.time, datetime.timezone.utc).strftime("%m-%d %H:%M:%S") \
            if info.time else "-"
        table.add_row(str(info.step), when, f"{info.size_bytes / 1e6:.2f} MB", str(info.shards),
                      str(info.world_size or "-"), "yes" if info.committed else "[red]no[/]", info.reason or "-")
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


@cli.command("verify-resume")
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--kills", default=3, show_default=True, type=click.IntRange(0),
              help="Worker kills to inject; every other one lands inside a checkpoint save.")
@click.option("--workers", "workers_text", help="Worker count, or counts the interrupted run moves through, "
              "e.g. 2 or 2,1,2 (default: the job's workers.min).")
@click.option("--address", help="Ray job API (default: the local stack).")
@click.option("--set", "overrides", multiple=True, metavar="FIELD=VALUE", help="Override a spec field.")
@click.option("--json", "as_json", is_flag=True)
def verify_resume_cmd(job_file: Path, kills: int, workers_text: str | None, address: str | None,
                      overrides: tuple[str, ...], as_json: bool) -> None:
    """Run a job uninterrupted and again with worker kills, and prove the resumed run is equivalent.

    At one worker count the final model and optimizer must be bit-identical; at any counts every sample of
    every epoch must be trained on exactly once. Exits 0 when it passes, 1 when it does not.

    \b
    Example:
      elastic verify-resume jobs/digits_ddp.yaml --kills 3 --json
      elastic verify-resume jobs/digits_ddp.yaml --kills 3 --workers 2,1,2
    """
    from elastic.config.spec import load_job_spec
    from elastic.diagnostics import verify
    from elastic.driver import submit

    spec = load_job_spec(job_file, overrides)
    workers = _worker_counts(workers_text, spec.workers.min)
    target = submit.resolve_target(address)
    verify.storage_environment(target)
    stamp = time.strftime("%m%d%H%M%S")
    log_path = verify.default_log_path(stamp)
    with open(log_path, "w") as log:
        verifier = verify.Verifier(spec, target, Path.cwd(), log, progress=lambda m: click.echo(m, err=True),
                                   stamp=stamp)
        click.echo(f"verify-resume: job logs in {log_path}", err=True)
        report = verifier.run(kills, workers)
    if as_json:
        _print_json(report.to_json())
    else:
        _show_verify(report)
    if not report.passed:
        sys.exit(1)


def _worker_counts(text: str | None, default: int) -> list[int]:
    if not text:
        return [default]
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or any(c < 1 for c in counts):
        raise UserError(f"--workers {text!r}: expected a count or counts like 2 or 2,1,2")
    return counts


def _show_verify(report) -> None:
    verdict = "[green]PASSED[/]" if report.passed else "[red]FAILED[/]"
    console.print(f"verify-resume {verdict}: {report.criteria}")
    table = Table("", "uninterrupted", "with kills")
    for column in table.columns:
        column.overflow = "fold"
    table.add_row("run", report.baseline.run, report.interrupted.run)
    table.add_row("workers", str(report.baseline.workers), str(report.interrupted.workers))
    table.add_row("final step", str(report.baseline.final_step), str(report.interrupted.final_step))
    table.add_row("restarts", str(report.baseline.restarts), str(report.interrupted.restarts))
    table.add_row("every sample once", str(report.baseline.samples_exactly_once),
                  str(report.interrupted.samples_exactly_once))
    table.add_row("seconds", str(report.baseline.seconds), str(report.interrupted.seconds))
    console.print(table)
    console.print(f"kills: {report.kills_fired}/{report.kills} fired ({', '.join(report.interrupted.kill_plan)}); "
                  f"identical: {report.identical}; max |diff|: {report.max_abs_diff:.3g} over "
                  f"{report.tensors_compared} tensors; loss gap {report.max_epoch_loss_diff:.3g} "
                  f"({report.loss_tolerance})")
    for problem in report.problems:
        console.print(f"[red]problem:[/] {problem}")


@cli.group("bench")
def bench_group() -> None:
    """Benchmarks: ours and the baseline side by side in one run, as ratios (run them on your own bucket)."""


def _bench_target(uri: str | None, folder: str) -> str:
    """--uri, else the local stack's bucket (whose endpoint and credentials this process then uses)."""
    import os

    from elastic.local import stack as local

    state = local.running_state()
    if state is not None and not os.environ.get("AWS_ENDPOINT_URL"):
        os.environ.update(state.env())
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
        lower = key in ("stall_ratio", "overhead_ratio", "ckpt_overhead_ratio", "recovery_ratio")
        ok = value <= target if lower else value >= target
        console.print(f"{key} = {value} ({'meets' if ok else 'MISSES'} the target {'<=' if lower else '>='} {target})")


@bench_group.command("checkpoint")
@click.option("--uri", help="Where to write (default: the local stack's s3://BUCKET/bench).")
@click.option("--size-mb", default=256.0, show_default=True, type=click.FloatRange(min=1), help="State size.")
@click.option("--workers", default=2, show_default=True, type=click.IntRange(1), help="Ranks (local processes).")
@click.option("--repeats", default=7, show_default=True, type=click.IntRange(1),
              help="Timed repeats; ratios are the median of each repeat's paired ratio.")
@click.option("--json", "as_json", is_flag=True)
def bench_checkpoint_cmd(uri: str | None, size_mb: float, workers: int, repeats: int, as_json: bool) -> None:
    """Sharded async save and load against raw parallel multipart put/get of the same bytes.

    \b
    Example:
      elastic bench checkpoint --size-mb 256 --workers 2 --json
    """
    from elastic.bench import harness as bench

    result = bench.to_json(bench.bench_checkpoint(_bench_target(uri, "bench"), size_mb=size_mb, workers=workers,
                                                        repeats=repeats))
    if as_json:
        _print_json(result)
    else:
        _show_bench("checkpoint", result, {"throughput_ratio": 0.9, "load_ratio": 0.9, "stall_ratio": 0.02})


@bench_group.command("overhead")
@click.option("--uri", help="Checkpoint root for the harness (default: the local stack's s3://BUCKET/bench).")
@click.option("--workers", default=2, show_default=True, type=click.IntRange(1))
@click.option("--rounds", default=12, show_default=True, type=click.IntRange(1),
              help="Timed blocks per variant (one of each per round, in rotating order).")
@click.option("--steps", default=40, show_default=True, type=click.IntRange(20),
              help="Steps per block (a multiple of the checkpoint interval, 20).")
@click.option("--width", default=1024, show_default=True, type=click.IntRange(8), help="MLP width (model size).")
@click.option("--batch", default=256, show_default=True, type=click.IntRange(1), help="Batch per worker.")
@click.option("--json", "as_json", is_flag=True)
def bench_overhead_cmd(uri: str | None, workers: int, rounds: int, steps: int, width: int, batch: int,
                       as_json: bool) -> None:
    """Harness step time against a bare Ray Train DDP loop: checkpoints off, and async every 20 steps.

    \b
    Example:
      elastic bench overhead --json
    """
    from elastic.bench import harness as bench

    target = _bench_target(uri, "bench")
    result = bench.to_json(bench.bench_overhead(target, workers=workers, rounds=rounds, steps=steps,
                                                      width=width, batch=batch))
    if as_json:
        _print_json(result)
    else:
        _show_bench("overhead", result, {"overhead_ratio": 1.02, "ckpt_overhead_ratio": 1.05})


@cli.command("sweep")
@click.argument("sweep_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="FIELD=VALUE",
              help="Override a sweep field, e.g. --set num_samples=4 --set gpu_share=0.5.")
@click.option("--resume", is_flag=True, help="Require an existing sweep to restore (running it again restores "
                                             "one anyway when there is one).")
@click.option("--json", "as_json", is_flag=True, help="Print trials, best_config, plan as JSON (progress on stderr).")
def sweep_cmd(sweep_file: Path, overrides: tuple[str, ...], resume: bool, as_json: bool) -> None:
    """Run a hyperparameter sweep whose trials share GPUs (Ray Tune over Ray Train V2).

    Each trial runs the sweep's job under its own run name; running the same sweep again restores the
    experiment and resumes unfinished trials from their checkpoints.

    \b
    Example:
      elastic local up --spot 2 --on-demand 1 --gpus-per-node 2 --cpus-per-node 2
      elastic sweep jobs/digits_sweep.yaml
    """
    from elastic.config.sweep_spec import load_sweep_spec
    from elastic.sweep import runner as sweeps

    spec, job = load_sweep_spec(sweep_file, overrides)
    sweeps.connect(job)
    say = (lambda m: click.echo(f"[sweep] {m}", err=True)) if as_json else (lambda m: click.echo(f"[sweep] {m}"))
    with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():  # Tune prints too
        result = sweeps.run_sweep(spec, job, resume=resume, say=say)
    sweeps.disconnect()  # before printing: Ray's background threads print warnings to stdout until then
    if as_json:
        _print_json(result)
    else:
        _show_sweep(result)
    if result["errors"]:
        sys.exit(1)


def _show_sweep(result: dict) -> None:
    keys = sorted({k for t in result["trials"] for k in (t["params"] or {})})
    table = Table("trial", *keys, result["metric"], "state", "iters", "share", "restarts")
    for t in result["trials"]:
        metric = t["metric"]
        table.add_row(t["trial_id"], *[_fmt(t["params"].get(k)) for k in keys],
                      _fmt(metric), t["state"], str(t["iterations"]), str(t["gpu_share"]), str(t["restarts"]))
    Console(highlight=False, width=max(console.width, 140)).print(table)  # not folded in a pipe's 80 columns
    plan = result["plan"]
    console.print(f"packing: {plan['trials_per_gpu']} per GPU, share {plan['share']} ({plan['reason']})")
    console.print(f"best config ({result['mode']} {result['metric']} = {_fmt(result['best_metric'])}): "
                  f"{json.dumps(result['best_config'])}")


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


@bench_group.command("packing")
@click.option("--share", default=0.25, show_default=True, type=click.FloatRange(0, 1, min_open=True),
              help="GPU share of each trial.")
@click.option("--trials", type=click.IntRange(1), help="Trials (default: 1/share per GPU of the cluster).")
@click.option("--hold", "hold_s", default=180.0, show_default=True, type=click.FloatRange(1),
              help="Longest a trial waits at the barrier for the others.")
@click.option("--cpus", default=0.05, show_default=True, type=click.FloatRange(0, min_open=True),
              help="CPUs per trial worker (logical accounting).")
@click.option("--market", default="any", show_default=True, type=click.Choice(["any", "spot", "on-demand"]),
              help="Worker nodes whose GPUs the trials share.")
@click.option("--compare", is_flag=True, help="Real GPUs: auto against whole-GPU trials (trials/hour, GPU util).")
@click.option("--steps", default=300, show_default=True, type=click.IntRange(1), help="--compare: steps per trial.")
@click.option("--width", default=1024, show_default=True, type=click.IntRange(8), help="--compare: MLP width.")
@click.option("--batch", default=256, show_default=True, type=click.IntRange(1), help="--compare: batch size.")
@click.option("--gpu-memory-gb", type=click.FloatRange(0, min_open=True),
              help="--compare without CUDA (dry run): declared peak per trial on a 16 GB logical GPU.")
@click.option("--uri", help="Storage root (default: the local stack's s3://BUCKET/bench).")
@click.option("--json", "as_json", is_flag=True)
def bench_packing_cmd(share: float, trials: int | None, hold_s: float, cpus: float, market: str, compare: bool,
                      steps: int,
                      width: int, batch: int, gpu_memory_gb: float | None, uri: str | None, as_json: bool) -> None:
    """GPU sharing: concurrency reached against requested, and Tune's scheduling overhead (logical GPUs work);
    with --compare, trials per hour and GPU utilization of `auto` against whole-GPU trials (real GPUs).

    \b
    Example:
      elastic local up --spot 2 --on-demand 1 --gpus-per-node 2 --cpus-per-node 2
      elastic bench packing --share 0.25 --json
    """
    from elastic.bench import packing as bench_packing
    from elastic.sweep import runner as sweeps

    target = _bench_target(uri, "bench")
    sweeps.connect()
    say = (lambda m: click.echo(f"[bench] {m}", err=True))
    with contextlib.redirect_stdout(sys.stderr):  # Tune prints its own banners
        if compare:
            result = bench_packing.bench_compare(target, trials or 8, steps, width, batch, gpu_memory_gb, say)
        else:
            result = bench_packing.bench_concurrency(target, share, trials, hold_s, cpus, say, market)
        sweeps.disconnect()
    if as_json:
        _print_json(result)
    else:
        _show_bench("packing", {k: json.dumps(v) if isinstance(v, dict) else v for k, v in result.items()}, {})


@cli.command("demo")
@click.option("--spot", default=2, show_default=True, type=click.IntRange(0))
@click.option("--on-demand", default=1, show_default=True, type=click.IntRange(0))
@click.option("--down", "stop_after", is_flag=True, help="Stop the local stack when the demo ends.")
def demo_cmd(spot: int, on_demand: int, stop_after: bool) -> None:
    """The whole story on the embedded default: local stack, DDP job on spot nodes, checkpoints in S3."""
    from elastic.cli.demo import run_demo

    run_demo(console, spot=spot, on_demand=on_demand, stop_after=stop_after)


# ---------------------------------------------------------------------------------------------------------
# cluster configs (registered at import time, which is what `elastic` and `python -m elastic` use)


@cli.group("cluster")
def cluster_group() -> None:
    """Cluster configs: `ray up` YAMLs (AWS, GCP) and KubeRay RayCluster manifests."""


@cluster_group.command("validate")
@click.argument("config_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help='Print {"file", "ok", "problems": [{"key", "message"}]}.')
def cluster_validate(config_file: Path, as_json: bool) -> None:
    """Check a cluster config before it costs money: Ray's own schema, then spot and on-demand GPU worker types,
    an on-demand head without training, the preemption watcher on spot nodes, market labels jobs select,
    token auth, no port open to the world but SSH, remote checkpoint storage, and the cloud fields Ray does not
    check (e.g. MarketType). Prints one line per problem (key and fix) and exits 2 on any.

    \b
    Example:
      elastic cluster validate cluster-configs/aws-spot-gpu.yaml
    """
    from elastic.clusterconfig.validate import validate_file

    kind, problems = validate_file(config_file)
    if as_json:
        _print_json({"file": str(config_file), "ok": not problems, "kind": kind,
                     "problems": [p.to_json() for p in problems]})
    elif not problems:
        click.echo(f"{config_file}: ok ({kind})")
    for problem in problems if not as_json else []:
        click.echo(f"{config_file}: {problem.key}: {problem.message}", err=True)
    if problems:
        sys.exit(2)


# ---------------------------------------------------------------------------------------------------------
# local add-node: capacity that arrives later (spot-first falls back to on-demand, then swaps back to spot)


@local_group.command("add-node")
@click.option("--market", required=True, type=click.Choice(["spot", "on-demand"]), help="The new node's market.")
@click.option("--cpus", type=click.IntRange(1), help="CPUs (default: as the stack's other worker nodes).")
@click.option("--gpus", type=click.IntRange(0), help="Logical GPUs (default: as the stack's other worker nodes).")
@click.option("--json", "as_json", is_flag=True, help="Print the new node as JSON.")
def local_add_node(market: str, cpus: int | None, gpus: int | None, as_json: bool) -> None:
    """Start one more labeled worker node on the running local stack; `local down` stops it with the rest.

    \b
    Example (spot capacity that is withheld, then returns):
      elastic local up --spot 0 --on-demand 2
      elastic submit jobs/digits_ddp.yaml --set workers.market=spot-first --set workers.spot_wait_seconds=10
      elastic local add-node --market spot --cpus 2
    """
    from elastic.local import stack as local

    node = local.add_node(market, cpus=cpus, gpus=gpus)
    if as_json:
        _print_json(node)
    else:
        click.echo(f"added {node['name']} ({node['market']}, {node['cpus']} CPUs, {node['gpus']} GPUs): "
                   f"node {node['node_id']}")


@bench_group.command("recovery")
@click.option("--notice", default=20.0, show_default=True, type=click.FloatRange(1), help="Seconds of notice.")
@click.option("--workers", default=2, show_default=True, type=click.IntRange(1))
@click.option("--minutes", type=click.FloatRange(0), help="Also measure goodput over a run this long ...")
@click.option("--every", default=120.0, show_default=True, type=click.FloatRange(10),
              help="... with a noticed reclaim every this many seconds.")
@click.option("--json", "as_json", is_flag=True)
def bench_recovery_cmd(notice: float, workers: int, minutes: float | None, every: float, as_json: bool) -> None:
    """What a spot reclaim costs on the local cluster, ours against Ray Train's own restart of a bare loop:
    steps lost with and without notice, seconds from node death to the first resumed step, and goodput.

    \b
    Example (about 5 minutes; with --minutes 10, 15):
      elastic local up --spot 3 --on-demand 1
      elastic bench recovery --json
      elastic bench recovery --minutes 10 --every 120 --json
    """
    import dataclasses

    from elastic.bench import recovery as bench_recovery

    log = (lambda line: click.echo(line, err=True)) if as_json else click.echo
    result = dataclasses.asdict(bench_recovery.bench_recovery(notice=notice, workers=workers, minutes=minutes,
                                                              every=every, log=log))
    if as_json:
        _print_json(result)
    else:
        targets = {"recovery_ratio": 1.1}
        _show_bench("recovery", result, targets)
        console.print(f"lost_steps_notice = {result['lost_steps_notice']} (target 0)")
        if result["goodput"] is not None:
            console.print(f"goodput = {result['goodput']} (target >= 0.9)")


# ---------------------------------------------------------------------------------------------------------
# preempt: a spot reclaim on the local cluster


@cli.command("preempt")
@click.option("--node", "node", metavar="NAME|ID", help="The worker node to reclaim (name such as spot-0, or node id).")
@click.option("--random", "pick_random", is_flag=True, help="Pick the node(s) at random (of --market, if given).")
@click.option("--market", type=click.Choice(["spot", "on-demand"]), help="Reclaim node(s) of this market.")
@click.option("--count", default=1, show_default=True, type=click.IntRange(1),
              help="Reclaim this many nodes at the same moment (correlated reclaims).")
@click.option("--notice", type=click.FloatRange(0), help="Seconds of notice before the node dies "
              "(AWS gives 120, GCP and Azure 30). Default 30.")
@click.option("--hard", is_flag=True, help="Kill without notice.")
@click.option("--replace-after", type=click.FloatRange(0), metavar="SECONDS",
              help="Start a like node this long after the kill, as an autoscaler would.")
@click.option("--json", "as_json", is_flag=True)
def preempt_cmd(node: str | None, pick_random: bool, market: str | None, count: int, notice: float | None,
                hard: bool, replace_after: float | None, as_json: bool) -> None:
    """Simulate a spot reclaim on the local stack: the node's metadata endpoint announces it, its watcher
    drains the Ray node, the run takes a just-in-time checkpoint, and the node dies at the deadline.

    \b
    Examples:
      elastic preempt --market spot --notice 20            # during `elastic submit jobs/digits_ddp.yaml`
      elastic preempt --node spot-1 --hard --replace-after 10
      elastic preempt --market spot --count 2 --notice 30  # two spot nodes at once
    """
    from elastic.local import preempt
    from elastic.local import stack as local

    if hard and notice is not None:
        raise UserError("--hard kills without notice; drop --notice (or drop --hard)")
    if node is not None and (pick_random or market or count > 1):
        raise UserError("--node names one node; drop --random/--market/--count")
    state = local.running_state()
    if state is None:
        raise UserError("no local stack running; start one with `elastic local up`")
    nodes = preempt.select_nodes(state, node=node, pick_random=pick_random, market=market, count=count)
    log = (lambda line: click.echo(line, err=True)) if as_json else click.echo
    report = preempt.preempt(nodes, notice=None if hard else (30.0 if notice is None else notice), hard=hard,
                             replace_after=replace_after, log=log)
    if as_json:
        _print_json(report.to_json())


# ---------------------------------------------------------------------------------------------------------
# the preemption watcher (a daemon on each spot node)


@cli.command("watch-preemption")
@click.option("--provider", default="auto", show_default=True, type=click.Choice(["aws", "gcp", "azure", "auto"]),
              help="Whose metadata service to read; auto probes each briefly and exits 0 off-cloud.")
@click.option("--metadata-url", help="Metadata service base URL (default: http://169.254.169.254).")
@click.option("--node-id", help="Ray node to drain, hex (default: the Ray node on this host).")
@click.option("--address", help="Ray GCS address HOST:PORT (default: RAY_ADDRESS, else the cluster this host joined).")
@click.option("--poll-seconds", default=5.0, show_default=True, type=float, help="Seconds between polls.")
@click.option("--margin-seconds", default=2.0, show_default=True, type=float,
              help="Drain deadline = the cloud's deadline minus this.")
@click.option("--once", is_flag=True, help="Poll once, act on what it shows, and exit (1 if the service is down).")
def watch_preemption_cmd(provider: str, metadata_url: str | None, node_id: str | None, address: str | None,
                         poll_seconds: float, margin_seconds: float, once: bool) -> None:
    """Turn this node's spot reclaim notice into a Ray drain (reason PREEMPTION), once per reclaim.

    Reads AWS IMDSv2 (spot/instance-action; rebalance recommendations are only logged), GCP
    (instance/preempted, maintenance-event; ~30 s notice) or Azure Scheduled Events (Preempt, acknowledged once
    drained), and logs one line per event. Runs until stopped; metadata outages are retried with backoff.

    \b
    Example:
      nohup elastic watch-preemption --provider aws >/tmp/ray/elastic-watch-preemption.log 2>&1 &
    """
    import re

    from elastic.preemption.watcher import WatchConfig, watch

    if not poll_seconds > 0:
        raise UserError(f"--poll-seconds must be > 0, got {poll_seconds:g}")
    if not margin_seconds >= 0:
        raise UserError(f"--margin-seconds must be >= 0, got {margin_seconds:g}")
    if node_id is not None and not re.fullmatch(r"[0-9a-f]{56}", node_id):
        raise UserError(f"--node-id must be a Ray node id (56 hex digits, as `ray list nodes` shows), got {node_id!r}")
    if metadata_url is not None and not re.match(r"https?://[^/]+", metadata_url):
        raise UserError(f"--metadata-url must be an http:// URL, got {metadata_url!r}")
    config = WatchConfig(poll_seconds=poll_seconds, margin_seconds=margin_seconds)
    sys.exit(watch(provider, metadata_url, address=address, node_id=node_id, config=config, once=once))


# ---------------------------------------------------------------------------------------------------------


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except UserError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(err.exit_code)
    except JobFailed as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(1)
    except ElasticError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
