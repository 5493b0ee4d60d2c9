"""`elastic chaos soak`: a job under many faults at once, against an uninterrupted run."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
from rich.table import Table

from elastic.cli.common import console, print_json, worker_counts


@click.group("chaos")
def chaos_group() -> None:
    """Prove recovery under many faults at once (on the local stack)."""


@chaos_group.command("soak")
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--faults", "count", required=True, type=click.IntRange(1), help="How many faults to inject.")
@click.option("--seed", default=0, show_default=True, type=int, help="Draws the faults and their order.")
@click.option(
    "--workers",
    "workers_text",
    help="Worker count, or counts the faulted run moves through at its driver kills, e.g. 2 or 2,1,2 "
    "(default: the job's workers.min).",
)
@click.option("--set", "overrides", multiple=True, metavar="FIELD=VALUE", help="Override a spec field.")
@click.option("--json", "as_json", is_flag=True)
def soak_cmd(
    job_file: Path, count: int, seed: int, workers_text: str | None, overrides: tuple[str, ...], as_json: bool
) -> None:
    """Run a job uninterrupted, then again under N seeded faults: worker kills, kills inside a save, noticed,
    hard and correlated spot reclaims, S3 errors during saves and restores, a slow S3, a killed driver.

    It passes when every fault fired, the final model and optimizer are bit-identical (at one worker count),
    every sample was trained on exactly once per epoch and no torn checkpoint was loaded. Exits 0 when it
    passes, 1 when it does not. Needs the local stack with its S3 fault proxy: `elastic local up --s3-faults`.

    \b
    Example:
      elastic local up --spot 2 --s3-faults
      elastic chaos soak jobs/digits_ddp.yaml --faults 20 --json
      elastic chaos soak jobs/digits_ddp.yaml --faults 6 --seed 3 --workers 2,1,2
    """
    from elastic.config.spec import load_job_spec
    from elastic.diagnostics import soak, verify
    from elastic.driver import submit

    spec = load_job_spec(job_file, overrides)
    workers = worker_counts(workers_text, spec.workers.min)
    target = submit.resolve_target(None)
    verify.storage_environment(target)
    stamp = time.strftime("%m%d%H%M%S")
    log_path = soak.default_log_path(stamp)
    with open(log_path, "w") as log:
        runner = soak.Soak(spec, target, Path.cwd(), log, progress=lambda m: click.echo(m, err=True), stamp=stamp)
        click.echo(f"chaos soak: job logs in {log_path}", err=True)
        report = runner.run(count, seed, workers)
    if as_json:
        print_json(report.to_json())
    else:
        _show(report)
    if not report.passed:
        sys.exit(1)


def _show(report) -> None:
    verdict = "[green]PASSED[/]" if report.passed else "[red]FAILED[/]"
    console.print(
        f"chaos soak {verdict}: {report.faults_fired}/{report.faults_planned} faults fired (seed {report.seed}, "
        f"workers {report.workers})"
    )
    table = Table("#", "fault", "step", "fired", "detail")
    for fault in report.faults:
        table.add_row(str(fault.index + 1), fault.kind, str(fault.step), str(fault.fired), fault.detail)
    console.print(table)
    console.print(
        f"identical: {report.identical}; every sample once: {report.samples_exactly_once}; torn checkpoints "
        f"loaded: {report.torn_loaded}; steps lost to noticed reclaims: {report.lost_steps_noticed}; "
        f"restarts: {report.restarts}; goodput: {report.goodput:.2f} "
        f"({report.baseline_seconds} s uninterrupted, {report.faulted_seconds} s under faults)"
    )
    for problem in report.problems:
        console.print(f"[red]problem:[/] {problem}")
