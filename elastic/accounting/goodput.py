"""Goodput and badput of a run, in the manner of Google's ml-goodput-measurement: every second of the run's
wall time (from each driver's start to its end; a resubmitted run adds each job's time) is given to exactly
one cause, so productive time plus badput is the wall time.

Causes, by priority where they overlap (a placement started ahead trains while the next one starts up):
- checkpoint_stall: the training loop held by a save (staging; the whole of a synchronous save);
- restore: loading the checkpoint a worker group resumed from;
- lost_work_redone: step time of steps a later worker group did again (it resumed from an older checkpoint);
- productive: step time of steps that stayed;
- waiting_for_capacity: the driver waiting for free slots or for spot;
- otherwise, by where the second falls: before the run's first step of a job, `startup` (driver, Ray starting
  the workers, the job's own setup), as after a placement that ended for a resize or a move to spot; after a
  worker group that ended at a reclaim or died with a node, `preemption_gap` (until the next group trains);
  after one that died with no node lost, `failure_recovery`; after the last step, `other` (the final
  teardown).
- data_wait: the part of productive step time the loop spent waiting for its batches (each step window of the
  ledger says how much; spread through the steps, it is taken out of productive time in the totals, not shown
  as intervals of its own on the timeline);
- hang: from the last step of a worker group that stopped making progress to the moment the hang watchdog
  ended it (its attempt ended with reason "hang"); the restart after it is `failure_recovery`.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field

from elastic.ledger.events import (
    HANG_REASON,
    AttemptEnded,
    CapacityWaited,
    CheckpointCommitted,
    Event,
    NodeDied,
    PreemptionNotice,
    Restored,
    RunEnded,
    RunStarted,
    Steps,
)

CAUSES = (
    "startup",
    "waiting_for_capacity",
    "restore",
    "checkpoint_stall",
    "data_wait",
    "lost_work_redone",
    "preemption_gap",
    "failure_recovery",
    "hang",
    "other",
)
_PRIORITY = ("checkpoint_stall", "restore", "lost_work_redone", "productive", "waiting_for_capacity", "hang")
# A node that died this long before the next worker group trained explains the gap as a reclaim.
NODE_DEATH_WINDOW_S = 120.0


@dataclass(frozen=True)
class Attempt:
    """One worker group's record: its step windows, restore and how it ended."""

    id: str
    windows: list[Steps]
    restored: Restored | None
    ended: AttemptEnded | None

    @property
    def started_training(self) -> float:
        return self.windows[0].time

    @property
    def finished_training(self) -> float:
        return self.windows[-1].ended

    @property
    def last_step(self) -> int:
        return self.windows[-1].last_step

    @property
    def resume_step(self) -> int:
        """The step it continued from: the restored checkpoint's, else the step before its first window."""
        return self.restored.step if self.restored is not None else self.windows[0].first_step - 1


@dataclass
class Goodput:
    wall_s: float
    productive_s: float
    badput: dict[str, float]
    lost_steps: int
    steps: int  # optimizer steps the run kept (the last step reached)
    segments: list[tuple[float, float]] = field(default_factory=list)  # each job's [start, end]
    redone: list[tuple[float, float]] = field(default_factory=list)
    pieces: list[tuple[float, float, str]] = field(default_factory=list)  # the wall time, cause by cause

    @property
    def goodput(self) -> float | None:
        return self.productive_s / self.wall_s if self.wall_s > 0 else None


def job_segments(events: list[Event]) -> list[tuple[float, float]]:
    """Each driver's [start, end]: RunStarted to its RunEnded, or to the last event before the next start when
    the driver died without one."""
    segments: list[tuple[float, float]] = []
    start: float | None = None
    last = 0.0
    for event in events:
        if isinstance(event, RunStarted):
            if start is not None:
                segments.append((start, last))
            start = event.time
        elif isinstance(event, RunEnded) and start is not None:
            segments.append((start, event.time))
            start = None
        last = max(last, getattr(event, "ended", 0.0) or 0.0, getattr(event, "committed", 0.0) or 0.0, event.time)
    if start is not None:
        segments.append((start, last))
    return [(a, b) for a, b in segments if b > a]


def attempts(events: list[Event]) -> list[Attempt]:
    """Worker groups that trained, in the order they began training."""
    windows: dict[str, list[Steps]] = defaultdict(list)
    restored: dict[str, Restored] = {}
    ended: dict[str, AttemptEnded] = {}
    for event in events:
        if isinstance(event, Steps):
            windows[event.attempt].append(event)
        elif isinstance(event, Restored):
            restored[event.attempt] = event
        elif isinstance(event, AttemptEnded):
            ended[event.attempt] = event
    found = [
        Attempt(key, sorted(found, key=lambda w: w.time), restored.get(key), ended.get(key))
        for key, found in windows.items()
    ]
    return sorted(found, key=lambda a: a.started_training)


def redone_work(groups: list[Attempt]) -> tuple[int, list[tuple[float, float]]]:
    """Steps a later worker group did again, and the wall-time intervals they had first taken (the tail of
    each window past the step the next group resumed from; windows close at every save, so a checkpoint
    step is a window boundary)."""
    lost = 0
    intervals: list[tuple[float, float]] = []
    for current, following in zip(groups, groups[1:]):
        resume = following.resume_step
        if current.last_step <= resume:
            continue
        lost += current.last_step - resume
        for window in current.windows:
            if window.last_step <= resume:
                continue
            count = window.last_step - window.first_step + 1
            kept = max(0, resume - window.first_step + 1)
            span = window.ended - window.time
            intervals.append((window.ended - span * (count - kept) / count, window.ended))
    return lost, intervals


