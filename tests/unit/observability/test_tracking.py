"""Experiment tracking (elastic.observability.tracking) against a real MLflow store (sqlite, no server) and
TensorBoard's own event reader; object-store uploads through fsspec's in-memory filesystem."""

from __future__ import annotations

import fsspec
import pytest

from elastic.config.spec import JobSpec, TrackingSpec
from elastic.observability.tracking import (
    RUN_TAG,
    MlflowRuns,
    Tracker,
    TrackingState,
    job_params,
    numeric_metrics,
    resolve_run,
    sweep_parent_run,
)

pytest.importorskip("mlflow")


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory) -> str:
    """One sqlite store for the module: creating one runs MLflow's migrations, seconds each time."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def job(**tracking) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "digits",
            "entrypoint": "jobs/digits_ddp.py:train",
            "config": {"lr": 0.05, "model": {"width": 16}},
            "workers": {"min": 2},
            "checkpoint": {"uri": "/tmp/runs", "every_steps": 10},
            "runtime_env": {"env_vars": {"API_TOKEN": "secret-value"}},
            "tracking": tracking,
        }
    )


def test_params_are_the_flattened_job_without_its_environment():
    params = job_params(job())
    assert params["config.lr"] == "0.05" and params["config.model.width"] == "16"
    assert params["workers.min"] == "2" and params["checkpoint.every_steps"] == "10"
    assert not any(key.startswith(("runtime_env", "tracking")) for key in params)
    assert "secret-value" not in str(params)


def test_numeric_metrics_keep_numbers_only():
    import torch

    assert numeric_metrics({"loss": torch.tensor(0.5), "epoch": 2, "name": "x", "done": True}) == {
        "loss": 0.5,
        "epoch": 2.0,
    }


def test_a_run_is_found_again_never_duplicated(mlflow_uri):
    uri = mlflow_uri
    spec = job(mlflow=uri)
    first = resolve_run(spec.tracking, spec, "digits-a", None)
    # Killed before its first checkpoint: no id in the checkpoint, the tag finds the same run.
    again = resolve_run(spec.tracking, spec, "digits-a", None)
    # Resumed from a checkpoint; --set changed lr: the first value stays, new parameters are added.
    changed = job(mlflow=uri).model_copy(update={"config": {"lr": 0.1, "model": {"width": 16}, "extra": 1}})
    assert resolve_run(spec.tracking, changed, "digits-a", first) == first == again
    runs = MlflowRuns(uri)
    found = runs.client.search_runs([runs.experiment_id("digits")], filter_string=f"tags.`{RUN_TAG}` = 'digits-a'")
    assert [r.info.run_id for r in found] == [first]
    assert found[0].data.tags[RUN_TAG] == "digits-a"
    assert found[0].data.params["config.lr"] == "0.05" and found[0].data.params["config.extra"] == "1"


def test_tracker_logs_every_n_steps_and_finishes_the_run(tmp_path, mlflow_uri):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    uri = mlflow_uri
    spec = job(mlflow=uri, tensorboard=str(tmp_path / "tb"), every_steps=5)
    run_id = resolve_run(spec.tracking, spec, "digits-b", None)
    state = TrackingState()
    state.load_state_dict({"mlflow_run_id": run_id})
    tracker = Tracker(spec.tracking, "digits-b", state.mlflow_run_id)
    for step in range(1, 13):
        tracker.log(step, {"loss": 1.0 / step})
    tracker.finish(12, {"accuracy": 0.9})

    client = MlflowRuns(uri).client
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [5, 10]
    assert [m.value for m in client.get_metric_history(run_id, "accuracy")] == [0.9]
    assert client.get_run(run_id).info.status == "FINISHED"
    # Resubmitted for more epochs: the same run, running again.
    assert resolve_run(spec.tracking, spec, "digits-b", run_id) == run_id
    assert client.get_run(run_id).info.status == "RUNNING"
    events = EventAccumulator(str(tmp_path / "tb" / "digits-b"))
    events.Reload()
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("loss")] == [(5, 0.2), (10, 0.1)]


def test_tensorboard_events_go_up_through_fsspec_for_remote_roots(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracking = TrackingSpec(tensorboard="memory://bucket/tb", every_steps=1)
    tracker = Tracker(tracking, "digits-c", None)
    for step in range(1, 4):
        tracker.log(step, {"loss": float(step)})
    tracker.finish(3, None)
    fs = fsspec.filesystem("memory")
    names = fs.ls("/bucket/tb/digits-c", detail=False)
    assert len(names) == 1 and "tfevents" in names[0]
    local = tmp_path / "down"
    local.mkdir()
    fs.get(names[0], str(local / names[0].rsplit("/", 1)[1]))
    events = EventAccumulator(str(local))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]


def test_a_sweep_has_one_parent_run(mlflow_uri):
    tracking = TrackingSpec(mlflow=mlflow_uri)
    parent = sweep_parent_run(tracking, "digits-sweep")
    assert sweep_parent_run(tracking, "digits-sweep") == parent  # a restored sweep keeps it
    spec = job(mlflow=tracking.mlflow, parent_run_id=parent, experiment="digits-sweep")
    child = resolve_run(spec.tracking, spec, "digits-sweep-t1", None)
    run = MlflowRuns(tracking.mlflow).client.get_run(child)
    assert run.data.tags["mlflow.parentRunId"] == parent
