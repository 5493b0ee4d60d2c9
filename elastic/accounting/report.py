"""`elastic report`'s content for a run (or sweep trial) and for a sweep, read from their ledgers.

A run's JSON has goodput, badput (seconds by cause), wall_s, productive_s, preemptions, lost_steps,
gpu_hours {spot, on-demand}, cost {actual, all_on_demand, savings} and placements, then the details (each
preemption's notice, just-in-time step, node death and first resumed step; checkpoints; restores; the prices
used). A sweep's adds trials by state, their GPU shares, trials per GPU-hour and the allocation of the GPUs
(GPU share-seconds held / GPU-seconds available: allocation, never utilization, which nothing here measures).
"""

from __future__ import annotations

from collections import Counter

from elastic.accounting.goodput import Goodput, account, attempts
from elastic.accounting.prices import PriceTable
from elastic.accounting.usage import MARKETS, PlacementSpan, placements, usage
from elastic.ledger import read_ledger
from elastic.ledger.events import (
    CheckpointCommitted,
    Event,
    NodeDied,
    PreemptionNotice,
    Restored,
    RunEnded,
    RunStarted,
    Steps,
    SweepEnded,
    SweepStarted,
)
from elastic.storage import fsspec_filesystem

SWEEP_PLAN_FILE = "elastic-sweep.json"  # written by elastic.sweep.runner in a sweep's experiment folder
ALLOCATION_SAMPLES = 200


def is_sweep(uri: str) -> bool:
    fs, path = fsspec_filesystem(uri.rstrip("/"))
    return fs.exists(f"{path}/{SWEEP_PLAN_FILE}")


INPUT_BOUND_SHARE = 0.05  # of step time spent waiting for data: above it, the run says it is input-bound


def input_bound(productive_s: float, data_wait_s: float) -> dict | None:
    """When the loop waited for data more than INPUT_BOUND_SHARE of its step time: the share and what to change."""
    step_time = productive_s + data_wait_s
    share = data_wait_s / step_time if step_time > 0 else 0.0
    if share <= INPUT_BOUND_SHARE:
        return None
    return {
        "share_of_step_time": round(share, 4),
        "advice": (
            f"the loop waited for data {share:.0%} of its step time; fetch further ahead (StreamingDataset "
            "prefetch=, io_threads=), move decoding and transforms to DataLoader workers (num_workers=), or "
            "write larger row groups (elastic data prepare --row-group-mb) so each fetch carries more rows"
        ),
    }


def run_report(run_uri: str, prices: PriceTable, events: list[Event] | None = None) -> dict:
    events = read_ledger(run_uri) if events is None else events
    result = account(events)
    end = result.segments[-1][1] if result.segments else None
    spans = placements(events, run_end=end)
    used = usage(spans, prices)
    started = next((e for e in events if isinstance(e, RunStarted)), None)
    ended = [e for e in events if isinstance(e, RunEnded)]
    details = preemption_details(events, result)
    return {
        "run": started.run if started else run_uri.rstrip("/").rsplit("/", 1)[-1],
        "run_uri": run_uri,
        "kind": started.kind_of_run if started else "run",
        "status": ended[-1].status if ended else ("RUNNING or lost" if events else "NO LEDGER"),
        "jobs": len(result.segments),
        "goodput": round(result.goodput, 4) if result.goodput is not None else None,
        "badput": {k: round(v, 3) for k, v in result.badput.items()},
        "input_bound": input_bound(result.productive_s, result.badput.get("data_wait", 0.0)),
        "wall_s": round(result.wall_s, 3),
        "productive_s": round(result.productive_s, 3),
        "steps": result.steps,
        "preemptions": len(details),
        "lost_steps": result.lost_steps,
        "gpu_hours": used.gpu_hours,
        "node_hours": used.node_hours,
        "cost": {**used.cost, "currency": "USD"},
        "unpriced_node_hours": used.unpriced_node_hours,
        "node_hours_by_instance_type": used.instance_types,
        "prices": prices.describe(),
        "placements": [span.to_json() for span in spans],
        "preemption_details": details,
        "checkpoints": checkpoint_summary(events),
        "restores": [
            {
                "step": e.step,
                "seconds": round(e.ended - e.time, 3),
                "from_workers": e.from_world_size,
                "workers": e.world_size,
            }
            for e in events
            if isinstance(e, Restored)
        ],
        "started": result.segments[0][0] if result.segments else None,
        "timeline": [(round(a, 3), round(b, 3), cause) for a, b, cause in result.pieces],
        "loss": loss_curve(events),
    }


