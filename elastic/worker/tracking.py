"""The spec's `tracking:` section in the session (elastic.observability.tracking does the writing).

At the session's first step (after `restore()`, so a resumed run knows its MLflow run from the checkpoint),
rank 0 finds or starts the MLflow run and logs the job's parameters; its id then goes to every rank (one
broadcast), so every rank's copy of the checkpointed TrackingState is the same. Rank 0 then logs the step's
metrics every `tracking.every_steps` steps, and `finish()` marks the MLflow run finished."""

from __future__ import annotations

import logging

import torch.distributed as dist

from elastic.config.spec import JobSpec
from elastic.observability.tracking import NoTracking, Tracker, TrackingState, resolve_run

_log = logging.getLogger(__name__)


class SessionTracking:
    def __init__(self, spec: JobSpec, run_name: str, rank: int):
        self.spec, self.run_name, self.rank = spec, run_name, rank
        self.state = TrackingState()  # tracked by the session: kept in the checkpoint
        self._tracker: NoTracking | None = None

    def on_step(self, step: int, metrics: dict | None) -> None:
        if self._tracker is None:
            self._tracker = self._start()
        self._tracker.log(step, metrics)

    def finish(self, step: int, metrics: dict | None) -> None:
        """The run's final metrics at its last step, then the MLflow run is marked finished (rank 0)."""
        if self._tracker is None:
            self._tracker = self._start()  # a session that took no step (resumed at the end) still finishes
        self._tracker.finish(step, metrics)

    def _start(self) -> NoTracking:
        tracking = self.spec.tracking
        if not tracking.enabled:
            return NoTracking()
        run_id = [self.state.mlflow_run_id]
        if self.rank == 0 and tracking.mlflow is not None:
            try:
                run_id[0] = resolve_run(tracking, self.spec, self.run_name, self.state.mlflow_run_id)
            except Exception as err:  # tracking boundary: an unreachable MLflow never stops training
                _log.warning(
                    "tracking: MLflow at %s unavailable (%s: %s); training on", tracking.mlflow, type(err).__name__, err
                )
        if tracking.mlflow is not None and self.state.mlflow_run_id is None and dist.is_initialized():
            # Every rank enters this at the same step (the first of the session) and decides alike: the
            # checkpoint gave all of them the same id. On the default group, in the loop's thread, between steps.
            dist.broadcast_object_list(run_id, src=0)
        self.state.mlflow_run_id = run_id[0]
        if self.rank != 0:
            return NoTracking()
        return Tracker(tracking, self.run_name, run_id[0])
