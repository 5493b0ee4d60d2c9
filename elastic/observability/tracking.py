"""Experiment tracking from rank 0 (the spec's `tracking:` section): the job's settings as MLflow parameters,
its step metrics every `every_steps` steps to MLflow and to TensorBoard event files.

One MLflow run per elastic run: its id is kept in the checkpoint (`TrackingState`, tracked by the session), so
a resumed run continues the same MLflow run and its steps go on. A run killed before its first checkpoint
finds its MLflow run again by the tag `elastic.run`. A sweep trial's run is nested under the sweep's run
(`parent_run_id`).

TensorBoard: event files are written locally and, for object stores (s3:// ...), uploaded through fsspec under
`<tensorboard>/<run>/` at most every UPLOAD_SECONDS and at the end (TensorBoard's own writer appends to files,
which object stores cannot). Each placement writes a file of its own; TensorBoard merges a folder's files.

All I/O happens on a background thread: a step only queues its metrics."""

from __future__ import annotations

import logging
import os
import queue
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Any

from elastic.config.spec import JobSpec, TrackingSpec
from elastic.storage import fsspec_filesystem, parse_uri

_log = logging.getLogger(__name__)

RUN_TAG = "elastic.run"
SWEEP_TAG = "elastic.sweep"
PARENT_TAG = "mlflow.parentRunId"  # MLflow's own tag for nested runs
UPLOAD_SECONDS = 10.0
_LEFT_OUT = ("runtime_env", "tracking")  # environment variables may hold secrets; tracking is the tracker's own


class TrackingState:
    """The MLflow run id, kept in the checkpoint (a torch Stateful). Every rank holds the same value."""

    def __init__(self) -> None:
        self.mlflow_run_id: str | None = None

    def state_dict(self) -> dict:
        return {"mlflow_run_id": self.mlflow_run_id}

    def load_state_dict(self, state: dict) -> None:
        self.mlflow_run_id = state.get("mlflow_run_id")


def job_params(spec: JobSpec) -> dict[str, str]:
    """The job's settings as flat MLflow parameters (`config.lr`, `workers.min`, ...); runtime_env left out."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        else:
            flat[prefix] = str(value)[:6000]  # MLflow's limit on a parameter's value

    walk("", {k: v for k, v in spec.model_dump(mode="json").items() if k not in _LEFT_OUT})
    return flat


def numeric_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    """The numbers among a step's metrics (tensors with one element included), as floats."""
    numbers: dict[str, float] = {}
    for key, value in (metrics or {}).items():
        if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            numbers[str(key)] = float(value)
    return numbers


