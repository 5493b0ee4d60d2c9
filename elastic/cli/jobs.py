"""Jobs on a cluster: `elastic submit`, `run` (the job driver), `status`, `logs` and `stop`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.table import Table

from elastic.cli.common import console, print_json
from elastic.errors import JobFailed


@click.command("submit")
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--address", help="Ray job API, e.g. http://127.0.0.1:8265 (default: the local stack).")
@click.option("--suffix", help="Run name suffix: a separate run of the same job.")
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="FIELD=VALUE",
    help="Override a spec field, e.g. --set config.epochs=2 --set workers.min=1.",
)
@click.option(
    "--working-dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="Folder uploaded with the job (default: the current directory).",
)
@click.option("--follow", is_flag=True, help="Stream logs and exit with the job's status.")
@click.option("--json", "as_json", is_flag=True)
def submit_cmd(
    job_file: Path,
    address: str | None,
    suffix: str | None,
    overrides: tuple[str, ...],
    working_dir: Path | None,
    follow: bool,
    as_json: bool,
) -> None:
    """Submit a job through Ray's job API. Submitting the same job again resumes its run.

    \b
    Example:
      elastic submit jobs/digits_ddp.yaml --follow
    """
    from elastic.config.spec import load_job_spec
    from elastic.driver import submit

    spec = load_job_spec(job_file, overrides)
    submit.check_spec(spec, working_dir, str(job_file))
    target = submit.resolve_target(address)
    submitted = submit.submit(spec, target, suffix=suffix, working_dir=working_dir, spec_source=str(job_file))
    if as_json:
        print_json({"run_name": submitted.run_name, "job_id": submitted.job_id, "address": submitted.address})
    else:
        click.echo(f"run {submitted.run_name}: submitted job {submitted.job_id} to {submitted.address}")
    if follow:
        status = submit.follow(target, submitted.job_id, out=sys.stderr if as_json else sys.stdout)
        click.echo(f"job {submitted.job_id} {status}", err=as_json)
        if as_json:  # the last stdout line: one JSON object with the job's final status, for scripts
            ended = {"run_name": submitted.run_name, "job_id": submitted.job_id, "status": status}
            click.echo(json.dumps({**ended, "message": submit.job_message(target, submitted.job_id)}))
        if status != "SUCCEEDED":
            raise JobFailed(submitted.job_id, status)


@click.command("run", hidden=False)
@click.argument("job_file", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--run-name", help="Run name (default: from the spec).")
@click.option("--set", "overrides", multiple=True, metavar="FIELD=VALUE")
def run_cmd(job_file: Path | None, run_name: str | None, overrides: tuple[str, ...]) -> None:
    """Run a job in this process as the Ray driver (what `submit` starts on the cluster)."""
    from elastic.config.spec import load_job_spec
    from elastic.driver.job import run_job
    from elastic.driver.submit import spec_from_environment

    spec = load_job_spec(job_file, overrides) if job_file else spec_from_environment()
    run_job(spec, run_name or spec.run_name())


@click.command("status")
@click.argument("run", required=False)
@click.option("--address")
@click.option("--gpus", "gpus_only", is_flag=True, help="Only the GPUs runs share now: node, GPU, runs and shares.")
@click.option("--json", "as_json", is_flag=True)
def status_cmd(run: str | None, address: str | None, gpus_only: bool, as_json: bool) -> None:
    """List elastic runs on the cluster (newest job per run first), and which runs share which GPU."""
    from elastic.driver import gpu_sharing, submit

    target = submit.resolve_target(address)
    if gpus_only:
        shared = gpu_sharing.current(target)
        if as_json:
            print_json(shared)
        else:
            _show_shared(shared)
        return
    rows = submit.list_runs(target)
    if run:
        rows = [r for r in rows if run in (r["run"], r["job_id"])]
        for row in rows[:1]:
            if row["status"] == "RUNNING":  # e.g. "waiting: waiting for capacity: 1 of 2 worker slot(s) free ..."
                driver = submit.driver_status(target, row["job_id"])
                if driver:
                    row["message"] = f"{driver['state']}: {driver['detail']}"
    if as_json:
        print_json(rows)
        return
    table = Table("run", "job id", "status", "message")
    for row in rows:
        table.add_row(row["run"], row["job_id"], row["status"], (row["message"] or "")[:160])
    console.print(table)
    shared = gpu_sharing.current(target)
    if shared:  # runs training on GPU shares now (sweep trials and packed jobs too, which have no job of their own)
        _show_shared(shared)


def _show_shared(shared: list[dict]) -> None:
    if not shared:
        console.print("no run trains on a GPU share now")
        return
    gpus = Table("node", "GPU", "used", "runs (share)", title="shared GPUs")
    for gpu in shared:
        runs = ", ".join(f"{r['run']} ({r['share']:g})" for r in gpu["runs"])
        gpus.add_row(gpu["node"][:12], gpu["gpu"], f"{gpu['used']:g}", runs)
    console.print(gpus)


@click.command("logs")
@click.argument("run")
@click.option("--address")
@click.option("--follow", "-f", is_flag=True, help="Keep streaming until the job ends; exit with its status.")
def logs_cmd(run: str, address: str | None, follow: bool) -> None:
    """Print the logs of a run's newest job.

    \b
    Example:
      elastic logs digits-ddp --follow
    """
    from elastic.driver import submit

    target = submit.resolve_target(address)
    if not follow:
        click.echo(submit.logs(target, run), nl=False)
        return
    job_id = submit.latest_job(target, run)
    status = submit.follow(target, job_id)
    click.echo(f"job {job_id} {status}")
    if status != "SUCCEEDED":
        raise JobFailed(job_id, status)


@click.command("stop")
@click.argument("run")
@click.option("--address")
def stop_cmd(run: str, address: str | None) -> None:
    """Stop a run's newest job (its checkpoints stay; submit again to resume)."""
    from elastic.driver import submit

    job_id = submit.stop(submit.resolve_target(address), run)
    click.echo(f"stopping job {job_id}")
