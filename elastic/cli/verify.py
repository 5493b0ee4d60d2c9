"""`elastic verify-resume`: a job run with kills against an uninterrupted run (exactly-once, losses)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
from rich.table import Table

from elastic.cli.common import console, print_json, worker_counts


@click.command("verify-resume")
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--kills",
    default=3,
    show_default=True,
    type=click.IntRange(0),
    help="Worker kills to inject; every other one lands inside a checkpoint save.",
)
@click.option(
    "--notices",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="Spot reclaim notices to inject: each ends a placement at a just-in-time checkpoint.",
)
@click.option(
    "--workers",
    "workers_text",
    help="Worker count, or counts the interrupted run moves through, e.g. 2 or 2,1,2 (default: the job's workers.min).",
)
@click.option("--address", help="Ray job API (default: the local stack).")
@click.option("--set", "overrides", multiple=True, metavar="FIELD=VALUE", help="Override a spec field.")
@click.option("--json", "as_json", is_flag=True)
def verify_resume_cmd(
    job_file: Path,
    kills: int,
    notices: int,
    workers_text: str | None,
    address: str | None,
    overrides: tuple[str, ...],
    as_json: bool,
) -> None:
    """Run a job uninterrupted and again with worker kills, and prove the resumed run is equivalent.

    At one worker count the final model and optimizer must be bit-identical; at any counts every sample of
    every epoch must be trained on exactly once. Exits 0 when it passes, 1 when it does not.

    \b
    Example:
      elastic verify-resume jobs/digits_ddp.yaml --kills 3 --json
      elastic verify-resume jobs/digits_ddp.yaml --kills 3 --workers 2,1,2
      elastic verify-resume jobs/charlm.yaml --kills 2 --notices 1
    """
    from elastic.config.spec import load_job_spec
    from elastic.diagnostics import verify
    from elastic.driver import submit

    spec = load_job_spec(job_file, overrides)
    workers = worker_counts(workers_text, spec.workers.min)
    target = submit.resolve_target(address)
    verify.storage_environment(target)
    stamp = time.strftime("%m%d%H%M%S")
    log_path = verify.default_log_path(stamp)
    with open(log_path, "w") as log:
        verifier = verify.Verifier(
            spec, target, Path.cwd(), log, progress=lambda m: click.echo(m, err=True), stamp=stamp
        )
        click.echo(f"verify-resume: job logs in {log_path}", err=True)
        report = verifier.run(kills, workers, notices)
    if as_json:
        print_json(report.to_json())
    else:
        _show_verify(report)
    if not report.passed:
        sys.exit(1)


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
    table.add_row(
        "every sample once", str(report.baseline.samples_exactly_once), str(report.interrupted.samples_exactly_once)
    )
    table.add_row("seconds", str(report.baseline.seconds), str(report.interrupted.seconds))
    console.print(table)
    if report.notices:
        console.print(
            f"reclaim notices: {report.notices_fired}/{report.notices} fired, "
            f"{report.interrupted.just_in_time_ends} just-in-time end(s)"
        )
    console.print(
        f"kills: {report.kills_fired}/{report.kills} fired ({', '.join(report.interrupted.kill_plan)}); "
        f"identical: {report.identical}; max |diff|: {report.max_abs_diff:.3g} over "
        f"{report.tensors_compared} tensors; loss gap {report.max_epoch_loss_diff:.3g} "
        f"({report.loss_tolerance})"
    )
    for problem in report.problems:
        console.print(f"[red]problem:[/] {problem}")