class MlflowRuns:
    """The MLflow client calls elastic makes (MlflowClient: no global active-run state in the worker)."""

    def __init__(self, tracking_uri: str):
        # Deferred: mlflow takes seconds to import and is only needed where tracking is configured.
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)

    def experiment_id(self, name: str) -> str:
        experiment = self.client.get_experiment_by_name(name)
        return experiment.experiment_id if experiment is not None else self.client.create_experiment(name)

    def find_or_create(self, experiment: str, run_name: str, tags: dict[str, str], tag: str) -> tuple[str, bool]:
        """(run id, created): the run tagged `tag` = tags[tag] in `experiment`, else a new one."""
        experiment_id = self.experiment_id(experiment)
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{tag}` = '{tags[tag]}'", max_results=1, order_by=["start_time ASC"]
        )
        if found:
            return found[0].info.run_id, False
        return self.client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id, True

    def log_params(self, run_id: str, params: dict[str, str]) -> None:
        """New parameters only: MLflow refuses to change a logged value (a resubmission with --set)."""
        from mlflow.entities import Param

        logged = self.client.get_run(run_id).data.params
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        if changed:
            _log.info("tracking: parameters changed since the MLflow run began, kept as first logged: %s", changed)
        fresh = [Param(k, v) for k, v in params.items() if k not in logged]
        for start in range(0, len(fresh), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(run_id, params=fresh[start : start + 100])

    def log_metrics(self, run_id: str, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def finish(self, run_id: str) -> None:
        self.client.set_terminated(run_id, "FINISHED")


def resolve_run(tracking: TrackingSpec, spec: JobSpec, run_name: str, known_id: str | None) -> str | None:
    """Rank 0: the MLflow run of this elastic run (the checkpoint's, else the one tagged with its name, else a
    new one), with the job's parameters logged. None without `tracking.mlflow`."""
    if tracking.mlflow is None:
        return None
    runs = MlflowRuns(tracking.mlflow)
    if known_id is None:
        tags = {RUN_TAG: run_name}
        if tracking.parent_run_id:
            tags[PARENT_TAG] = tracking.parent_run_id
        known_id, created = runs.find_or_create(tracking.experiment or spec.name, run_name, tags, RUN_TAG)
        _log.info("tracking: %s MLflow run %s (%s)", "started" if created else "continuing", known_id, run_name)
    else:
        _log.info("tracking: continuing MLflow run %s from the checkpoint", known_id)
    runs.client.update_run(known_id, status="RUNNING")  # a finished run resubmitted for more steps runs again
    runs.log_params(known_id, job_params(spec))
    return known_id


def sweep_parent_run(tracking: TrackingSpec, sweep_name: str) -> str | None:
    """The sweep's MLflow run, under which every trial's run is nested; found again when the sweep resumes."""
    if tracking.mlflow is None:
        return None
    runs = MlflowRuns(tracking.mlflow)
    run_id, _ = runs.find_or_create(tracking.experiment or sweep_name, sweep_name, {SWEEP_TAG: sweep_name}, SWEEP_TAG)
    return run_id


class TensorBoardEvents:
    """Scalars to a TensorBoard event file under <root>/<run>/, written locally and uploaded for object stores."""

    def __init__(self, root: str, run_name: str):
        # Deferred: torch.utils.tensorboard imports tensorboard, only needed where tracking is configured.
        from torch.utils.tensorboard import SummaryWriter

        self.target = parse_uri(root).child(run_name)
        self._remote = self.target.scheme not in ("", "file")  # s3://, gs://, any fsspec filesystem
        self._local = tempfile.mkdtemp(prefix="elastic-tb-") if self._remote else self.target.path
        self.writer = SummaryWriter(log_dir=self._local)
        self._uploaded_at = 0.0

    def add(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        if self._remote and time.monotonic() - self._uploaded_at >= UPLOAD_SECONDS:
            self.upload()

    def upload(self) -> None:
        self.writer.flush()
        if not self._remote:
            return
        fs, path = fsspec_filesystem(self.target.uri)
        for name in os.listdir(self._local):
            fs.put_file(os.path.join(self._local, name), f"{path}/{name}")
        self._uploaded_at = time.monotonic()

    def close(self) -> None:
        self.upload()
        self.writer.close()


class NoTracking:
    """Tracking off (no `tracking:` section, or not rank 0)."""

    def log(self, step: int, metrics: Mapping[str, Any] | None) -> None: ...

    def finish(self, step: int, metrics: Mapping[str, Any] | None) -> None: ...


class Tracker(NoTracking):
    """Rank 0's writer: `log` queues, a background thread calls MLflow and TensorBoard."""

    def __init__(self, tracking: TrackingSpec, run_name: str, mlflow_run_id: str | None):
        self.tracking = tracking
        self.run_name = run_name
        self.mlflow_run_id = mlflow_run_id
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="elastic-tracking", daemon=True)
        self._thread.start()

    def log(self, step: int, metrics: Mapping[str, Any] | None) -> None:
        numbers = numeric_metrics(metrics)
        if numbers and step % self.tracking.every_steps == 0:
            self._queue.put((step, numbers))

    def finish(self, step: int, metrics: Mapping[str, Any] | None) -> None:
        """At the end of training: the final metrics and everything queued are written, the MLflow run is
        marked finished."""
        numbers = numeric_metrics(metrics)
        if numbers:
            self._queue.put((step, numbers))
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _work(self) -> None:
        mlflow = MlflowRuns(self.tracking.mlflow) if self.mlflow_run_id else None
        events = TensorBoardEvents(self.tracking.tensorboard, self.run_name) if self.tracking.tensorboard else None
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    if events is not None:
                        events.close()
                    if mlflow is not None:
                        mlflow.finish(self.mlflow_run_id)
                    return
                step, numbers = item
                if mlflow is not None:
                    mlflow.log_metrics(self.mlflow_run_id, step, numbers)
                if events is not None:
                    events.add(step, numbers)
            except Exception as err:  # thread boundary: tracking trouble is logged, never stops training
                _log.warning("tracking: %s: %s", type(err).__name__, str(err)[:300])
