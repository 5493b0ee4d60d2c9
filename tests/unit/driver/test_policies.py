"""Unit tests for the pure policies: checkpoint cadence, spec -> Ray config translations, entrypoints, node plans."""

from __future__ import annotations

import json
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from ray.train import FailureConfig, ScalingConfig

from elastic.config.entrypoint import check_entrypoint
from elastic.config.spec import CheckpointSpec, FailureSpec, JobSpec, WorkersSpec
from elastic.driver.ray_config import failure_config, scaling_config, torch_backend
from elastic.errors import ClusterError, SpecError
from elastic.local.stack import NodePlan, plan_nodes
from elastic.placement.labels import MARKET_LABEL, ROLE_LABEL, worker_selector
from elastic.worker.cadence import CheckpointCadence
from elastic.worker.entrypoint import resolve_entrypoint


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------------------------------------
# CheckpointCadence


def test_every_steps_is_due_at_multiples_only_and_not_at_step_zero():
    cadence = CheckpointCadence(CheckpointSpec(uri="/tmp/x", every_steps=5), clock=FakeClock())
    due = [step for step in range(0, 21) if cadence.due(step)]
    assert due == [5, 10, 15, 20]
    assert not cadence.time_based


def test_every_steps_ignores_time():
    clock = FakeClock()
    cadence = CheckpointCadence(CheckpointSpec(uri="/tmp/x", every_steps=100), clock=clock)
    clock.now += 10_000
    assert not cadence.due(99)
    assert cadence.due(100)


def test_every_seconds_is_due_after_the_interval_and_again_only_an_interval_after_saving():
    clock = FakeClock(1000.0)
    cadence = CheckpointCadence(CheckpointSpec(uri="/tmp/x", every_seconds=30), clock=clock)
    assert cadence.time_based
    assert not cadence.due(1)
    clock.now = 1029.9
    assert not cadence.due(2)
    clock.now = 1030.0
    assert cadence.due(3)
    clock.now = 1045.0
    assert cadence.due(4)  # still due: nothing was saved yet
    cadence.saved()  # at t=1045
    assert not cadence.due(5)
    clock.now = 1074.9
    assert not cadence.due(6)
    clock.now = 1075.0
    assert cadence.due(7)


def test_steps_and_seconds_together():
    clock = FakeClock(0.0)
    cadence = CheckpointCadence(CheckpointSpec(uri="/tmp/x", every_steps=10, every_seconds=60), clock=clock)
    assert cadence.due(10)  # by steps
    assert not cadence.due(11)
    clock.now = 60.0
    assert cadence.due(11)  # by time
    cadence.saved()
    assert not cadence.due(12)
    assert cadence.due(20)


# ---------------------------------------------------------------------------------------------------------
# torch backend


@pytest.mark.parametrize(
    ("gpus", "logical_gpus", "backend"),
    [
        (0, False, "gloo"),
        (0, True, "gloo"),
        (1, False, "nccl"),
        (0.5, False, "nccl"),
        (1, True, "gloo"),
    ],
)
def test_torch_backend(gpus, logical_gpus, backend):
    assert torch_backend(WorkersSpec(min=1, gpus=gpus), logical_gpus=logical_gpus) == backend


# ---------------------------------------------------------------------------------------------------------
# ScalingConfig / FailureConfig


def test_scaling_config_fixed_worker_count_is_an_int():
    config = scaling_config(WorkersSpec(min=2, max=2, cpus=2, market="spot"))
    assert isinstance(config, ScalingConfig)
    assert config.num_workers == 2 and isinstance(config.num_workers, int)
    assert config.use_gpu is False
    assert config.resources_per_worker == {"CPU": 2.0}
    assert config.label_selector == {"elastic-role": "worker", "market": "spot"}


def test_scaling_config_default_max_is_fixed():
    assert scaling_config(WorkersSpec(min=3)).num_workers == 3


def test_scaling_config_elastic_worker_count_is_a_range():
    config = scaling_config(WorkersSpec(min=1, max=4, gpus=1, market="on-demand"))
    assert config.num_workers == (1, 4)
    assert config.use_gpu is True
    assert config.resources_per_worker == {"CPU": 1.0, "GPU": 1.0}
    assert config.label_selector == {"elastic-role": "worker", "market": "on-demand"}


def test_scaling_config_any_market_selects_only_the_role():
    config = scaling_config(WorkersSpec(min=1, market="any"))
    assert config.label_selector == {"elastic-role": "worker"}
    assert "GPU" not in config.resources_per_worker