class _Cover:
    """Merged, sorted intervals of one cause: `covers(t)` by bisection."""

    def __init__(self, intervals):
        merged: list[list[float]] = []
        for a, b in sorted((a, b) for a, b in intervals if b > a):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.starts = [a for a, _ in merged]
        self.spans = merged

    def covers(self, t: float) -> bool:
        i = bisect.bisect_right(self.starts, t) - 1
        return i >= 0 and self.spans[i][0] <= t < self.spans[i][1]

    def points(self) -> list[float]:
        return [p for span in self.spans for p in span]


def account(events: list[Event]) -> Goodput:
    """Productive time and badput by cause over the run's wall time (see the module docstring)."""
    segments = job_segments(events)
    groups = attempts(events)
    lost, redone = redone_work(groups)
    covers = {
        "checkpoint_stall": _Cover((e.time, e.time + e.stall_s) for e in events if isinstance(e, CheckpointCommitted)),
        "restore": _Cover((e.time, e.ended) for e in events if isinstance(e, Restored)),
        "lost_work_redone": _Cover(redone),
        "productive": _Cover((w.time, w.ended) for g in groups for w in g.windows),
        "waiting_for_capacity": _Cover((e.time, e.ended) for e in events if isinstance(e, CapacityWaited)),
        "hang": _Cover(
            (g.finished_training, g.ended.time)
            for g in groups
            if g.ended is not None and g.ended.reason == HANG_REASON and g.ended.time > g.finished_training
        ),
    }
    deaths = sorted(e.time for e in events if isinstance(e, NodeDied))
    noticed = {e.attempt for e in events if isinstance(e, PreemptionNotice)}
    totals = dict.fromkeys(("productive", *CAUSES), 0.0)
    pieces: list[tuple[float, float, str]] = []
    for start, end in segments:
        points = {start, end}
        for cover in covers.values():
            points.update(p for p in cover.points() if start < p < end)
        inside = [g for g in groups if start <= g.started_training < end]
        points.update(g.started_training for g in inside)
        points.update(g.finished_training for g in inside if g.finished_training < end)
        ordered = sorted(points)
        for a, b in zip(ordered, ordered[1:]):
            middle = (a + b) / 2
            cause = next((name for name in _PRIORITY if covers[name].covers(middle)), None)
            if cause is None:
                cause = _between_groups(middle, inside, deaths, noticed)
            totals[cause] += b - a
            if pieces and pieces[-1][2] == cause and pieces[-1][1] == a:
                pieces[-1] = (pieces[-1][0], b, cause)
            else:
                pieces.append((a, b, cause))
    waited = min(_data_wait(groups, pieces), totals["productive"])
    totals["productive"] -= waited
    totals["data_wait"] = waited
    wall = sum(b - a for a, b in segments)
    return Goodput(
        wall_s=wall,
        productive_s=totals.pop("productive"),
        badput=totals,
        lost_steps=lost,
        steps=max((g.last_step for g in groups), default=0),
        segments=segments,
        redone=covers["lost_work_redone"].spans,
        pieces=pieces,
    )


def _data_wait(groups: list[Attempt], pieces: list[tuple[float, float, str]]) -> float:
    """Seconds of productive time the loop spent waiting for data: each window's wait, in the share of the
    window that stayed productive (a window re-done later counts as lost work, its waits included)."""
    productive = [(a, b) for a, b, cause in pieces if cause == "productive"]
    starts = [a for a, _ in productive]
    waited = 0.0
    for group in groups:
        for window in group.windows:
            length = window.ended - window.time
            if window.data_wait_s <= 0 or length <= 0:
                continue
            kept, i = 0.0, max(0, bisect.bisect_right(starts, window.time) - 1)
            while i < len(productive) and productive[i][0] < window.ended:
                kept += max(0.0, min(window.ended, productive[i][1]) - max(window.time, productive[i][0]))
                i += 1
            waited += min(window.data_wait_s, length) * kept / length
    return waited


def _between_groups(t: float, groups: list[Attempt], deaths: list[float], noticed: set[str]) -> str:
    """The cause of a second no interval explains, from the worker groups around it."""
    before = [g for g in groups if g.finished_training <= t]
    after = [g for g in groups if g.started_training > t]
    if not before:
        return "startup"
    if not after:
        return "other"
    previous, following = max(before, key=lambda g: g.finished_training), min(after, key=lambda g: g.started_training)
    reason = previous.ended.reason if previous.ended is not None else None
    if reason == "preemption" or previous.id in noticed:
        return "preemption_gap"
    if reason == HANG_REASON:
        return "failure_recovery"  # ended by the watchdog: the restart after it
    if reason is not None:
        return "startup"  # a clean end for a resize or a move to spot: the next group's start-up
    died = any(previous.finished_training - NODE_DEATH_WINDOW_S <= d <= following.started_training for d in deaths)
    return "preemption_gap" if died else "failure_recovery"
