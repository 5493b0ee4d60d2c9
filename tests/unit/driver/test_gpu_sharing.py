"""Unit tests for elastic/driver/gpu_sharing.py: which runs share which GPU, from Ray state API actors."""

from __future__ import annotations

import json
from types import SimpleNamespace

from elastic.driver.gpu_sharing import RUN_URI_VARIABLE, RUN_VARIABLE, by_gpu, gpu_share, shared_workers


def actor(run: str | None, node: str, resources: dict, cls: str = "RayTrainWorker", state: str = "ALIVE", pid=1):
    env = {"env_vars": {"AWS_ACCESS_KEY_ID": "x"}}
    if run:
        env["env_vars"].update({RUN_VARIABLE: run, RUN_URI_VARIABLE: f"s3://b/runs/{run}"})
    return SimpleNamespace(
        class_name=cls,
        state=state,
        node_id=node,
        pid=pid,
        required_resources=resources,
        serialized_runtime_env=json.dumps(env),
    )


def test_the_share_of_a_worker_in_ray_trains_placement_group():
    assert gpu_share({"CPU_group_0_pg": 1.0, "GPU_group_0_pg": 0.25, "GPU_group_pg": 0.25}) == 0.25
    assert gpu_share({"GPU": 0.5}) == 0.5
    assert gpu_share({"CPU": 1}) == 0.0


def test_only_alive_training_workers_on_a_gpu_share_of_a_named_run():
    actors = [
        actor("a", "n1", {"GPU_group_0_pg": 0.25}),
        actor("b", "n1", {"GPU_group_1_pg": 0.5}),
        actor("c", "n1", {"GPU_group_0_pg": 1.0}),  # a whole GPU: not shared
        actor(None, "n1", {"GPU": 0.25}),  # not one of ours
        actor("d", "n1", {"GPU": 0.25}, cls="TrainController"),
        actor("e", "n1", {"GPU": 0.25}, state="DEAD"),
        SimpleNamespace(
            class_name="RayTrainWorker",
            state="ALIVE",
            node_id="n1",
            required_resources={"GPU": 0.25},
            serialized_runtime_env="not json",
            pid=2,
        ),
        actor(None, "n2", {"GPU_group_0_pg": 0.25, "CPU_group_0_pg": 0.05}, cls="ImplicitFunc", pid=77),
        actor(None, "n2", {"CPU_group_0_pg": 0.05}, cls="ImplicitFunc"),  # a worker-group trial's driver
    ]
    found = shared_workers(actors)
    assert found == [
        {"run": "a", "run_uri": "s3://b/runs/a", "node": "n1", "share": 0.25},
        {"run": "b", "run_uri": "s3://b/runs/b", "node": "n1", "share": 0.5},
        {"run": "light trial (pid 77)", "run_uri": None, "node": "n2", "share": 0.25},
    ]


def test_workers_grouped_by_gpu_busiest_first():
    workers = [
        {"run": "b", "node": "n1", "share": 0.25},
        {"run": "a", "node": "n1", "share": 0.25},
        {"run": "a", "node": "n2", "share": 0.25},
        {"run": "c", "node": "n2", "share": 0.5},
        {"run": "d", "node": "n2", "share": 0.25},
    ]
    ids = {"a": {"n1": ["0"], "n2": ["1"]}, "b": {"n1": ["0"]}, "c": {"n2": ["0"]}}
    rows = by_gpu(workers, ids)
    assert rows == [
        {"node": "n1", "gpu": "0", "runs": [{"run": "a", "share": 0.25}, {"run": "b", "share": 0.25}], "used": 0.5},
        {"node": "n2", "gpu": "0", "runs": [{"run": "c", "share": 0.5}], "used": 0.5},
        {"node": "n2", "gpu": "1", "runs": [{"run": "a", "share": 0.25}], "used": 0.25},
        {"node": "n2", "gpu": "?", "runs": [{"run": "d", "share": 0.25}], "used": 0.25},  # no gpus.json read
    ]
