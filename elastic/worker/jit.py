"""Just-in-time checkpoints: when a node of the run is being reclaimed, keep training until just before the
deadline, save once, and end the placement so the driver resumes elsewhere with nothing lost.

The notice reaches the workers through Ray Train: a drain of one of the run's nodes (the `elastic
watch-preemption` daemon turns a cloud's spot notice into one) makes Ray's PreemptionWatcher mark every
worker, which is what `ray.train.get_preemption_info()` reports. That public call is a barrier through an
actor, far too slow for every step, so each rank reads its own copy of the mark instead and rank 0 decides.

Two layers:

- `JitPlanner` (pure): from the deadline, the measured step time and the measured save time, is it time to
  save? It keeps training while one more step plus a save plus a margin still fit before the deadline.
- `NoticeChannel`: rank 0's decision reaches every rank through an asynchronous broadcast started at step n and
  read at step n+1 (on a gloo group of its own), so the loop never waits on it and every rank saves at the same
  step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Before any save has been timed: assume a slow one rather than miss the deadline.
DEFAULT_SAVE_SECONDS = 5.0


@dataclass(frozen=True)
class Notice:
    """A reclaim of (some of) the run's nodes: the earliest deadline (unix seconds) and the nodes."""

    deadline: float | None
    node_ids: tuple[str, ...]


class JitPlanner:
    """Pure timing policy of the just-in-time checkpoint (rank 0 runs it)."""

    def __init__(self, margin_seconds: float, clock: Callable[[], float] = time.time):
        self.margin = margin_seconds
        self._clock = clock
        self._step_seconds: float | None = None
        self._save_seconds: float | None = None
        self._report_seconds = 0.0
        self._last_step_at: float | None = None

    def stepped(self) -> None:
        """Called after every step: keeps a moving average of the step time (saves excluded: see saved())."""
        now = self._clock()
        if self._last_step_at is not None:
            seconds = now - self._last_step_at
            self._step_seconds = seconds if self._step_seconds is None else 0.8 * self._step_seconds + 0.2 * seconds
        self._last_step_at = now

    def saved(self, seconds: float) -> None:
        """A save took `seconds` from start to commit; the just-in-time save is planned from the slowest seen
        lately (a decaying max, so one slow save early on does not keep costing steps)."""
        self._save_seconds = seconds if self._save_seconds is None else max(seconds, 0.7 * self._save_seconds)
        self._last_step_at = None  # the step that included a sync save is not a step time

    def reported(self, seconds: float) -> None:
        """Telling Ray Train of a checkpoint took `seconds`; the just-in-time one is reported before the
        placement ends, so it counts too (same decaying max)."""
        self._report_seconds = max(seconds, 0.7 * self._report_seconds)

    @property
    def save_seconds(self) -> float:
        """Start of a save to Ray knowing of it: write, commit and report."""
        write = self._save_seconds if self._save_seconds is not None else DEFAULT_SAVE_SECONDS
        return write + self._report_seconds

    @property
    def step_seconds(self) -> float:
        return self._step_seconds or 0.0

    def save_now(self, notice: Notice, in_flight_seconds: float = 0.0) -> bool:
        """Decided at step n, carried out at step n+1: save then if step n+1, the (waited for) save in flight,
        our save and the margin would not all fit before the deadline after one more step after that."""
        if notice.deadline is None:
            return True  # no deadline given: save at once
        finish_after_next = self._clock() + 2 * self.step_seconds + in_flight_seconds + self.save_seconds + self.margin
        return finish_after_next >= notice.deadline

    def describe(self, notice: Notice) -> str:
        left = (
            "no deadline" if notice.deadline is None else f"{notice.deadline - self._clock():.1f} s before the deadline"
        )
        return f"{left}; step {self.step_seconds:.3f} s, save {self.save_seconds:.2f} s, margin {self.margin:g} s"


