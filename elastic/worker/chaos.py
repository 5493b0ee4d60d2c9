"""Fault injection for tests, the demo and `verify-resume`: kill a worker process at a chosen step, once, or
make a reclaim notice arrive.

Set ELASTIC_CHAOS_KILL_AT="STEP[:RANK[:save|notice|hang]],..." in the job's environment (runtime_env.env_vars):

- ``30:1`` kills rank 1 right after its 30th optimizer step;
- ``40:0:save`` kills rank 0 inside the checkpoint of step 40, after every shard is written but before the
  commit marker; any other rank dies before writing its shard. Either way that checkpoint is torn, and the
  restart must fall back to the one before.
- ``50:0:notice`` makes a spot reclaim notice (no deadline) reach the run after step 50, as Ray Train's
  preemption mark would: the run writes its just-in-time checkpoint and the driver resumes it from there.
  Notices are read by rank 0, so their rank is always 0.
- ``25:1:hang`` makes rank 1 stop right after its 25th step, alive but making no progress (as a rank stuck in
  a collective or a dead NFS read would): the hang watchdog (elastic.worker.watchdog) must catch it.

ELASTIC_CHAOS_FINISH_DELAY="RANK:SECONDS" makes that rank wait before it settles the run's final report
(Session.finish), so its reporter thread has long sent the last checkpoint's report: the order of the race
between the ranks' final reports is chosen by the test instead of by timing.

ELASTIC_CHAOS_STEP_SECONDS=0.2 makes every worker sleep that long after each step: a chaos soak stretches a
fast job with it, so that a reclaim with notice still finds the run training (sleeping changes no numbers).

A planned fault leaves a marker in the run folder when it fires, so the restarted run (which replays from its
last checkpoint) does not fire it again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from elastic.checkpoint.store import CheckpointStore
from elastic.worker.jit import Notice

KILL_AT_VARIABLE = "ELASTIC_CHAOS_KILL_AT"
STEP_SECONDS_VARIABLE = "ELASTIC_CHAOS_STEP_SECONDS"
FINISH_DELAY_VARIABLE = "ELASTIC_CHAOS_FINISH_DELAY"
KINDS = ("save", "notice", "hang")

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kill:
    step: int
    rank: int = 0
    during_save: bool = False
    notice: bool = False  # not a kill: a reclaim notice (just-in-time checkpoint, then a new placement)
    hang: bool = False  # not a kill: the rank stops making progress, alive

    def __str__(self) -> str:
        kind = ":save" if self.during_save else ":notice" if self.notice else ":hang" if self.hang else ""
        return f"{self.step}:{self.rank}{kind}"


def parse_plan(text: str) -> list[Kill]:
    """ "30:1,45,40:0:save,60:0:notice,70:1:hang" -> kill rank 1 at step 30, rank 0 at step 45, rank 0 inside the
    save of step 40, a reclaim notice after step 60, and rank 1 hung after step 70."""
    plan = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        fields = item.split(":")
        if len(fields) > 3 or (len(fields) == 3 and fields[2] not in KINDS):
            raise ValueError(f"{KILL_AT_VARIABLE}: {item!r} is not STEP[:RANK[:save|notice|hang]]")
        rank = int(fields[1]) if len(fields) > 1 and fields[1] else 0
        kind = fields[2] if len(fields) == 3 else ""
        if kind == "notice" and rank != 0:
            raise ValueError(f"{KILL_AT_VARIABLE}: {item!r}: a notice is read by rank 0; write {fields[0]}:0:notice")
        plan.append(Kill(int(fields[0]), rank, kind == "save", kind == "notice", kind == "hang"))
    return plan


def format_plan(plan: list[Kill]) -> str:
    return ",".join(map(str, plan))


class Chaos:
    """Kills this worker at planned points; a null object (never kills) when nothing is planned."""

    def __init__(self, store: CheckpointStore, rank: int, plan: list[Kill] | None = None):
        self.store = store
        self.rank = rank
        kills = plan if plan is not None else parse_plan(os.environ.get(KILL_AT_VARIABLE, ""))
        mine = [k for k in kills if k.rank == rank]
        self.at_step = {k.step for k in mine if not (k.during_save or k.notice or k.hang)}
        self.in_save = {k.step for k in mine if k.during_save}
        self.notices = sorted(k.step for k in mine if k.notice)
        self.hangs = {k.step for k in mine if k.hang}
        self._step = 0
        self._notice: Notice | None = None
        self.step_seconds = float(os.environ.get(STEP_SECONDS_VARIABLE) or 0)
        self.finish_delay = _finish_delay(os.environ.get(FINISH_DELAY_VARIABLE, ""), rank)

    def maybe_kill(self, step: int) -> None:
        """Called after every optimizer step."""
        self._step = step
        if self.step_seconds:
            time.sleep(self.step_seconds)
        if step in self.at_step:
            self._kill(f"step-{step}", f"at step {step}")
        if step in self.hangs and self._mark(f"hang-{step}"):
            self._say(f"rank {self.rank} hangs after step {step}")
            threading.Event().wait()  # alive, never stepping again: only the hang watchdog ends this

    def before_final_report(self) -> None:
        """Session.finish, before it settles the final report: ELASTIC_CHAOS_FINISH_DELAY's wait on this rank."""
        if self.finish_delay:
            self._say(f"rank {self.rank} waits {self.finish_delay:g} s before settling the final report")
            time.sleep(self.finish_delay)

    def notice_source(self, read: Callable[[], Notice | None]) -> Callable[[], Notice | None]:
        """`read` (Ray Train's preemption mark), with the planned notices arriving at their steps."""
        if not self.notices:
            return read

        def source() -> Notice | None:
            if self._notice is None:
                for step in [s for s in self.notices if s <= self._step]:
                    self.notices.remove(step)
                    if self._mark(f"notice-{step}"):
                        self._say(f"reclaim notice after step {step}")
                        self._notice = Notice(deadline=None, node_ids=("chaos",))
                        break
            return self._notice or read()

        return source

    def maybe_kill_in_save(self, step: int, phase: str) -> None:
        """Called by the checkpointer at phase "write" (before this rank's shard) and "commit" (rank 0, shards
        and metadata durable, marker not yet written)."""
        if step in self.in_save and phase == ("commit" if self.rank == 0 else "write"):
            self._kill(f"save-{step}", f"inside the checkpoint of step {step} ({phase})")

    def _kill(self, name: str, where: str) -> None:
        if not self._mark(f"kill-{name}"):
            return  # already fired before the restart that replays this step
        self._say(f"killing rank {self.rank} {where}")
        os._exit(137)  # like a SIGKILL: no cleanup, no exception handling

    def _mark(self, name: str) -> bool:
        """Leave the fault's marker; False if it was already there (the fault fired before a restart)."""
        marker = f"{self.store.root}/chaos/{name}-rank-{self.rank}"
        if self.store.fs.exists(marker):
            return False
        self.store.fs.makedirs(f"{self.store.root}/chaos", exist_ok=True)
        with self.store.fs.open(marker, "w") as handle:
            handle.write("fired\n")
        return True

    def _say(self, what: str) -> None:
        _log.info(f"chaos: {what}")  # flushed at once (a StreamHandler's emit does): os._exit may follow


def _finish_delay(text: str, rank: int) -> float:
    """ "1:3" -> 3.0 on rank 1, 0 elsewhere."""
    if not text:
        return 0.0
    try:
        chosen, seconds = text.split(":")
        return float(seconds) if int(chosen) == rank else 0.0
    except ValueError:
        raise ValueError(f"{FINISH_DELAY_VARIABLE}={text!r}: expected RANK:SECONDS, e.g. 1:3") from None
