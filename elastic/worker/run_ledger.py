"""Rank 0's part of the run ledger (elastic.ledger): who the workers are and where, the restore, step timing
in windows (closed at every checkpoint and at least every WINDOW_SECONDS, so a report can tell productive
steps from re-done ones without an event per step), every commit with its stall, reclaim notices, and how the
attempt ended. Other ranks get the null object."""

from __future__ import annotations

import threading
import time
import uuid

import torch.distributed as dist

from elastic.checkpoint.checkpointer import SaveResult
from elastic.ledger import LedgerWriter, NoLedger
from elastic.ledger.events import (
    HANG_REASON,
    AttemptEnded,
    CheckpointCommitted,
    PreemptionNotice,
    Restored,
    Steps,
    WorkersStarted,
    numeric,
)
from elastic.worker.node import describe_nodes, worker_resources

WINDOW_SECONDS = 10.0


class NoAttemptLedger:
    """Null object: ranks other than 0 record nothing."""

    def workers(self, *args, **kwargs) -> None:
        pass

    def restoring(self) -> None:
        pass

    def restored(self, *args, **kwargs) -> None:
        pass

    def training(self) -> None:
        pass

    def stepped(self, step: int, metrics: dict | None, data_wait: float = 0.0) -> None:
        pass

    def noted(self, metrics: dict) -> None:
        pass

    def saving(self, step: int, asynchronous: bool, reason: str) -> None:
        pass

    def committed(self, result: SaveResult) -> None:
        pass

    def notice(self, node_ids, deadline: float | None) -> None:
        pass

    def ended(self, step: int, reason: str) -> None:
        pass

    def hung(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class AttemptLedger:
    """Rank 0 of one worker group (an attempt). Times are wall-clock (unix seconds): the driver's events are
    on the same time line."""

    def __init__(self, writer: LedgerWriter | NoLedger, placement: str | None, clock=time.time):
        self.writer, self.placement, self._clock = writer, placement, clock
        self.attempt = uuid.uuid4().hex[:12]
        self._lock = threading.Lock()  # commits arrive on the save's thread
        self._window_start: float | None = None
        self._first_step: int | None = None
        self._last_step: int | None = None
        self._last_step_at: float | None = None
        self._data_wait = 0.0  # seconds waited for data in the open window
        self._metrics: dict = {}
        self._restore_started: float | None = None
        self._saves: dict[int, tuple[float, bool, str]] = {}  # step -> (started, asynchronous, reason)

    def workers(self, world_size: int, nodes: list[dict], cpus: float, gpus: float) -> None:
        self.writer.record(
            WorkersStarted(
                self._clock(),
                attempt=self.attempt,
                placement=self.placement,
                world_size=world_size,
                cpus_per_worker=cpus,
                gpus_per_worker=gpus,
                nodes=nodes,
            )
        )

    def restoring(self) -> None:
        self._restore_started = self._clock()

    def restored(self, step: int, from_world_size: int, world_size: int) -> None:
        started = self._restore_started if self._restore_started is not None else self._clock()
        self.writer.record(
            Restored(
                started,
                attempt=self.attempt,
                ended=self._clock(),
                step=step,
                from_world_size=from_world_size,
                world_size=world_size,
            )
        )

    def training(self) -> None:
        """The loop starts now (after restore): the first window opens."""
        self._window_start = self._clock()

    def stepped(self, step: int, metrics: dict | None, data_wait: float = 0.0) -> None:
        self._data_wait += data_wait
        if self._window_start is None:  # no restore() call: the window opens at the first step's end
            self._window_start, self._first_step = self._clock(), step + 1
            return
        if self._first_step is None:
            self._first_step = step
        self._last_step, self._last_step_at = step, self._clock()
        if metrics:
            self._metrics = metrics
        if self._clock() - self._window_start >= WINDOW_SECONDS:
            self._close_window()

    def noted(self, metrics: dict) -> None:
        """Metrics of the step just taken, known only after its step() (see Session.log_metrics)."""
        if metrics:
            self._metrics = metrics

    def saving(self, step: int, asynchronous: bool, reason: str) -> None:
        """A save of `step` starts now: the window closes here, so a checkpoint step is always a boundary."""
        self._close_window()
        with self._lock:
            self._saves[step] = (self._clock(), asynchronous, reason)

    def committed(self, result: SaveResult) -> None:
        now = self._clock()
        with self._lock:
            started, asynchronous, reason = self._saves.pop(result.step, (now - result.total_seconds, True, ""))
        # A synchronous save (just-in-time, final) holds the loop until it commits.
        stall = result.blocked_seconds if asynchronous else now - started
        self.writer.record(
            CheckpointCommitted(
                started,
                attempt=self.attempt,
                committed=now,
                step=result.step,
                reason=reason,
                save_s=round(result.total_seconds, 4),
                stall_s=round(stall, 4),
            )
        )

    def notice(self, node_ids, deadline: float | None) -> None:
        self.writer.record(
            PreemptionNotice(
                self._clock(),
                attempt=self.attempt,
                step=self._last_step or 0,
                node_ids=list(node_ids),
                deadline=deadline,
            )
        )

    def ended(self, step: int, reason: str) -> None:
        self._close_window()
        self.writer.record(AttemptEnded(self._clock(), attempt=self.attempt, step=step, reason=reason))

    def hung(self, step: int) -> None:
        """The hang watchdog ends this attempt: its steps stopped at the last one's end, not now."""
        self._close_window(at=self._last_step_at)
        self.writer.record(AttemptEnded(self._clock(), attempt=self.attempt, step=step, reason=HANG_REASON))

    def close(self) -> None:
        self._close_window()
        self.writer.close()

    def _close_window(self, at: float | None = None) -> None:
        if self._window_start is None or self._first_step is None or self._last_step is None:
            return
        if self._last_step < self._first_step:
            return
        now = self._clock() if at is None else at
        self.writer.record(
            Steps(
                self._window_start,
                attempt=self.attempt,
                ended=now,
                first_step=self._first_step,
                last_step=self._last_step,
                metrics=numeric(self._metrics),
                data_wait_s=round(self._data_wait, 4),
            )
        )
        self._window_start, self._first_step, self._data_wait = now, None, 0.0


def attempt_ledger(
    run_uri: str, placement_id: str | None, rank: int, world_size: int, node_id: str, group
) -> AttemptLedger | NoAttemptLedger:
    """Every rank, as a worker group starts: gather every rank's node (a collective on `group`); rank 0 then
    records the group (nodes with their market and instance type, what Ray assigned each worker) and keeps
    the group's ledger."""
    nodes: list = [node_id]
    if group is not None:
        nodes = [None] * world_size
        dist.all_gather_object(nodes, node_id, group=group)
    if rank != 0:
        return NoAttemptLedger()
    attempt = AttemptLedger(LedgerWriter(run_uri, "worker"), placement_id)
    cpus, gpus = worker_resources()
    attempt.workers(world_size, describe_nodes(nodes), cpus, gpus)
    return attempt