def preemption_details(events: list[Event], result: Goodput) -> list[dict]:
    """One entry per reclaim: each notice (with its just-in-time checkpoint, the death of its nodes and the
    first step after it), and each death of a node the run trained on that came without a notice."""
    groups = attempts(events)
    deaths = [e for e in events if isinstance(e, NodeDied)]
    commits = [e for e in events if isinstance(e, CheckpointCommitted)]
    noticed_nodes: set[str] = set()
    details = []
    for notice in (e for e in events if isinstance(e, PreemptionNotice)):
        noticed_nodes.update(notice.node_ids)
        jit = next((c for c in commits if c.attempt == notice.attempt and c.reason == "just-in-time"), None)
        died = min((d.time for d in deaths if d.node_id in notice.node_ids), default=None)
        details.append(
            {
                "notice": notice.time,
                "step_at_notice": notice.step,
                "nodes": list(notice.node_ids),
                "deadline": notice.deadline,
                "just_in_time_step": jit.step if jit else None,
                "just_in_time_committed": jit.committed if jit else None,
                "node_died": died,
                **_resumed_after(groups, notice.attempt, notice.time),
            }
        )
    for death in deaths:
        if death.node_id in noticed_nodes:
            continue
        details.append(
            {
                "notice": None,
                "step_at_notice": None,
                "nodes": [death.node_id],
                "deadline": None,
                "just_in_time_step": None,
                "just_in_time_committed": None,
                "node_died": death.time,
                **_resumed_after(groups, None, death.time),
            }
        )
    return sorted(details, key=lambda d: d["notice"] or d["node_died"])


def _resumed_after(groups, attempt: str | None, after: float) -> dict:
    """The first worker group to train after `after` (other than `attempt`): when, from which step, and the
    steps the group before it had taken past that step."""
    following = next((g for g in groups if g.id != attempt and g.started_training > after), None)
    if following is None:
        return {"resumed_at": None, "resumed_from_step": None, "steps_lost": None}
    earlier = [g for g in groups if g.started_training < following.started_training]
    last = max((g.last_step for g in earlier), default=following.resume_step)
    return {
        "resumed_at": following.started_training,
        "resumed_from_step": following.resume_step,
        "steps_lost": max(0, last - following.resume_step),
    }


def checkpoint_summary(events: list[Event]) -> dict:
    commits = [e for e in events if isinstance(e, CheckpointCommitted)]
    return {
        "count": len(commits),
        "by_reason": dict(Counter(c.reason or "periodic" for c in commits)),
        "stall_s": round(sum(c.stall_s for c in commits), 3),
        "mean_save_s": round(sum(c.save_s for c in commits) / len(commits), 3) if commits else None,
        "points": [(c.time, c.committed, c.step, c.reason) for c in commits],
    }


def loss_curve(events: list[Event]) -> list[tuple[float, int, float]]:
    """(time, step, loss) at the end of each step window that carried a loss."""
    return [
        (round(e.ended, 3), e.last_step, e.metrics["loss"])
        for e in events
        if isinstance(e, Steps) and "loss" in e.metrics
    ]


# ---------------------------------------------------------------------------------------------------------
# Sweeps


