"""One rank's checkpoint saves, from start to commit: the sharded checkpointer, telling Ray Train of commits
(CommitReports), retention (rank 0 prunes), and the listeners the rest of the session registers to hear of
each commit (the just-in-time policy, the hang watchdog, the run ledger, telemetry).

The session decides when to save (elastic.worker.session); this is what a save is once started."""

from __future__ import annotations

import logging
from collections.abc import Callable

from elastic.checkpoint.checkpointer import SaveResult, ShardedCheckpointer
from elastic.checkpoint.store import CheckpointStore, Retention
from elastic.config.spec import CheckpointSpec
from elastic.worker.reporting import CommitReports, ray_report

_log = logging.getLogger(__name__)

CommitListener = Callable[[SaveResult], None]


class Saves:
    """The saves of one rank. `commit_listeners` are called on every rank, in the save's thread, before the
    commit is logged and reported; `report_listeners` with the seconds each report to Ray took."""

    def __init__(self, store: CheckpointStore, rank: int, world_size: int, group, storage, spec: CheckpointSpec):
        self.rank = rank
        self.checkpointer = ShardedCheckpointer(
            store, rank, world_size, group, on_commit=self._on_commit, on_failure=self._on_failed
        )
        self.reports = CommitReports(rank, group, storage, on_reported=self._reported)
        self.commit_listeners: list[CommitListener] = []
        self.report_listeners: list[Callable[[float], None]] = []
        self.last_saved_step: int | None = None
        self._retention = Retention(store, spec.keep, spec.keep_every)

    def honor_pins(self) -> None:
        """Retention keeps the checkpoints other runs pinned (a sweep trial's: PBT may be copying one)."""
        self._retention.honor_pins = True

    def start(
        self,
        step: int,
        state_dict: dict,
        metrics: dict | None,
        *,
        asynchronous: bool,
        deferrable: bool,
        reason: str,
        attach: str | None,
    ) -> None:
        """Start the save of `step` (call `wait()` first: at most one in flight); it is reported with `metrics`
        once committed."""
        self.reports.expect(step, metrics)
        self.checkpointer.save(
            step, state_dict, asynchronous=asynchronous, deferrable=deferrable, reason=reason, attach=attach
        )
        self.last_saved_step = step

    def wait(self) -> SaveResult | None:
        """Wait for the save in flight, if any; a failure is logged (training goes on, the next save retries)."""
        result = self.checkpointer.wait()
        self._log_failure(result)
        return result

    def wait_or_raise(self) -> None:
        """Wait for the save in flight: a save the run must have (final, reported by the function) that
        failed raises."""
        result = self.checkpointer.wait()
        if result is not None and not result.committed:
            self._log_failure(result)
            raise RuntimeError(f"final checkpoint at step {result.step} failed: {result.error}")

    def report_final(self, step: int, final: dict, before_report: Callable[[], None]) -> None:
        """The run ends at the checkpoint of `step`, already saved: make sure Ray is told of it with the final
        metrics, and only once on every rank."""
        before_report()
        carried = self.reports.carry(step, final)  # the last save is of this very step
        self.wait_or_raise()
        reported = self.reports.report_ending(step, final) or carried
        # `carried` is each rank's own (has its reporter already sent that save's report?): rank 0's answer
        # decides for every rank, or one rank would make one more ray.train.report than the others.
        if self.reports.agree(reported):
            return
        # Already reported (or resumed at the end of a finished run: nothing new to save, and Ray knows that
        # checkpoint). Report the metrics alone; never rewrite a committed folder in place.
        ray_report(final)

    def _on_commit(self, result: SaveResult) -> None:
        for listener in self.commit_listeners:
            listener(result)
        metrics = self.reports.metrics(result.step)
        if self.rank == 0:
            _log.info(
                f"checkpoint at step {result.step} committed (stall {result.blocked_seconds * 1000:.1f} ms, "
                f"write {result.total_seconds:.2f} s): {_format(metrics)}"
            )
        self.reports.committed(result)
        if self.rank == 0:
            pruned = self._retention.committed(result.step, result.files)
            if pruned:
                _log.info(f"retention: pruned checkpoints at steps {', '.join(map(str, pruned))}")

    def _on_failed(self, result: SaveResult) -> None:
        if self.rank == 0:
            self._retention.failed(result.step)  # its torn folder goes once a newer save commits

    def _reported(self, seconds: float) -> None:
        for listener in self.report_listeners:
            listener(seconds)

    def _log_failure(self, result: SaveResult | None) -> None:
        if result is not None and not result.committed:
            self.reports.forget(result.step)
            if self.rank == 0:
                _log.info(f"checkpoint at step {result.step} FAILED after {result.attempts} attempts: {result.error}")


def _format(metrics: dict) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