def read_ray_notice() -> Notice | None:
    """This worker's copy of Ray Train's preemption mark (what get_preemption_info() would broadcast), or None.

    Reads Ray Train's worker context directly, without the barrier. If a Ray upgrade moves it, the just-in-time
    checkpoint is off (Ray's own restart from the last checkpoint still works) and the session says so once."""
    # Ray Train's context exists only inside a Ray Train worker; imported there, at the call.
    from ray.train.v2._internal.execution.context import get_train_context

    info = get_train_context().preemption_context.preemption_info
    if info is None:
        return None
    deadline = info.deadline_ms / 1000.0 if info.deadline_ms else None
    return Notice(deadline=deadline, node_ids=tuple(info.preempted_node_ids))


class NoticeChannel:
    """Every rank learns, one step late and without waiting, the step rank 0 chose for the save (0: none)."""

    def __init__(self, rank: int, group=None):
        self._rank = rank
        self._group = group
        self._distributed = dist.is_initialized() and dist.get_world_size() > 1
        self._buffer = torch.zeros(1, dtype=torch.int64)
        self._pending = None

    def exchange(self, proposal: int) -> int:
        """Returns the value rank 0 proposed at the previous call; sends this call's proposal (rank 0's counts)."""
        if not self._distributed:
            agreed, self._buffer[0] = int(self._buffer[0]), proposal
            return agreed
        if self._pending is not None:
            self._pending.wait()
        agreed = int(self._buffer[0])
        self._buffer = self._buffer.clone()
        self._buffer[0] = proposal if self._rank == 0 else 0
        self._pending = dist.broadcast(self._buffer, src=0, group=self._group, async_op=True)
        return agreed


class NoJustInTime:
    """Null object: just-in-time checkpoints are off (spec) or cannot be read from this Ray."""

    def due(self, step: int) -> bool:
        return False

    def saved(self, seconds: float) -> None:
        pass

    def reported(self, seconds: float) -> None:
        pass


class JustInTime:
    """Per-rank driver of the just-in-time checkpoint: `due(step)` on every rank after every step says whether
    to save at this step. Rank 0 reads the notice and plans; everyone agrees through the channel."""

    def __init__(
        self,
        rank: int,
        group,
        margin_seconds: float,
        log: Callable[[str], None],
        in_flight: Callable[[], bool] = lambda: False,
        read_notice: Callable[[], Notice | None] = read_ray_notice,
        clock: Callable[[], float] = time.time,
        on_notice: Callable[[Notice, float | None], None] = lambda notice, eta: None,
    ):
        self.rank = rank
        self._on_notice = on_notice  # rank 0, once: the notice and when the checkpoint should commit
        self.planner = JitPlanner(margin_seconds, clock)
        self._channel = NoticeChannel(rank, group)
        self._log = log
        self._in_flight = in_flight
        self._read_notice = read_notice
        self._clock = clock
        self.notice: Notice | None = None
        self._planned: int = 0
        self._unreadable = False

    def due(self, step: int) -> bool:
        self.planner.stepped()
        if self.rank == 0 and not self._planned:
            notice = self._poll()
            if notice is not None:
                if self.notice is None:
                    self._log(
                        f"preemption notice for node(s) {', '.join(n[:12] for n in notice.node_ids)} at step "
                        f"{step}: training on, just-in-time checkpoint planned ({self.planner.describe(notice)})"
                    )
                    eta = notice.deadline - self.planner.margin if notice.deadline is not None else None
                    self._on_notice(notice, eta)
                self.notice = notice
                in_flight = self.planner.save_seconds if self._in_flight() else 0.0
                if self.planner.save_now(notice, in_flight):
                    self._planned = step + 1
        return self._channel.exchange(self._planned) == step

    def saved(self, seconds: float) -> None:
        self.planner.saved(seconds)

    def reported(self, seconds: float) -> None:
        self.planner.reported(seconds)

    def seconds_to_deadline(self) -> float | None:
        if self.notice is None or self.notice.deadline is None:
            return None
        return self.notice.deadline - self._clock()

    def _poll(self) -> Notice | None:
        if self._unreadable:
            return None
        try:
            return self._read_notice()
        except (ImportError, AttributeError) as err:  # Ray moved its worker context: JIT off, Ray's restart remains
            self._unreadable = True
            self._log(f"just-in-time checkpoints off: cannot read Ray Train's preemption mark ({err})")
            return None
