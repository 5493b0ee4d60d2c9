"""`elastic pack`: several different jobs trained at once on shared GPUs."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from elastic.cli.common import console
from elastic.cli.remote import finish, remote_options, run_remotely
from elastic.driver.remote import remote_address
from elastic.errors import UserError


def _share(value: str) -> float | None:
    if value == "auto":
        return None
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0 < share <= 1:
        raise UserError(f"--gpu-share {value}: give auto or a GPU fraction in (0, 1], e.g. 0.25")
    return share


@click.command("pack")
@click.argument("job_files", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--gpu-share",
    default="auto",
    show_default=True,
    help="GPU fraction of each training worker, e.g. 0.25; auto probes each job on a whole GPU and sizes its "
    "share from its peak memory (CUDA only).",
)
@click.option("--name", help="Pack name (default: from the jobs and their settings; the same again restores the pack).")
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="[JOB:]FIELD=VALUE",
    help="Override a field of every job, or of the job named JOB, e.g. --set charlm:config.epochs=1.",
)
@click.option("--json", "as_json", is_flag=True, help="Print each job's share, GPUs, state, restarts as JSON.")
@remote_options
def pack_cmd(
    job_files: tuple[Path, ...],
    gpu_share: str,
    name: str | None,
    overrides: tuple[str, ...],
    as_json: bool,
    address: str | None,
    detach: bool,
) -> None:
    """Train several different jobs at once on shared GPUs, as one Tune experiment.

    Each job gets its own GPU share per worker, a memory cap at that share, a retry at a doubled share after
    an out-of-memory error (the others go on), and resumes from its checkpoints after a preemption or when
    the pack runs again. Its run is PACK-JOBNAME.

    \b
    Example:
      elastic local up --spot 2 --on-demand 1 --gpus-per-node 1 --cpus-per-node 3
      elastic pack jobs/digits_ddp.yaml jobs/charlm.yaml jobs/digits_augment.yaml --gpu-share 0.25
    """
    from elastic.sweep import pack

    share = _share(gpu_share)
    jobs = pack.load_packed_jobs(list(job_files), overrides)  # bad input: one line, before anything starts
    name = name or pack.default_name(jobs)
    if address := remote_address(address):
        result = run_remotely(address, f"pack {name}", as_json, detach, attach_running=True)
        if result is None:
            return
    else:
        from elastic.sweep import runner  # Ray Tune: only where the pack runs

        excludes = sorted({e for j in jobs for e in j.job.runtime_env.excludes})
        runner.connect(excludes=excludes)
        say = (lambda m: click.echo(f"[pack] {m}", err=True)) if as_json else (lambda m: click.echo(f"[pack] {m}"))
        logical = os.environ.get("ELASTIC_LOGICAL_GPUS") == "1"
        with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():  # Tune prints too
            result = pack.run_pack(name, jobs, share, logical, say)
            runner.disconnect()  # inside: Ray's background threads print warnings to stdout until then
    finish(result, as_json, _show_pack)
    if result["errors"]:
        sys.exit(1)


def _show_pack(result: dict) -> None:
    table = Table("job", "run", "share", "GPUs", "state", "time (s)", "restarts", "OOMs", "step")
    for job in result["jobs"]:
        table.add_row(
            job["job"],
            job["run"],
            str(job["share"]),
            " ".join(job["gpus"]) or "-",
            job["state"],
            str(job["seconds"] if job["seconds"] is not None else "-"),
            str(job["restarts"]),
            str(job["ooms"]),
            str(job["step"]),
        )
    Console(highlight=False, width=max(console.width, 120)).print(table)
    console.print(f"{len(result['jobs'])} jobs; at most {result['peak_concurrent']} trained at once")