@pytest.mark.parametrize(
    ("market", "selector"),
    [
        ("spot", {ROLE_LABEL: "worker", MARKET_LABEL: "spot"}),
        ("on-demand", {ROLE_LABEL: "worker", MARKET_LABEL: "on-demand"}),
        ("any", {ROLE_LABEL: "worker"}),
    ],
)
def test_worker_selector(market, selector):
    assert worker_selector(market) == selector
    assert selector.get("elastic-role") == "worker"


def test_failure_config_maps_both_budgets():
    config = failure_config(FailureSpec(max_failures=2, max_preemptions=7))
    assert isinstance(config, FailureConfig)
    assert config.max_failures == 2
    assert config.max_preemption_failures == 7


def test_failure_config_unlimited():
    config = failure_config(FailureSpec(max_failures=-1, max_preemptions=-1))
    assert (config.max_failures, config.max_preemption_failures) == (-1, -1)


# ---------------------------------------------------------------------------------------------------------
# Entrypoints


def _spec(entrypoint: str) -> JobSpec:
    return JobSpec(
        name="demo",
        entrypoint=entrypoint,
        workers=WorkersSpec(min=1),
        checkpoint=CheckpointSpec(uri="/tmp/x", every_steps=1),
    )


@pytest.fixture
def job_modules():
    """resolve_entrypoint caches file modules in sys.modules by relative path; forget them after each test."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("elastic_job_"):
            del sys.modules[name]


@pytest.fixture
def job_dir(tmp_path) -> Path:
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "train_job.py").write_text(
        textwrap.dedent(
            """\
            import json

            VALUE = 41

            def helper():
                return VALUE

            def train(config):
                return helper() + 1

            async def atrain(config):
                return 0
            """
        )
    )
    return tmp_path


def test_check_entrypoint_accepts_a_defined_function(job_dir):
    assert check_entrypoint(_spec("jobs/train_job.py:train"), job_dir) == []
    assert check_entrypoint(_spec("jobs/train_job.py:atrain"), job_dir) == []


def test_check_entrypoint_missing_file(job_dir):
    with pytest.raises(SpecError) as info:
        check_entrypoint(_spec("jobs/missing.py:train"), job_dir)
    message = str(info.value)
    assert message.startswith("entrypoint: jobs/missing.py not found under ")
    assert str(job_dir) in message


def test_check_entrypoint_missing_function_lists_what_is_there(job_dir):
    with pytest.raises(SpecError) as info:
        check_entrypoint(_spec("jobs/train_job.py:trian"), job_dir)
    message = str(info.value)
    assert "'trian'" in message and "jobs/train_job.py" in message
    assert "atrain, helper, train" in message


def test_check_entrypoint_leaves_module_paths_to_the_job_but_warns_when_not_importable_here(job_dir):
    (warning,) = check_entrypoint(_spec("no_such_package.mod:train"), job_dir)
    assert "module no_such_package.mod cannot be imported here" in warning and "runtime_env.pip" in warning
    assert check_entrypoint(_spec("json.decoder:JSONDecoder"), job_dir) == []


SIGNATURES = """\
import ray.train

def session_job(session):
    pass

def ray_train_job(config):
    ray.train.report({})

def no_args():
    pass

def two_args(config, extra):
    pass

def keyword_only(config, *, flag):
    pass

def defaults(config, extra=1, *args, **kwargs):
    pass
