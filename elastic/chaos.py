"""Fault injection for tests, the demo and `verify-resume`: kill a worker process at a chosen step, once.

Set ELASTIC_CHAOS_KILL_AT="STEP[:RANK],..." in the job's environment (runtime_env.env_vars). The harness
calls `maybe_kill(step)` after every optimizer step; a planned kill leaves a marker in the run folder before
the process dies, so the restarted run (which replays from its last checkpoint) does not fire it again.
"""

from __future__ import annotations

import os
import sys

from elastic.checkpoint import CheckpointStore

KILL_AT_VARIABLE = "ELASTIC_CHAOS_KILL_AT"


def parse_plan(text: str) -> list[tuple[int, int]]:
    """"30:1,45" -> [(30, 1), (45, 0)]: kill rank 1 at step 30 and rank 0 at step 45."""
    plan = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        step, _, rank = item.partition(":")
        plan.append((int(step), int(rank or 0)))
    return plan


class Chaos:
    """Kills this worker at planned steps; a null object (never kills) when nothing is planned."""

    def __init__(self, store: CheckpointStore, rank: int, plan: list[tuple[int, int]] | None = None):
        self.store = store
        self.rank = rank
        raw = os.environ.get(KILL_AT_VARIABLE, "")
        self.plan = {step for step, r in (plan if plan is not None else parse_plan(raw)) if r == rank}

    def maybe_kill(self, step: int) -> None:
        if step not in self.plan:
            return
        marker = f"{self.store.root}/chaos/kill-step-{step}-rank-{self.rank}"
        if self.store.fs.exists(marker):
            return  # already fired before the restart that replays this step
        self.store.fs.makedirs(f"{self.store.root}/chaos", exist_ok=True)
        with self.store.fs.open(marker, "w") as handle:
            handle.write("killed\n")
        sys.stdout.write(f"[elastic] chaos: killing rank {self.rank} at step {step}\n")
        sys.stdout.flush()
        os._exit(137)  # like a SIGKILL: no cleanup, no exception handling
