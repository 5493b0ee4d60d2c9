"""`elastic verify-resume`: a job run with kills against an uninterrupted run (exactly-once, losses)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
from rich.table import Table

from elastic.cli.common import console, worker_counts
from elastic.cli.remote import finish, remote_options, run_remotely
from elastic.driver.remote import remote_address


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
@click.option("--set", "overrides", multiple=True, metavar="FIELD=VALUE", help="Override a spec field.")
@click.option("--json", "as_json", is_flag=True)
@remote_options
def verify_resume_cmd(
    job_file: Path,
    kills: int,
    notices: int,
    workers_text: str | None,
    overrides: tuple[str, ...],
    as_json: bool,
    address: str | None,
    detach: bool,
) -> None:
    """Run a job uninterrupted and again with worker kills, and prove the resumed run is equivalent.

    At one worker count the final model and optimizer must be bit-identical; at any counts every sample of
    every epoch must be trained on exactly once. Exits 0 when it passes, 1 when it does not.

    \b
    Example:
      elastic verify-resume jobs/digits_ddp.yaml --kills 3 --json
      elastic verify-resume jobs/digits_ddp.yaml --kills 3 --workers 2,1,2
      elastic verify-resume jobs/charlm.yaml --kills 2 --notices 1
      elastic verify-resume jobs/digits_ddp.yaml --address http://127.0.0.1:8265   # runs as a Ray job there
    """
    from elastic.config.spec import load_job_spec
    from elastic.diagnostics import verify
    from elastic.driver import submit

    spec = load_job_spec(job_file, overrides)
    workers = worker_counts(workers_text, spec.workers.min)
    stamp = time.strftime("%m%d%H%M%S")
    if address := remote_address(address):
        result = run_remotely(address, f"verify-resume {spec.name} {stamp}", as_json, detach)
        if result is None:
            return
    else:
        target = submit.resolve_target(None)
        verify.storage_environment(target)
        log_path = verify.default_log_path(stamp)
        with open(log_path, "w") as log:
            verifier = verify.Verifier(
                spec, target, Path.cwd(), log, progress=lambda m: click.echo(m, err=True), stamp=stamp
            )
            click.echo(f"verify-resume: job logs in {log_path}", err=True)
            result = verifier.run(kills, workers, notices).to_json()
    finish(result, as_json, _show_verify)
    if not result["passed"]:
        sys.exit(1)


def _show_verify(report: dict) -> None:
    """The report (VerifyReport.to_json(), here or read back from a remote run) as a table and summary lines."""
    base, hit = report["baseline"], report["interrupted"]
    verdict = "[green]PASSED[/]" if report["passed"] else "[red]FAILED[/]"
    console.print(f"verify-resume {verdict}: {report['criteria']}")
    table = Table("", "uninterrupted", "with kills")
    for column in table.columns:
        column.overflow = "fold"
    for label, key in (
        ("run", "run"),
        ("workers", "workers"),
        ("final step", "final_step"),
        ("restarts", "restarts"),
        ("every sample once", "samples_exactly_once"),
        ("seconds", "seconds"),
    ):
        table.add_row(label, *("not audited" if r[key] is None else str(r[key]) for r in (base, hit)))
    console.print(table)
    if report["notices"]:
        console.print(
            f"reclaim notices: {report['notices_fired']}/{report['notices']} fired, "
            f"{hit['just_in_time_ends']} just-in-time end(s)"
        )
    console.print(
        f"kills: {report['kills_fired']}/{report['kills']} fired ({', '.join(hit['kill_plan'])}); "
        f"identical: {report['identical']}; max |diff|: {report['max_abs_diff']:.3g} over "
        f"{report['tensors_compared']} tensors; loss gap {report['max_epoch_loss_diff']:.3g} "
        f"({report['loss_tolerance']})"
    )
    for problem in report["problems"]:
        console.print(f"[red]problem:[/] {problem}")
