"""Ending this placement at a checkpoint: when the driver asks (spot-first moving to spot, an elastic run
growing) or at a reclaim notice (a just-in-time checkpoint). Either way every rank raises PlacementEnded once
the checkpoint has committed and Ray Train knows of it; the driver resumes the run from it elsewhere."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from elastic.checkpoint.checkpointer import SaveResult
from elastic.config.spec import CheckpointSpec
from elastic.errors import PlacementEnded
from elastic.worker.jit import JustInTime, NoJustInTime, Notice
from elastic.worker.reporting import CommitReports

_log = logging.getLogger(__name__)


class PlacementEnding:
    """The placement watch (the driver's side) and the just-in-time policy (reclaim notices) of one rank.

    `wait_for_save` waits for the save in flight and logs its failure (a failed save keeps the placement:
    training goes on and the next checkpoint tries again)."""

    def __init__(self, watch, reports: CommitReports, rank: int, wait_for_save: Callable[[], SaveResult | None]):
        self.watch = watch
        self._reports = reports
        self._rank = rank
        self._wait_for_save = wait_for_save
        self.jit: JustInTime | NoJustInTime = NoJustInTime()
        # Rank 0, at a reclaim notice: (node ids, the cloud's deadline) for the run ledger.
        self.on_notice: Callable[[tuple[str, ...], float | None], None] = lambda nodes, deadline: None
        # Before a wait that is not a hang (the hang watchdog, elastic.worker.watchdog, must not end it).
        self.pause_watchdog: Callable[[], None] = lambda: None

    def join(self, node_id: str, world_size: int, group) -> None:
        """Before any step: name every rank's node, and wait for the placement this one follows, if any."""
        if self.watch.can_end:
            # The acknowledgement of an ended placement names every rank's node, so the driver can start the
            # next placement while this one's workers are still shutting down.
            nodes: list = [node_id]
            if group is not None:
                nodes = [None] * world_size
                dist.all_gather_object(nodes, node_id, group=group)
            self.watch.rank_nodes = nodes
        # Started ahead of a placement that is ending at a just-in-time checkpoint: nothing is read before
        # that checkpoint has committed (or the driver calls this placement off).
        if not self.watch.wait_for_predecessor():
            self._say("placement called off: the placement it was to follow went on")
            raise PlacementEnded(-1)

    def watch_notices(
        self, spec: CheckpointSpec, in_flight: Callable[[], bool], read_notice: Callable[[], Notice | None]
    ) -> None:
        if spec.just_in_time:
            group = dist.new_group(backend="gloo") if dist.is_initialized() else None  # its own: never races saves
            self.jit = JustInTime(
                self._rank,
                group,
                spec.jit_margin_seconds,
                self._say,
                in_flight=in_flight,
                on_notice=self._announce,
                read_notice=read_notice,
            )

    def at_checkpoint(self) -> None:
        """After a checkpoint has started, if the driver asked this placement to end: wait for its commit and
        Ray's report, and end the placement on every rank."""
        result = self._wait_for_save()
        if result is None or not result.committed:
            return
        self._reports.report_ending(result.step, {"step": result.step})  # Ray knows it before the end
        reason = self.watch.acknowledge(result.step)
        self._say(f"placement ends at the checkpoint of step {result.step} ({reason})")
        raise PlacementEnded(result.step, reason)

    def just_in_time(self, save_now: Callable[[], SaveResult | None], metrics: dict | None) -> None:
        """A node of this run is being reclaimed and the deadline is near: save now (every rank), wait for the
        commit and Ray's report, and end the placement. The driver resumes the run from this checkpoint on the
        nodes that remain (or a replacement); no step taken is lost. If the save fails, training goes on and
        Ray's own restart from the last checkpoint remains."""
        started = time.monotonic()
        result = save_now()
        if result is None or not result.committed:
            return
        self._reports.report_ending(result.step, {"step": result.step, **(metrics or {})})
        left = self.jit.seconds_to_deadline()
        self._say(
            f"just-in-time checkpoint at step {result.step} committed in {time.monotonic() - started:.2f} s"
            + (f", {left:.1f} s before the deadline" if left is not None else "")
            + "; ending this placement (no step lost)"
        )
        if not self.watch.can_end:
            # No driver around this run to resume it: wait (no further steps, they would be lost) until Ray
            # Train tears the group down at the deadline and restarts it from this checkpoint.
            self._say("no elastic driver: waiting for Ray Train's restart from this checkpoint")
            self.pause_watchdog()
            while True:
                time.sleep(1.0)
        self.watch.acknowledge(result.step, reason="preemption")
        raise PlacementEnded(result.step, "preemption")

    def _announce(self, notice, eta: float | None) -> None:
        """Rank 0, at a reclaim notice: tell the driver when this placement should end (in the background: a
        write to the run folder must not hold up a step). Without a deadline it ends at once anyway."""
        self.on_notice(notice.node_ids, notice.deadline)
        if eta is not None and self.watch.can_end:
            threading.Thread(target=self.watch.will_end, args=(eta,), name="elastic-ending", daemon=True).start()

    def _say(self, message: str) -> None:
        if self._rank == 0:  # as Session.log: rank 0 speaks for the run
            _log.info(message)
