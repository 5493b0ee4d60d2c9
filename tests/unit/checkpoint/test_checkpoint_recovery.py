"""What keeps checkpoints going when storage fails (elastic/checkpoint/dcp_io.py and checkpointer.py), on the
local filesystem in one process: the bounded, logged retry of whole-object requests, and a restore that falls
back to the checkpoint before one it cannot read. The same paths against a failing S3 endpoint:
tests/integration/test_checkpoint_s3_faults.py."""

from __future__ import annotations

import logging

import pytest
import torch

from elastic.checkpoint import dcp_io
from elastic.checkpoint.checkpointer import ShardedCheckpointer
from elastic.checkpoint.dcp_io import retrying
from elastic.checkpoint.store import CheckpointStore

# single-process DCP saves warn that no process group is initialized: intended
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    monkeypatch.setattr(dcp_io, "OBJECT_BACKOFF_SECONDS", 0.0)


def failing(times: int, error: Exception, result: str = "done"):
    calls = []

    def call():
        calls.append(1)
        if len(calls) <= times:
            raise error
        return result

    return call, calls


def test_a_transient_failure_is_retried_and_logged(caplog):
    call, calls = failing(2, ConnectionResetError("Connection reset by peer"))
    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.dcp_io"):
        assert retrying("PUT bucket/run/step-000000010/__0_0.distcp", call, attempts=3) == "done"
    assert len(calls) == 3
    assert "PUT bucket/run/step-000000010/__0_0.distcp failed (ConnectionResetError: Connection reset" in caplog.text
    assert "retry 2 of 2" in caplog.text


def test_retries_are_bounded_and_the_last_error_is_raised():
    call, calls = failing(5, OSError("503 SlowDown"))
    with pytest.raises(OSError, match="SlowDown"):
        retrying("GET x", call, attempts=3)
    assert len(calls) == 3


@pytest.mark.parametrize("error", [FileNotFoundError("no such key"), PermissionError("access denied")])
def test_a_missing_object_or_a_refusal_is_not_retried(error):
    call, calls = failing(1, error)
    with pytest.raises(type(error)):
        retrying("GET x", call)
    assert len(calls) == 1


def state(value: float) -> dict:
    return {"model": {"w": torch.full((64, 8), value), "b": torch.arange(8, dtype=torch.float32) * value}}


def template() -> dict:
    return {"model": {"w": torch.zeros(64, 8), "b": torch.zeros(8)}}


@pytest.fixture
def saved(tmp_path, monkeypatch) -> tuple[CheckpointStore, ShardedCheckpointer]:
    monkeypatch.setattr("elastic.checkpoint.checkpointer.LOAD_RETRY_SECONDS", 0.0)
    store = CheckpointStore(str(tmp_path / "run"))
    checkpointer = ShardedCheckpointer(store, rank=0, world_size=1)
    for step, value in ((10, 1.0), (20, 2.0), (30, 3.0)):
        assert checkpointer.save(step, state(float(value)), asynchronous=False).result().committed
    return store, checkpointer


def test_a_restore_loads_the_newest_it_can_read(saved):
    _, checkpointer = saved
    step, loaded = checkpointer.load_newest([10, 30, 20], template)
    assert step == 30 and torch.equal(loaded["model"]["w"], state(3.0)["model"]["w"])


def test_a_restore_falls_back_past_unreadable_checkpoints_with_a_log_line(saved, caplog):
    store, checkpointer = saved
    for step in (30, 20):  # shards lost (or unreadable): the markers still say committed
        for shard in store.fs.ls(store.path(step)):
            if shard.endswith(".distcp"):
                store.fs.rm(shard)
    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.checkpointer"):
        step, loaded = checkpointer.load_newest([10, 20, 30], template)
    assert step == 10
    assert torch.equal(loaded["model"]["w"], state(1.0)["model"]["w"])
    assert torch.equal(loaded["model"]["b"], state(1.0)["model"]["b"])
    assert (
        "checkpoint at step 30 cannot be read" in caplog.text
        and "falling back to the one before it, step 20" in caplog.text
    )
    assert "step 20 cannot be read" in caplog.text and "step 10" in caplog.text


def test_a_passing_read_fault_is_read_again_not_fallen_back_from(saved, caplog, monkeypatch):
    """A fall back retires the newer checkpoint for good, so one failed read (a store restarting) is not enough."""
    _, checkpointer = saved
    real_load, failures = checkpointer.load, []

    def flaky_load(step, state):
        if step == 30 and not failures:
            failures.append(step)
            raise OSError("connection reset by peer")
        return real_load(step, state)

    monkeypatch.setattr(checkpointer, "load", flaky_load)
    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.checkpointer"):
        step, loaded = checkpointer.load_newest([10, 20, 30], template)
    assert failures == [30] and step == 30
    assert torch.equal(loaded["model"]["w"], state(3.0)["model"]["w"])
    assert "step 30: OSError: connection reset by peer; reading it once more" in caplog.text
    assert "falling back" not in caplog.text


def test_a_restore_that_can_read_nothing_raises_the_last_error(saved):
    store, checkpointer = saved
    store.fs.rm(f"{store.path(10)}/.metadata")
    try:
        checkpointer.load_newest([10], template)
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        assert ".metadata" in str(err) or "metadata is None" in str(err), err
    else:
        pytest.fail("a checkpoint without its .metadata was loaded")
