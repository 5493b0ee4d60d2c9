"""Goodput so far, from what one training process knows: its productive step time over the wall time since the
run's start. Pure (no Ray, no torch); the clock is a torch-style Stateful, kept in the checkpoint so the figure
spans placements and restarts."""

from __future__ import annotations

import math
from dataclasses import dataclass


def goodput_so_far(productive_seconds: float, wall_seconds: float) -> float | None:
    """Productive time over wall time, in [0, 1]; None until any wall time has passed. Clamped at 1: productive
    time is measured between steps on one clock and wall time from a start recorded on another (a checkpoint
    written on another node), so rounding may push the raw ratio a hair over."""
    if wall_seconds <= 0 or not math.isfinite(wall_seconds):
        return None
    return max(0.0, min(1.0, productive_seconds / wall_seconds))


@dataclass
class GoodputClock:
    """The run's start (wall clock, seconds since the epoch) and its productive step time so far.

    Productive time is the sum of step intervals (one step() to the next on this rank), less the checkpoint
    stalls inside them; the first step of each session is left out (its interval holds the restore and DDP's
    first construction, which are not training). Steps re-done after a restart count once: the clock restored
    from a checkpoint holds the productive time up to that checkpoint's step only."""

    run_started: float | None = None
    productive_seconds: float = 0.0

    def start(self, now: float) -> None:
        """The run starts now unless a restored checkpoint says it started earlier."""
        if self.run_started is None:
            self.run_started = now

    def add_step(self, seconds: float) -> None:
        self.productive_seconds += max(0.0, seconds)

    def add_stall(self, seconds: float) -> None:
        """A checkpoint's stall of the training loop, measured inside a step interval already added."""
        self.productive_seconds = max(0.0, self.productive_seconds - max(0.0, seconds))

    def goodput(self, now: float) -> float | None:
        if self.run_started is None:
            return None
        return goodput_so_far(self.productive_seconds, now - self.run_started)

    # torch Stateful: tracked by the session, so a resumed run keeps its start and productive time
    def state_dict(self) -> dict:
        return {"run_started": self.run_started, "productive_seconds": self.productive_seconds}

    def load_state_dict(self, state: dict) -> None:
        started = state.get("run_started")
        if started is not None:
            self.run_started = float(started) if self.run_started is None else min(float(started), self.run_started)
        self.productive_seconds = float(state.get("productive_seconds", 0.0))