def sweep_report(experiment_uri: str, prices: PriceTable) -> dict:
    """The sweep's own ledger (start, end, trial states) and each trial's run report (train/<run name>)."""
    events = read_ledger(experiment_uri)
    started = next((e for e in events if isinstance(e, SweepStarted)), None)
    ended = next((e for e in reversed(events) if isinstance(e, SweepEnded)), None)
    fs, path = fsspec_filesystem(experiment_uri.rstrip("/"))
    train = f"{path}/train"
    fs.invalidate_cache(train)
    folders = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(train, detail=False)) if fs.exists(train) else []
    scheme = experiment_uri.split("://", 1)[0] + "://" if "://" in experiment_uri else ""
    states = {t["run_name"]: t for t in (ended.trials if ended else [])}
    trials, reports = [], []
    for name in folders:
        if name.endswith("-probe"):
            continue  # the packing probe, not a trial
        report = run_report(f"{scheme}{train}/{name}", prices)
        if report["status"] == "NO LEDGER":
            continue
        reports.append(report)
        known = states.get(name, {})
        shares = {p["gpus_per_worker"] for p in report["placements"]}
        trials.append(
            {
                "run": name,
                "trial_id": known.get("trial_id"),
                "state": known.get("state") or _state_from(report["status"]),
                "gpu_share": known.get("gpu_share") or (max(shares) if shares else None),
                "metric": known.get("metric"),
                "goodput": report["goodput"],
                "wall_s": report["wall_s"],
                "gpu_hours": round(sum(report["gpu_hours"].values()), 6),
                "cost": report["cost"]["actual"],
                "placements": report["placements"],
            }
        )
    first = min((p["started"] for t in trials for p in t["placements"]), default=None)
    begin = started.time if started else first
    end = ended.time if ended else max((p["ended"] for t in trials for p in t["placements"]), default=begin)
    wall = (end - begin) if begin is not None and end is not None else 0.0
    gpus = started.gpus_available if started else 0.0
    gpu_hours = {m: 0.0 for m in MARKETS}
    cost = {"actual": 0.0, "all_on_demand": 0.0, "savings": 0.0}
    for report in reports:
        for market in MARKETS:
            gpu_hours[market] += report["gpu_hours"][market]
        for key in cost:
            cost[key] += report["cost"][key]
    held = sum(p["gpus_per_worker"] * p["workers"] * p["seconds"] for t in trials for p in t["placements"])
    total_gpu_hours = sum(gpu_hours.values())
    done = sum(t["state"] in ("TERMINATED", "STOPPED") for t in trials)
    return {
        "sweep": started.sweep if started else experiment_uri.rstrip("/").rsplit("/", 1)[-1],
        "experiment": experiment_uri,
        "status": "ENDED" if ended else "RUNNING or lost",
        "wall_s": round(wall, 3),
        "trials": trials,
        "trials_by_state": dict(Counter(t["state"] for t in trials)),
        "gpu_share": sorted({t["gpu_share"] for t in trials if t["gpu_share"] is not None}),
        "gpus_available": gpus,
        "gpu_hours": {k: round(v, 6) for k, v in gpu_hours.items()},
        "cost": {**{k: round(v, 6) for k, v in cost.items()}, "currency": "USD"},
        "prices": prices.describe(),
        "trials_per_gpu_hour": round(done / total_gpu_hours, 3) if total_gpu_hours > 0 else None,
        "allocation": round(held / (gpus * wall), 4) if gpus > 0 and wall > 0 else None,
        "allocation_note": "GPU share-seconds held by trial workers / GPU-seconds available (allocation, "
        "not utilization: nothing measures utilization on logical GPUs)",
        "allocation_over_time": allocation_over_time(
            [PlacementSpan(**_span_args(p)) for t in trials for p in t["placements"]], gpus, begin, end
        ),
        "started": begin,
    }


def _state_from(status: str) -> str:
    return {"SUCCEEDED": "TERMINATED", "FAILED": "ERROR"}.get(status, "RUNNING or stopped")


def _span_args(placement: dict) -> dict:
    return {
        "id": placement["id"],
        "market": placement["market"],
        "workers": placement["workers"],
        "started": placement["started"],
        "ended": placement["ended"],
        "ended_by": placement["ended_by"],
        "step": placement["ended_at_step"],
        "gpus_per_worker": placement["gpus_per_worker"],
        "cpus_per_worker": 0.0,
    }


def allocation_over_time(
    spans: list[PlacementSpan], gpus: float, begin: float | None, end: float | None
) -> list[tuple[float, float]]:
    """(seconds since the start, GPUs held / GPUs available) at evenly spaced instants."""
    if not gpus or begin is None or end is None or end <= begin:
        return []
    samples = []
    for i in range(ALLOCATION_SAMPLES + 1):
        t = begin + (end - begin) * i / ALLOCATION_SAMPLES
        held = sum(s.gpus_per_worker * s.workers for s in spans if s.started <= t < s.ended)
        samples.append((round(t - begin, 3), round(held / gpus, 4)))
    return samples
