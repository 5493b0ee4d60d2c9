"""`elastic report RUN|SWEEP`: goodput, badput by cause, preemptions, GPU-hours and cost by market, from the
run's ledger (so it works after the cluster is gone)."""

from __future__ import annotations

from pathlib import Path

import click

from elastic.cli.common import console, print_json, resolve_run_uri


@click.command("report")
@click.argument("run")
@click.option("--root", help="Runs root (the job's checkpoint.uri); default: the local stack's s3://BUCKET/runs.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--png",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    help="Also write a timeline plot (placements, reclaims, gaps, loss; for a sweep, trials and allocation).",
)
@click.option(
    "--prices",
    type=click.Path(dir_okay=False, path_type=Path),
    help="YAML/JSON price table over the built-in one: instance_types: {TYPE: {on-demand: USD/h, spot: USD/h}}.",
)
def report_cmd(run: str, root: str | None, as_json: bool, png: Path | None, prices: Path | None) -> None:
    """What a run or sweep got and cost: goodput and badput by cause, preemptions and lost steps, GPU-hours
    and node-hours by market, cost against all on-demand. RUN is a run (or sweep) name under --root or a URI.

    \b
    Example:
      elastic report digits-ddp --png digits-ddp.png
      elastic report digits-sweep --json
    """
    from elastic.accounting import plot, render
    from elastic.accounting.prices import load_prices
    from elastic.accounting.report import is_sweep, run_report, sweep_report
    from elastic.errors import UserError

    table = load_prices(prices)
    uri = resolve_run_uri(run, root)
    sweep = is_sweep(uri)
    report = sweep_report(uri, table) if sweep else run_report(uri, table)
    if not sweep and report["status"] == "NO LEDGER":
        raise UserError(f"{uri}: no run ledger there; check the run name and --root (elastic status lists runs)")
    if png is not None:
        (plot.plot_sweep if sweep else plot.plot_run)(report, png)
    if as_json:
        print_json(report)
    else:
        (render.print_sweep if sweep else render.print_run)(console, report)
        if png is not None:
            console.print(f"timeline: {png}")
