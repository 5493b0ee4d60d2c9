"""`elastic demo`: the local stack, the digits DDP job on spot nodes, its checkpoints in the local bucket."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
from rich.console import Console

from elastic.accounting import render
from elastic.accounting.prices import default_prices
from elastic.accounting.report import run_report
from elastic.checkpoint.store import CheckpointStore, run_directory
from elastic.cli.common import console
from elastic.config.spec import load_job_spec
from elastic.driver import submit
from elastic.driver.runs import read_summary
from elastic.errors import JobFailed, UserError
from elastic.local import stack as local

TARGET_ACCURACY = 0.95
DEMO_JOB = Path("jobs") / "digits_ddp.yaml"


def project_root() -> Path:
    """The repository holding jobs/ (the demo runs from a clone)."""
    for candidate in (Path.cwd(), Path(__file__).resolve().parents[1]):
        if (candidate / DEMO_JOB).is_file():
            return candidate
    raise UserError(f"{DEMO_JOB} not found; run the demo from a clone of the elastic repository")


def run_demo(console: Console, spot: int, on_demand: int, stop_after: bool) -> None:
    root = project_root()
    console.rule("1. local cluster: Ray head + simulated spot and on-demand nodes + S3 endpoint")
    state = local.up(spot=spot, on_demand=on_demand)
    for node in state.nodes:
        console.print(f"  {node['name']:<12} market={node['market']:<10} role={node['role']:<7} {node['node_id'][:12]}")
    console.print(f"  S3 endpoint {state.s3_endpoint}, bucket {state.bucket}")

    console.rule("2. submit jobs/digits_ddp.yaml: 2 DDP workers on spot nodes, checkpoints to S3")
    spec = load_job_spec(root / DEMO_JOB)
    target = submit.Target(state.dashboard_url, state)
    submitted = submit.submit(spec, target, working_dir=root)
    console.print(f"  run {submitted.run_name}, job {submitted.job_id}")
    status = submit.follow(target, submitted.job_id)
    if status != "SUCCEEDED":
        raise JobFailed(submitted.job_id, status, f"see `elastic logs {submitted.run_name}`")

    console.rule("3. result")
    os.environ.update(state.env())  # read the bucket as the cluster does
    summary = read_summary(spec, submitted.run_name) or {}
    accuracy = float(summary.get("metrics", {}).get("accuracy", 0.0))
    store = CheckpointStore(run_directory(spec, submitted.run_name))
    checkpoints = [CheckpointStore.folder_name(i.step) for i in store.list() if i.committed]
    console.print(
        f"  held-out accuracy {accuracy:.4f} (target {TARGET_ACCURACY}) in {summary.get('seconds')} s of training"
    )
    console.print(f"  checkpoints in {run_directory(spec, submitted.run_name)}: {', '.join(checkpoints)}")
    console.print(
        "  submit the same job again and it resumes from its last checkpoint: "
        "elastic submit jobs/digits_ddp.yaml --follow"
    )

    console.rule(f"4. elastic report {submitted.run_name}: goodput, badput by cause, cost (from the run's ledger)")
    report = run_report(run_directory(spec, submitted.run_name), default_prices())
    png = local.home_dir() / "demo-report.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    from elastic.accounting import plot  # matplotlib: imported when a plot is drawn, not at every CLI start

    plot.plot_run(report, png)
    render.print_run(console, report)
    console.print(f"  timeline: {png}")
    if stop_after:
        local.down()
        console.print("  local stack stopped")
    else:
        console.print(
            '  the stack is still up: eval "$(elastic local env)" to use it with ray/boto3; '
            "stop it with [bold]elastic local down[/] (or make down)"
        )
    if accuracy < TARGET_ACCURACY:
        console.print(f"[red]accuracy {accuracy:.4f} is below the target {TARGET_ACCURACY}[/]")
        sys.exit(1)


@click.command("demo")
@click.option("--spot", default=2, show_default=True, type=click.IntRange(0))
@click.option("--on-demand", default=1, show_default=True, type=click.IntRange(0))
@click.option("--down", "stop_after", is_flag=True, help="Stop the local stack when the demo ends.")
def demo_cmd(spot: int, on_demand: int, stop_after: bool) -> None:
    """The whole story on the embedded default: local stack, DDP job on spot nodes, checkpoints in S3."""
    run_demo(console, spot=spot, on_demand=on_demand, stop_after=stop_after)
