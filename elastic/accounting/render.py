"""The terminal summary of a run or sweep report (rich)."""

from __future__ import annotations

import datetime

from rich.console import Console
from rich.table import Table

CAUSE_NAMES = {
    "startup": "start-up",
    "waiting_for_capacity": "waiting for capacity",
    "restore": "restore",
    "checkpoint_stall": "checkpoint stall",
    "data_wait": "waiting for data",
    "lost_work_redone": "lost work re-done",
    "preemption_gap": "preemption gaps",
    "failure_recovery": "failure recovery",
    "hang": "hung (no step progress)",
    "other": "other (teardown)",
}


def _money(value: float) -> str:
    return f"${value:,.4f}"


def _clock(t: float | None, start: float | None) -> str:
    if t is None:
        return "-"
    stamp = datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%H:%M:%S")
    return f"{stamp} (+{t - start:.1f} s)" if start is not None else stamp


def print_run(console: Console, report: dict) -> None:
    goodput = report["goodput"]
    console.print(
        f"[bold]run {report['run']}[/] ({report['kind']}, {report['status']}, {report['jobs']} job(s)): "
        f"{report['steps']} steps in {report['wall_s']:.1f} s"
    )
    console.print(
        f"goodput {goodput:.3f}" if goodput is not None else "goodput - (no wall time recorded)",
        f"(productive {report['productive_s']:.1f} s of {report['wall_s']:.1f} s); "
        f"preemptions {report['preemptions']}; lost steps {report['lost_steps']}",
    )
    badput = Table("badput", "seconds", "share of wall", title=None)
    for cause, seconds in report["badput"].items():
        if seconds > 0:
            share = seconds / report["wall_s"] if report["wall_s"] else 0.0
            badput.add_row(CAUSE_NAMES.get(cause, cause), f"{seconds:.1f}", f"{share:.1%}")
    console.print(badput)
    if report.get("input_bound"):
        console.print(f"[yellow]input-bound:[/] {report['input_bound']['advice']}")
    usage = Table("market", "GPU-hours", "node-hours")
    for market in report["gpu_hours"]:
        usage.add_row(market, f"{report['gpu_hours'][market]:.4f}", f"{report['node_hours'][market]:.4f}")
    console.print(usage)
    cost = report["cost"]
    console.print(
        f"cost {_money(cost['actual'])}; all on-demand {_money(cost['all_on_demand'])}; "
        f"saved {_money(cost['savings'])}"
        + (
            f" ({report['unpriced_node_hours']:.4f} node-hours of unpriced instance types left out)"
            if report["unpriced_node_hours"]
            else ""
        )
    )
    types = ", ".join(f"{k} {v:.4f} h" for k, v in report["node_hours_by_instance_type"].items())
    prices = report["prices"]
    console.print(f"prices: {prices['source']} (as of {prices['as_of']}); node-hours by instance type: {types or '-'}")
    start = report["started"]
    table = Table("placement", "market", "workers", "started", "seconds", "ended by", "step", "instance types")
    for placement in report["placements"]:
        table.add_row(
            placement["id"] or "-",
            placement["market"],
            str(placement["workers"]),
            _clock(placement["started"], start),
            f"{placement['seconds']:.1f}",
            placement["ended_by"],
            str(placement["ended_at_step"] if placement["ended_at_step"] is not None else "-"),
            ", ".join(placement["instance_types"]),
        )
    console.print(table)
    for i, reclaim in enumerate(report["preemption_details"], start=1):
        console.print(
            f"preemption {i}: notice {_clock(reclaim['notice'], start)} at step {reclaim['step_at_notice']}, "
            f"just-in-time checkpoint at step {reclaim['just_in_time_step']}, node died "
            f"{_clock(reclaim['node_died'], start)}, resumed {_clock(reclaim['resumed_at'], start)} from step "
            f"{reclaim['resumed_from_step']}, steps lost {reclaim['steps_lost']}"
        )
    checkpoints = report["checkpoints"]
    console.print(
        f"checkpoints: {checkpoints['count']} ({', '.join(f'{k} {v}' for k, v in checkpoints['by_reason'].items())}), "
        f"stall {checkpoints['stall_s']:.2f} s in all"
        + "".join(f"; restore of step {r['step']} {r['seconds']:.2f} s" for r in report["restores"])
    )


def print_sweep(console: Console, report: dict) -> None:
    console.print(
        f"[bold]sweep {report['sweep']}[/] ({report['status']}): {len(report['trials'])} trials in "
        f"{report['wall_s']:.1f} s on {report['gpus_available']:g} GPU(s); by state: "
        + ", ".join(f"{k} {v}" for k, v in report["trials_by_state"].items())
    )
    allocation = report["allocation"]
    per_hour = report["trials_per_gpu_hour"]
    console.print(
        f"GPU share {', '.join(f'{s:g}' for s in report['gpu_share']) or '-'}; trials per GPU-hour "
        f"{per_hour if per_hour is not None else '-'}; allocation "
        f"{f'{allocation:.1%}' if allocation is not None else '-'} ({report['allocation_note']})"
    )
    cost = report["cost"]
    console.print(
        f"GPU-hours spot {report['gpu_hours']['spot']:.4f}, on-demand {report['gpu_hours']['on-demand']:.4f}; "
        f"cost {_money(cost['actual'])}, all on-demand {_money(cost['all_on_demand'])}, saved "
        f"{_money(cost['savings'])}; prices: {report['prices']['source']} (as of {report['prices']['as_of']})"
    )
    table = Table("trial", "state", "GPU share", "metric", "goodput", "seconds", "GPU-hours", "cost")
    for trial in report["trials"]:
        table.add_row(
            trial["run"],
            trial["state"],
            f"{trial['gpu_share']:g}" if trial["gpu_share"] is not None else "-",
            f"{trial['metric']:.4g}" if isinstance(trial["metric"], float) else str(trial["metric"] or "-"),
            f"{trial['goodput']:.3f}" if trial["goodput"] is not None else "-",
            f"{trial['wall_s']:.1f}",
            f"{trial['gpu_hours']:.4f}",
            _money(trial["cost"]),
        )
    console.print(table)