"""


@pytest.mark.parametrize(
    "api, function, refusal",
    [
        ("session", "session_job", None),
        ("ray-train", "ray_train_job", None),
        ("ray-train", "no_args", None),  # Ray Train calls a function without parameters with nothing
        ("ray-train", "defaults", None),
        ("session", "defaults", None),
        ("session", "no_args", "takes no argument, but api session passes the session; write def no_args(session)"),
        ("session", "ray_train_job", "it is a Ray Train function, which api session would call with the session"),
        ("ray-train", "session_job", "takes the session, but api ray-train passes the job's config"),
        ("transformers", "ray_train_job", None),
        ("transformers", "session_job", "api transformers passes the job's config; remove the api field"),
        ("ray-train", "two_args", "also needs extra, which api ray-train never passes"),
        ("session", "keyword_only", "also needs flag, which api session never passes"),
    ],
)
def test_check_entrypoint_refuses_a_signature_the_api_does_not_call(tmp_path, api, function, refusal):
    (tmp_path / "job.py").write_text(SIGNATURES)
    spec = JobSpec(
        name="j",
        entrypoint=f"job.py:{function}",
        api=api,
        workers=WorkersSpec(min=1),
        checkpoint=CheckpointSpec(uri="/tmp/x", every_steps=1),
    )
    if refusal is None:
        assert check_entrypoint(spec, tmp_path, "job.yaml") == []
        return
    with pytest.raises(SpecError) as info:
        check_entrypoint(spec, tmp_path, "job.yaml")
    assert str(info.value).startswith("job.yaml: entrypoint: job.py:")
    assert refusal in str(info.value)


def test_check_entrypoint_agrees_with_resolve_entrypoint_on_imported_functions(tmp_path, monkeypatch, job_modules):
    name = f"reexport_{uuid.uuid4().hex[:8]}.py"
    (tmp_path / name).write_text("from json import dumps as train\n")
    monkeypatch.chdir(tmp_path)
    assert resolve_entrypoint(f"{name}:train") is json.dumps
    check_entrypoint(_spec(f"{name}:train"), tmp_path)


def test_check_entrypoint_syntax_error_is_a_spec_error(tmp_path):
    (tmp_path / "broken.py").write_text("def train(:\n")
    with pytest.raises(SpecError):
        check_entrypoint(_spec("broken.py:train"), tmp_path)


def test_resolve_entrypoint_from_a_file_relative_to_cwd(job_dir, monkeypatch, job_modules):
    monkeypatch.chdir(job_dir)
    function = resolve_entrypoint("jobs/train_job.py:train")
    assert callable(function)
    assert function({}) == 42
    assert function.__module__ in sys.modules


def test_resolve_entrypoint_from_a_module_path():
    assert resolve_entrypoint("json:dumps") is json.dumps
    assert resolve_entrypoint("os.path:join") is __import__("os.path").path.join


def test_resolve_entrypoint_missing_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError, match=r"entrypoint: jobs/nowhere_[0-9a-f]+\.py not found"):
        resolve_entrypoint(f"jobs/nowhere_{uuid.uuid4().hex[:8]}.py:train")


def test_resolve_entrypoint_missing_function(job_dir, monkeypatch, job_modules):
    monkeypatch.chdir(job_dir)
    with pytest.raises(SpecError, match=r"jobs/train_job\.py has no function nope"):
        resolve_entrypoint("jobs/train_job.py:nope")
    with pytest.raises(SpecError, match=r"has no function VALUE"):  # not callable
        resolve_entrypoint("jobs/train_job.py:VALUE")
    with pytest.raises(SpecError, match=r"json has no function nope"):
        resolve_entrypoint("json:nope")


def test_resolve_entrypoint_missing_module():
    with pytest.raises(SpecError, match=r"cannot import no_such_module_xyz"):
        resolve_entrypoint("no_such_module_xyz:train")


# ---------------------------------------------------------------------------------------------------------
# Local cluster node plan


def test_plan_nodes_head_first_then_on_demand_then_spot():
    nodes = plan_nodes(spot=2, on_demand=1, cpus_per_node=4, gpus_per_node=1)
    assert [n.name for n in nodes] == ["head", "on-demand-0", "spot-0", "spot-1"]
    head = nodes[0]
    assert head == NodePlan("head", "on-demand", "head", 0, 0, "m6i.2xlarge")
    assert head.labels() == {
        "market": "on-demand",
        "elastic-role": "head",
        "elastic-node": "head",
        "elastic-instance-type": "m6i.2xlarge",  # what `elastic report` prices a local node by
    }
    for node in nodes[1:]:
        assert node.role == "worker" and node.cpus == 4 and node.gpus == 1
        assert node.labels()[MARKET_LABEL] == node.market
        assert node.labels()["elastic-node"] == node.name
    assert [n.market for n in nodes[1:]] == ["on-demand", "spot", "spot"]
    # the workers' labels are what the trainer's label selector matches
    spot = nodes[2].labels()
    assert all(spot[k] == v for k, v in worker_selector("spot").items())
    assert not all(head.labels().get(k) == v for k, v in worker_selector("any").items())


def test_plan_nodes_spot_only():
    nodes = plan_nodes(spot=1, on_demand=0, cpus_per_node=1, gpus_per_node=0)
    assert [(n.name, n.market, n.cpus) for n in nodes] == [("head", "on-demand", 0), ("spot-0", "spot", 1)]


@pytest.mark.parametrize(("spot", "on_demand"), [(0, 0), (-1, 2), (2, -1)])
def test_plan_nodes_needs_a_worker(spot, on_demand):
    with pytest.raises(ClusterError, match="at least one worker node"):
        plan_nodes(spot=spot, on_demand=on_demand, cpus_per_node=1, gpus_per_node=0)
