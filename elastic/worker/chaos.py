"""Fault injection for tests, the demo and `verify-resume`: kill a worker process at a chosen step, once.

Set ELASTIC_CHAOS_KILL_AT="STEP[:RANK[:save]],..." in the job's environment (runtime_env.env_vars):

- ``30:1`` kills rank 1 right after its 30th optimizer step;
- ``40:0:save`` kills rank 0 inside the checkpoint of step 40, after every shard is written but before the
  commit marker; any other rank dies before writing its shard. Either way that checkpoint is torn, and the
  restart must fall back to the one before.

A planned kill leaves a marker in the run folder before the process dies, so the restarted run (which replays
from its last checkpoint) does not fire it again.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from elastic.checkpoint.store import CheckpointStore

KILL_AT_VARIABLE = "ELASTIC_CHAOS_KILL_AT"


@dataclass(frozen=True)
class Kill:
    step: int
    rank: int = 0
    during_save: bool = False

    def __str__(self) -> str:
        return f"{self.step}:{self.rank}" + (":save" if self.during_save else "")


def parse_plan(text: str) -> list[Kill]:
    """"30:1,45,40:0:save" -> kill rank 1 at step 30, rank 0 at step 45, rank 0 inside the save of step 40."""
    plan = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        fields = item.split(":")
        if len(fields) > 3 or (len(fields) == 3 and fields[2] != "save"):
            raise ValueError(f"{KILL_AT_VARIABLE}: {item!r} is not STEP[:RANK[:save]]")
        plan.append(Kill(int(fields[0]), int(fields[1]) if len(fields) > 1 and fields[1] else 0,
                         len(fields) == 3))
    return plan


def format_plan(plan: list[Kill]) -> str:
    return ",".join(map(str, plan))


class Chaos:
    """Kills this worker at planned points; a null object (never kills) when nothing is planned."""

    def __init__(self, store: CheckpointStore, rank: int, plan: list[Kill] | None = None):
        self.store = store
        self.rank = rank
        kills = plan if plan is not None else parse_plan(os.environ.get(KILL_AT_VARIABLE, ""))
        self.at_step = {k.step for k in kills if k.rank == rank and not k.during_save}
        self.in_save = {k.step for k in kills if k.rank == rank and k.during_save}

    def maybe_kill(self, step: int) -> None:
        """Called after every optimizer step."""
        if step in self.at_step:
            self._kill(f"step-{step}", f"at step {step}")

    def maybe_kill_in_save(self, step: int, phase: str) -> None:
        """Called by the checkpointer at phase "write" (before this rank's shard) and "commit" (rank 0, shards
        and metadata durable, marker not yet written)."""
        if step in self.in_save and phase == ("commit" if self.rank == 0 else "write"):
            self._kill(f"save-{step}", f"inside the checkpoint of step {step} ({phase})")

    def _kill(self, name: str, where: str) -> None:
        marker = f"{self.store.root}/chaos/kill-{name}-rank-{self.rank}"
        if self.store.fs.exists(marker):
            return  # already fired before the restart that replays this step
        self.store.fs.makedirs(f"{self.store.root}/chaos", exist_ok=True)
        with self.store.fs.open(marker, "w") as handle:
            handle.write("killed\n")
        sys.stdout.write(f"[elastic] chaos: killing rank {self.rank} {where}\n")
        sys.stdout.flush()
        os._exit(137)  # like a SIGKILL: no cleanup, no exception handling
