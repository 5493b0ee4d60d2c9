"""The report's PNG timeline (matplotlib, no display needed).

A run: its placements as bars coloured by market, the wall time shaded by badput cause underneath them,
reclaim notices, just-in-time checkpoints and node deaths marked; the loss curve below. A sweep: one bar per
trial placement coloured by state, and the allocation of the GPUs over time below."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a cluster head or in CI
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.patches import Patch  # noqa: E402

MARKET_COLOURS = {"spot": "tab:orange", "on-demand": "tab:blue"}
CAUSE_COLOURS = {
    "startup": "#bbbbbb",
    "waiting_for_capacity": "#888888",
    "restore": "tab:purple",
    "checkpoint_stall": "tab:olive",
    "data_wait": "tab:cyan",
    "lost_work_redone": "tab:brown",
    "preemption_gap": "tab:red",
    "failure_recovery": "#aa0000",
    "hang": "tab:pink",
    "other": "#dddddd",
}
STATE_COLOURS = {"TERMINATED": "tab:green", "STOPPED": "tab:gray", "ERROR": "tab:red"}


def plot_run(report: dict, path: Path) -> None:
    start = report["started"] or 0.0
    figure, (timeline, loss) = plt.subplots(
        2, 1, figsize=(11, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]}, constrained_layout=True
    )
    placements = report["placements"]
    for row, placement in enumerate(placements):
        timeline.barh(
            row + 1,
            placement["seconds"],
            left=placement["started"] - start,
            color=MARKET_COLOURS.get(placement["market"], "tab:gray"),
            edgecolor="black",
            height=0.6,
        )
        timeline.text(
            placement["started"] - start,
            row + 1.38,
            f"{placement['workers']} worker(s); end: {placement['ended_by']}",
            fontsize=7,
        )
    for a, b, cause in report["timeline"]:  # row 0: what each second of wall time went to
        if cause != "productive":
            timeline.barh(0, b - a, left=a - start, color=CAUSE_COLOURS.get(cause, "#cccccc"), height=0.6)
        else:
            timeline.barh(0, b - a, left=a - start, color="tab:green", height=0.6)
    for reclaim in report["preemption_details"]:
        if reclaim["notice"] is not None:
            timeline.axvline(reclaim["notice"] - start, color="tab:orange", linestyle="--", linewidth=1)
        if reclaim["just_in_time_committed"] is not None:
            timeline.plot(reclaim["just_in_time_committed"] - start, len(placements) + 0.8, "v", color="tab:green")
        if reclaim["node_died"] is not None:
            timeline.plot(reclaim["node_died"] - start, len(placements) + 0.8, "X", color="tab:red")
    timeline.set_yticks(
        range(len(placements) + 1), ["wall time", *[f"placement {i + 1}" for i in range(len(placements))]]
    )
    timeline.set_ylim(-0.6, len(placements) + 1.3)
    goodput = report["goodput"]
    timeline.set_title(
        f"{report['run']}: goodput {goodput:.3f}, {report['preemptions']} preemption(s), "
        f"{report['lost_steps']} steps lost, cost USD {report['cost']['actual']:.4f} "
        f"(all on-demand USD {report['cost']['all_on_demand']:.4f})"
        if goodput is not None
        else report["run"]
    )
    legend = [Patch(color=c, label=f"{m} placement") for m, c in MARKET_COLOURS.items()]
    legend += [Patch(color="tab:green", label="productive")]
    legend += [
        Patch(color=CAUSE_COLOURS[c], label=c.replace("_", " ")) for c in CAUSE_COLOURS if report["badput"].get(c)
    ]
    legend += [
        plt.Line2D([], [], color="tab:orange", linestyle="--", label="reclaim notice"),
        plt.Line2D([], [], color="tab:green", marker="v", linestyle="", label="just-in-time checkpoint"),
        plt.Line2D([], [], color="tab:red", marker="X", linestyle="", label="node died"),
    ]
    timeline.legend(handles=legend, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    curve = report["loss"]
    if curve:
        loss.plot([t - start for t, _, _ in curve], [value for _, _, value in curve], color="black", linewidth=1)
    loss.set_ylabel("loss")
    loss.set_xlabel("seconds since the run started")
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_sweep(report: dict, path: Path) -> None:
    start = report["started"] or 0.0
    figure, (bars, allocation) = plt.subplots(
        2, 1, figsize=(11, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]}, constrained_layout=True
    )
    for row, trial in enumerate(report["trials"]):
        for placement in trial["placements"]:
            bars.barh(
                row,
                placement["seconds"],
                left=placement["started"] - start,
                color=STATE_COLOURS.get(trial["state"], "tab:blue"),
                edgecolor="black",
                height=0.6,
            )
    bars.set_yticks(range(len(report["trials"])), [t["run"] for t in report["trials"]], fontsize=7)
    bars.set_title(
        f"{report['sweep']}: {len(report['trials'])} trials, "
        + ", ".join(f"{k} {v}" for k, v in report["trials_by_state"].items())
    )
    bars.legend(handles=[Patch(color=c, label=s) for s, c in STATE_COLOURS.items()], fontsize=7)
    samples = report["allocation_over_time"]
    if samples:
        allocation.step([t for t, _ in samples], [v for _, v in samples], where="post", color="tab:blue")
    allocation.set_ylim(0, 1.05)
    allocation.set_ylabel("GPU allocation")
    allocation.set_xlabel("seconds since the sweep started (allocation: GPU shares held / GPUs, not utilization)")
    figure.savefig(path, dpi=110)
    plt.close(figure)
