"""Checkpoints through the fault-injecting S3 proxy (elastic.local.s3_faults) in front of moto: DCP saves and
loads of one process (no Ray, no process group) with elastic's checkpointer and store, as a worker does them.

- transient faults (500, 503 SlowDown, resets mid-body, latency) are retried and the checkpoint is exact;
- a save that keeps failing fails cleanly: no commit marker, the previous checkpoint stays the latest, and the
  next save commits once the store is back;
- a restore that cannot read the latest checkpoint falls back to the one before it, and says so.
"""

from __future__ import annotations

import logging

import boto3
import pytest
import torch

from elastic.checkpoint import dcp_io
from elastic.checkpoint.checkpointer import ShardedCheckpointer
from elastic.checkpoint.store import MARKER, CheckpointStore
from elastic.local.s3_faults import running_proxy
from elastic.storage import filesystems

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

BUCKET = "ckpt-faults"


@pytest.fixture(scope="module")
def upstream(moto_s3) -> str:
    url = moto_s3["AWS_ENDPOINT_URL"]
    boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket=BUCKET)
    return url


@pytest.fixture
def proxy(upstream, monkeypatch):
    """The proxy, with the AWS environment pointing at it. Retries are shortened (fewer attempts, no long
    backoff) so persistent faults fail within seconds; transient ones still get through."""
    monkeypatch.setattr(filesystems, "S3_ATTEMPTS", 2)
    monkeypatch.setattr(dcp_io, "OBJECT_BACKOFF_SECONDS", 0.05)
    with running_proxy(upstream, seed=5) as (url, control):
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        yield control


def state(value: float) -> dict:
    """About 2 MB: a shard big enough that a reset mid-body cuts it for real."""
    generator = torch.Generator().manual_seed(int(value * 1000))
    return {
        "model": {"w": torch.randn(512, 1024, generator=generator), "b": torch.full((1024,), value)},
        "step": torch.tensor(int(value)),
    }


def template() -> dict:
    return {"model": {"w": torch.zeros(512, 1024), "b": torch.zeros(1024)}, "step": torch.tensor(0)}


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in ("w", "b")) and torch.equal(a["step"], b["step"])


def checkpointer(run: str, **kwargs) -> tuple[CheckpointStore, ShardedCheckpointer]:
    store = CheckpointStore(f"s3://{BUCKET}/{run}")
    return store, ShardedCheckpointer(store, rank=0, world_size=1, backoff_seconds=0.1, **kwargs)


def objects(upstream: str, prefix: str) -> set[str]:
    """Straight from moto, past the proxy and any cache."""
    client = boto3.client("s3", endpoint_url=upstream, region_name="us-east-1")
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix) :] for o in listed}


def test_saves_and_loads_get_through_transient_faults_exactly(proxy, caplog):
    store, saver = checkpointer("transient")
    proxy.set_rates(error_500=0.1, slow_down=0.1, reset=0.1)
    with caplog.at_level(logging.WARNING, logger="elastic"):
        for step in (10, 20):
            result = saver.save(step, state(step), asynchronous=False).result()
            assert result.committed, result.error
        # and a run of errors on the shards' PUTs longer than the AWS client's own retries: ours take over
        proxy.open_window("500", requests=4, match={"methods": ["PUT"], "path_contains": ".distcp"})
        assert saver.save(30, state(30), asynchronous=False).result().committed
        proxy.open_window("reset", requests=4, match={"methods": ["GET"], "path_contains": ".distcp"})
        step, loaded = saver.load_newest([10, 20, 30], template)
    assert step == 30 and same(loaded, state(30))
    assert store.latest_committed().step == 30 and store.verify(30) == []
    injected = proxy.stats()["injected"]
    assert injected["reset"] >= 4 and injected["500"] >= 4 and injected["503"] > 0
    assert "failed (" in caplog.text and "retry 1 of 2" in caplog.text  # our retries are logged


def test_a_slow_store_slows_checkpoints_down_and_nothing_else(proxy):
    store, saver = checkpointer("slow")
    proxy.set_rates(latency=1.0, latency_seconds=0.3)
    assert saver.save(10, state(10), asynchronous=False).result().committed
    step, loaded = saver.load_newest(store.restorable_steps(), template)
    assert step == 10 and same(loaded, state(10))
    stats = proxy.stats()
    assert stats["injected"]["latency"] == stats["requests"] > 0


def test_a_save_that_keeps_failing_fails_cleanly_and_the_run_goes_on(proxy, upstream):
    store, saver = checkpointer("persistent", retries=1)
    failed = []
    saver.on_failure = failed.append
    assert saver.save(10, state(10), asynchronous=False).result().committed
    with proxy.window("500", match={"path_contains": "/step-000000020/"}):
        result = saver.save(20, state(20), asynchronous=False).result()
    assert not result.committed and result.attempts == 2 and "internal error" in (result.error or "")
    assert failed == [result]
    assert MARKER not in objects(upstream, "persistent/step-000000020/")
    assert store.latest_committed().step == 10
    # the store is back: the next save commits, and is the latest
    assert saver.save(30, state(30), asynchronous=False).result().committed
    assert store.latest_committed().step == 30
    step, loaded = saver.load_newest(store.restorable_steps(), template)
    assert step == 30 and same(loaded, state(30))


def test_a_marker_put_that_keeps_failing_leaves_no_commit(proxy, upstream):
    store, saver = checkpointer("marker", retries=0)
    assert saver.save(10, state(10), asynchronous=False).result().committed
    with proxy.window("503", match={"methods": ["PUT"], "path_contains": f"step-000000020/{MARKER}"}):
        assert not saver.save(20, state(20), asynchronous=False).result().committed
    assert objects(upstream, "marker/step-000000020/") == {".metadata", "__0_0.distcp"}  # shards, no marker
    assert store.latest_committed().step == 10
    assert store.restorable_steps() == [10]  # and the torn save after it is gone
    assert objects(upstream, "marker/step-000000020/") == set()


def test_a_restore_falls_back_to_the_checkpoint_before_an_unreadable_latest(proxy, caplog):
    store, saver = checkpointer("fallback")
    for step in (10, 20):
        assert saver.save(step, state(step), asynchronous=False).result().committed
    with proxy.window("reset", match={"methods": ["GET"], "path_contains": "/step-000000020/"}):
        with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.checkpointer"):
            step, loaded = saver.load_newest(store.restorable_steps(), template)
    assert step == 10 and same(loaded, state(10))
    assert "checkpoint at step 20 cannot be read" in caplog.text
    assert "falling back to the one before it, step 10" in caplog.text
    # once the store answers again, the latest is read as usual
    step, loaded = saver.load_newest(store.restorable_steps(), template)
    assert step == 20 and same(loaded, state(20))
