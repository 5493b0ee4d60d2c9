"""Integration tests for ShardedCheckpointer + CheckpointStore (elastic/checkpoint/store.py) against a real S3 API.

A moto S3 server runs for the module; every scenario runs real gloo process groups in processes started by
torch.multiprocessing.spawn, with a small DDP model and Adam, exactly as a training worker would: the state
dict comes from torch.distributed.checkpoint.state_dict.get_state_dict and saves run on a gloo group of their
own. Ranks report what they saw through files under a temporary folder; the assertions run in pytest's
process. No Ray.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BUCKET = "bucket"


@pytest.fixture(scope="module")
def s3_env(moto_s3):
    """The module's S3 endpoint (conftest.moto_s3) with bucket `bucket`."""
    import boto3

    boto3.client(
        "s3",
        endpoint_url=moto_s3["AWS_ENDPOINT_URL"],
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    ).create_bucket(Bucket=BUCKET)
    return moto_s3


def s3_client(env):
    import boto3

    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1")


def keys_under(env, prefix: str, bucket: str = BUCKET) -> dict[str, int]:
    """Object name (relative to prefix) -> size, straight from S3 (no fsspec cache involved)."""
    out = {}
    for page in s3_client(env).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            out[obj["Key"][len(prefix) :].lstrip("/")] = obj["Size"]
    return out


# ---------------------------------------------------------------------------------------------------------
# What runs inside every rank (top-level functions: torch.multiprocessing.spawn pickles them by name)


def _build(seed: int):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
    )


def _train(model, optimizer, rank: int, first_step: int, steps: int) -> None:
    import torch

    for step in range(first_step, first_step + steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, 16, generator=generator)
        y = torch.randn(8, 4, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def _clone(value):
    import copy

    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return copy.deepcopy(value)


def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}/{key}"))
        return out
    if isinstance(value, (list, tuple)):
        out = {}
        for index, item in enumerate(value):
            out.update(_flatten(item, f"{prefix}[{index}]"))
        return out
    return {prefix: value}


def _differences(actual: dict, expected: dict) -> list[str]:
    """Paths where two (nested) state dicts differ; tensors must be bitwise equal, with the same dtype."""
    import torch

    flat_actual, flat_expected = _flatten(actual), _flatten(expected)
    problems = [f"{path}: missing" for path in sorted(set(flat_expected) - set(flat_actual))]
    problems += [f"{path}: unexpected" for path in sorted(set(flat_actual) - set(flat_expected))]
    for path in sorted(set(flat_actual) & set(flat_expected)):
        a, e = flat_actual[path], flat_expected[path]
        if isinstance(e, torch.Tensor):
            if not (isinstance(a, torch.Tensor) and a.dtype == e.dtype and torch.equal(a, e)):
                problems.append(f"{path}: differs")
        elif a != e:
            problems.append(f"{path}: {a!r} != {e!r}")
    return problems


def _ballast(megabytes: int) -> dict:
    import torch

    count = megabytes // 4  # 4 MiB float32 tensors
    return {f"t{i}": torch.full((1024 * 1024,), float(i)) for i in range(count)}


def _result_json(result) -> dict | None:
    if result is None:
        return None
    return {
        "step": result.step,
        "committed": result.committed,
        "error": result.error,
        "attempts": result.attempts,
        "blocked_seconds": result.blocked_seconds,
    }


def _write(out: Path, name: str, payload) -> None:
    tmp = out / f".{name}.tmp"
    tmp.write_text(json.dumps(payload))
    tmp.rename(out / name)


def _worker(rank: int, world: int, port: int, env: dict, out: str, scenarios: list) -> None:
    """One rank: runs each (name, args) scenario in order, each with a fresh DDP model, optimizer, gloo group
    of its own for the checkpointer, store and checkpointer; writes `<name>-rank<rank>.json` after each."""
    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from elastic.checkpoint.checkpointer import ShardedCheckpointer
    from elastic.checkpoint.store import CheckpointStore

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    for name, args in scenarios:
        model = DistributedDataParallel(_build(args.get("seed", 0)))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.get("group_timeout", 120)))
        store = CheckpointStore(args["run_uri"])
        checkpointer = ShardedCheckpointer(
            store, rank, world, group, retries=args.get("retries", 3), backoff_seconds=args.get("backoff", 0.1)
        )
        report: dict = {"rank": rank, "world": world, "env_endpoint": os.environ.get("AWS_ENDPOINT_URL")}
        SCENARIOS[name](rank, world, model, optimizer, store, checkpointer, Path(out), args, report)
        _write(Path(out), f"{name}-rank{rank}.json", report)
        dist.barrier()
    dist.destroy_process_group()


def _scenario_save_async(rank, world, model, optimizer, store, checkpointer, out, args, report):
    import torch

    _train(model, optimizer, rank, 0, 3)
    state = _state(model, optimizer)
    snapshot = _clone(state)
    step = args["step"]
    checkpointer.save(step, state)  # asynchronous: returns once staged
    report["in_flight_after_save"] = checkpointer.in_flight
    _train(model, optimizer, rank, 3, 4)  # training goes on while the upload runs
    report["result"] = _result_json(checkpointer.wait())
    report["changed_by_training"] = bool(_differences(_state(model, optimizer), snapshot))

    template = _state(model, optimizer)  # the live tensors, now 4 steps newer than the checkpoint
    checkpointer.load(step, template)
    report["loaded_vs_snapshot"] = _differences(template, snapshot)
    if rank == 0:
        torch.save(snapshot, args["snapshot"])


def _scenario_load(rank, world, model, optimizer, store, checkpointer, out, args, report):
    import torch
    from torch.distributed.checkpoint.state_dict import set_state_dict

    expected = torch.load(args["snapshot"], weights_only=False)
    template = _state(model, optimizer)
    report["differs_before_load"] = bool(_differences(_clone(template), expected))
    checkpointer.load(args["step"], template)
    set_state_dict(model, optimizer, model_state_dict=template["model"], optim_state_dict=template["optim"])
    report["after_load"] = _differences(_state(model, optimizer), expected)
    # the restored optimizer must work: one more step on every rank keeps DDP replicas identical
    _train(model, optimizer, rank, 100, 1)
    report["steps_after_load"] = 1


def _counting_reads(fail_on: int | None = None):
    """Patch the loader's whole-object read in this process: records the checkpoint files it fetches, and with
    `fail_on` raises on this rank's reads (a storage error during a load)."""
    from elastic.checkpoint.dcp_io import ObjectStoreFileSystem

    fetched, real = [], ObjectStoreFileSystem.fetch

    def fetch(self, path):
        name = str(path).rsplit("/", 1)[-1]
        if name.endswith(".distcp"):
            fetched.append(name)
            if fail_on is not None:
                raise OSError(f"simulated S3 error reading {name}")
        return real(self, path)

    ObjectStoreFileSystem.fetch = fetch
    return fetched, lambda: setattr(ObjectStoreFileSystem, "fetch", real)


def _scenario_load_counted(rank, world, model, optimizer, store, checkpointer, out, args, report):
    """Load the replicated W=2 checkpoint at W=2: which shard files did this rank fetch from storage?"""
    import torch

    expected = torch.load(args["snapshot"], weights_only=False)
    template = _state(model, optimizer)
    fetched, restore = _counting_reads()
    try:
        checkpointer.load(args["step"], template)
    finally:
        restore()
    report["fetched"] = fetched
    report["after_load"] = _differences(template, expected)


def _scenario_load_owner_fails(rank, world, model, optimizer, store, checkpointer, out, args, report):
    """Rank 1's storage reads fail mid-load: every rank's load must fail (none may wait forever for rank 1's
    broadcast, none may load a half-received state)."""
    fetched, restore = _counting_reads(fail_on=1 if rank == 1 else None)
    started = time.monotonic()
    try:
        checkpointer.load(args["step"], _state(model, optimizer))
        report["raised"] = None
    except BaseException as err:  # noqa: B036 - DCP's CheckpointException is a BaseException
        report["raised"] = f"{type(err).__name__}: {str(err)[:300]}"
        report["names_the_cause"] = "simulated S3 error" in str(err)
    finally:
        restore()
    report["seconds"] = time.monotonic() - started


def _wait_and_report(checkpointer, report) -> None:
    """wait() is documented to return a SaveResult, failed or not; record anything it raises instead."""
    try:
        report["result"] = _result_json(checkpointer.wait())
    except BaseException as err:  # noqa: B036 - DCP's CheckpointException is a BaseException
        report["result"] = None
        report["raised"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    report["recorded_results"] = [_result_json(r) for r in checkpointer.results]


def _scenario_fail(rank, world, model, optimizer, store, checkpointer, out, args, report):
    _train(model, optimizer, rank, 0, 1)
    started = time.monotonic()
    checkpointer.save(args["step"], _state(model, optimizer))
    _wait_and_report(checkpointer, report)
    report["seconds"] = time.monotonic() - started


def _scenario_upload_fails_on_one_rank(rank, world, model, optimizer, store, checkpointer, out, args, report):
    """A good checkpoint, then a save whose shard uploads fail on rank 1 only: both ranks must fail alike (a
    rank that believed it committed would go on while the other retried a collective save alone)."""
    from elastic.checkpoint.dcp_io import ObjectStoreFileSystem

    _train(model, optimizer, rank, 0, 1)
    checkpointer.save(args["good_step"], _state(model, optimizer), asynchronous=False)
    report["good"] = _result_json(checkpointer.results[-1])
    real = ObjectStoreFileSystem.put

    def put(self, path, stream):
        if rank == 1 and str(path).endswith(".distcp"):
            raise OSError("simulated S3 error writing a shard")
        return real(self, path, stream)

    ObjectStoreFileSystem.put = put
    try:
        started = time.monotonic()
        checkpointer.save(args["step"], _state(model, optimizer))
        _wait_and_report(checkpointer, report)
        report["seconds"] = time.monotonic() - started
    finally:
        ObjectStoreFileSystem.put = real


def _scenario_kill(rank, world, model, optimizer, store, checkpointer, out, args, report):
    """Commit a good checkpoint, then start a large async save and exit hard, without wait(), in the middle
    of its upload: once rank 0's (small) shard is in the store, while the last rank's 64 MB are still going up
    (the ballast is that rank's alone, so it is not split across ranks)."""
    import boto3

    _train(model, optimizer, rank, 0, 2)
    checkpointer.save(args["good_step"], _state(model, optimizer), asynchronous=False)
    report["good"] = _result_json(checkpointer.results[-1])
    _train(model, optimizer, rank, 2, 1)
    state = _state(model, optimizer)
    if rank == world - 1:
        state["ballast"] = _ballast(args["ballast_mb"])
    checkpointer.save(args["torn_step"], state)
    report["in_flight_after_save"] = checkpointer.in_flight

    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
    bucket, _, key = store.path(args["torn_step"]).partition("/")
    deadline = time.monotonic() + 30
    report["torn_shard_seen"] = False
    while time.monotonic() < deadline and not report["torn_shard_seen"]:
        listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{key}/__0_0.distcp")
        report["torn_shard_seen"] = listed.get("KeyCount", 0) > 0
        time.sleep(0.01)
    report["in_flight_at_exit"] = checkpointer.in_flight
    _write(out, f"kill-rank{rank}.json", report)
    os._exit(0)  # no wait(), no barrier: the process is gone with the upload in flight


def _scenario_kill_before_marker(rank, world, model, optimizer, store, checkpointer, out, args, report):
    """Every shard and .metadata are written, then the process dies just before the commit marker."""
    import threading

    _train(model, optimizer, rank, 0, 2)
    checkpointer.save(args["good_step"], _state(model, optimizer), asynchronous=False)
    report["good"] = _result_json(checkpointer.results[-1])
    reached_commit = threading.Event()

    def commit_never_finishes(*_args, **_kwargs):
        reached_commit.set()
        threading.Event().wait()  # the process dies here

    store.commit = commit_never_finishes
    _train(model, optimizer, rank, 2, 1)
    checkpointer.save(args["torn_step"], _state(model, optimizer))
    if rank == 0:
        report["reached_commit"] = reached_commit.wait(timeout=60)
    else:
        # Other ranks wait in the outcome agreement for rank 0, which dies before committing.
        time.sleep(1.0)
    _write(out, f"kill_before_marker-rank{rank}.json", report)
    os._exit(0)


def _scenario_commit_fails_once(rank, world, model, optimizer, store, checkpointer, out, args, report):
    """The marker write fails once on rank 0 (a transient S3 error): the save is retried."""
    if rank == 0:
        real_commit = store.commit
        calls = []

        def flaky_commit(*a, **k):
            calls.append(1)
            if len(calls) == 1:
                raise OSError("simulated transient S3 error writing the marker")
            return real_commit(*a, **k)

        store.commit = flaky_commit
    _train(model, optimizer, rank, 0, 1)
    checkpointer.save(args["step"], _state(model, optimizer))
    _wait_and_report(checkpointer, report)


SCENARIOS = {
    "save_async": _scenario_save_async,
    "load": _scenario_load,
    "load_counted": _scenario_load_counted,
    "load_owner_fails": _scenario_load_owner_fails,
    "fail": _scenario_fail,
    "upload_fails_on_one_rank": _scenario_upload_fails_on_one_rank,
    "kill": _scenario_kill,
    "kill_before_marker": _scenario_kill_before_marker,
    "commit_fails_once": _scenario_commit_fails_once,
}


def free_port() -> int:
    """A free TCP port for the gloo rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(world: int, env: dict, out: Path, scenarios: list[tuple[str, dict]]) -> dict[str, list[dict]]:
    """Run the scenarios, in order, on `world` gloo ranks (one spawn: torch's import dominates the cost).
    Returns {scenario: [report of rank 0, rank 1, ...]}."""
    import torch.multiprocessing as mp

    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(_worker, args=(world, free_port(), dict(env), str(out), scenarios), nprocs=world, join=True)
    reports = {}
    for name, _ in scenarios:
        reports[name] = []
        for rank in range(world):
            path = out / f"{name}-rank{rank}.json"
            assert path.exists(), f"rank {rank} of {name} wrote no report"
            reports[name].append(json.loads(path.read_text()))
    return reports


# ---------------------------------------------------------------------------------------------------------
# a) async save at W=2 while training continues; b) resharding to W=1 and W=3


SAVED_STEP = 3
RUN_X = f"s3://{BUCKET}/run-x"
RUN_KILL = f"s3://{BUCKET}/run-kill"
RUN_KILL_LATE = f"s3://{BUCKET}/run-kill-late"
RUN_FLAKY = f"s3://{BUCKET}/run-flaky-commit"
RUN_UPLOAD_FAILS = f"s3://{BUCKET}/run-upload-fails"
NO_BUCKET = "s3://no-such-bucket/run"


@pytest.fixture(scope="module")
def w2_run(s3_env, tmp_path_factory):
    """W=2: (a) the async save, then loads of it (files fetched per rank; a rank whose reads fail), (c) a save to a missing bucket, a marker write failing once on rank 0, and
    last, a hard exit with a large save in flight (a committed checkpoint saved first)."""
    out = tmp_path_factory.mktemp("w2")
    snapshot = out / "snapshot.pt"
    reports = spawn(
        2,
        s3_env,
        out,
        [
            ("save_async", {"run_uri": RUN_X, "step": SAVED_STEP, "snapshot": str(snapshot)}),
            ("load_counted", {"run_uri": RUN_X, "step": SAVED_STEP, "seed": 1234, "snapshot": str(snapshot)}),
            ("load_owner_fails", {"run_uri": RUN_X, "step": SAVED_STEP, "group_timeout": 60}),
            ("fail", {"run_uri": NO_BUCKET, "step": 5, "retries": 1, "backoff": 0.1}),
            ("upload_fails_on_one_rank", {"run_uri": RUN_UPLOAD_FAILS, "good_step": 3, "step": 6, "retries": 1}),
            ("commit_fails_once", {"run_uri": RUN_FLAKY, "step": 7, "retries": 1, "group_timeout": 4}),
            ("kill", {"run_uri": RUN_KILL, "good_step": 10, "torn_step": 20, "ballast_mb": 64}),
        ],
    )
    return {"reports": reports, "snapshot": snapshot}


@pytest.fixture(scope="module")
def w1_run(s3_env, w2_run, tmp_path_factory):
    """W=1: load the W=2 checkpoint."""
    return spawn(
        1,
        s3_env,
        tmp_path_factory.mktemp("w1"),
        [
            ("load", {"run_uri": RUN_X, "step": SAVED_STEP, "seed": 1234, "snapshot": str(w2_run["snapshot"])}),
        ],
    )


@pytest.fixture(scope="module")
def w3_run(s3_env, w2_run, tmp_path_factory):
    """W=3: load the W=2 checkpoint; then a save whose processes die just before the commit marker."""
    return spawn(
        3,
        s3_env,
        tmp_path_factory.mktemp("w3"),
        [
            ("load", {"run_uri": RUN_X, "step": SAVED_STEP, "seed": 1234, "snapshot": str(w2_run["snapshot"])}),
            ("kill_before_marker", {"run_uri": RUN_KILL_LATE, "good_step": 10, "torn_step": 20}),
        ],
    )


# ---------------------------------------------------------------------------------------------------------
# a) async save at W=2 while training continues; b) resharding to W=1 and W=3


def test_async_save_at_w2_is_the_state_when_save_was_called(w2_run, s3_env):
    from elastic.checkpoint.store import DCP_METADATA, MARKER, CheckpointStore

    reports = w2_run["reports"]["save_async"]
    for report in reports:
        assert report["env_endpoint"] == s3_env["AWS_ENDPOINT_URL"]  # the spawned ranks got the environment
        assert report["result"]["committed"] is True, report
        assert report["result"]["error"] is None and report["result"]["attempts"] == 1
        assert report["changed_by_training"], "training after save() did not change the state: the test proves nothing"
        assert report["loaded_vs_snapshot"] == [], f"rank {report['rank']}: checkpoint != state at save()"

    objects = keys_under(s3_env, f"run-x/{CheckpointStore.folder_name(SAVED_STEP)}/")
    assert MARKER in objects and DCP_METADATA in objects
    shards = {name: size for name, size in objects.items() if name.endswith(".distcp")}
    assert sorted(shards) == ["__0_0.distcp", "__1_0.distcp"], objects  # both ranks wrote a shard
    total = sum(shards.values())
    assert all(size >= 0.25 * total for size in shards.values()), f"unbalanced shards: {shards}"

    store = CheckpointStore(RUN_X)
    info = store.latest_committed()
    assert info is not None and info.step == SAVED_STEP and info.committed and info.world_size == 2
    assert info.shards == 2
    manifest = store.manifest(SAVED_STEP)
    assert {k: int(v) for k, v in manifest["files"].items()} == {k: v for k, v in objects.items() if k != MARKER}
    assert store.verify(SAVED_STEP) == []


@pytest.mark.parametrize("world", [1, 3])
def test_w2_checkpoint_reshards_into_other_world_sizes(request, world):
    reports = request.getfixturevalue(f"w{world}_run")["load"]
    assert [r["world"] for r in reports] == [world] * world
    for report in reports:
        assert report["differs_before_load"], "the fresh model already equals the checkpoint: the test proves nothing"
        assert report["after_load"] == [], f"rank {report['rank']} of {world}: {report['after_load'][:10]}"
        assert report["steps_after_load"] == 1


def test_a_replicated_checkpoint_is_read_from_storage_once_across_ranks(w2_run, s3_env):
    reports = w2_run["reports"]["load_counted"]
    shards = sorted(n for n in keys_under(s3_env, f"run-x/step-{SAVED_STEP:09d}/") if n.endswith(".distcp"))
    fetched = [name for report in reports for name in report["fetched"]]
    assert sorted(fetched) == shards, reports  # every shard once, by one rank, and the other got it broadcast
    assert all(report["fetched"] for report in reports), "one rank read everything: nothing was shared"
    for report in reports:
        assert report["after_load"] == [], f"rank {report['rank']}: {report['after_load'][:10]}"


def test_a_failed_read_on_one_rank_fails_the_load_on_every_rank(w2_run):
    for report in w2_run["reports"]["load_owner_fails"]:
        assert report["raised"], f"rank {report['rank']} loaded although rank 1 could not read its files"
        assert report["seconds"] < 30, report  # failed promptly: no rank waited for a broadcast that never came
    assert w2_run["reports"]["load_owner_fails"][1]["names_the_cause"]


# ---------------------------------------------------------------------------------------------------------
# c) failed and torn saves never commit


def test_a_save_whose_upload_fails_never_commits(w2_run, s3_env):
    from elastic.checkpoint.store import CheckpointStore

    for report in w2_run["reports"]["fail"]:
        # whichever way the failure surfaces, no rank may believe the checkpoint committed
        assert report["result"] is None or report["result"]["committed"] is False, report
        assert report["result"] is not None or report.get("raised"), report
        assert not any(r["committed"] for r in report["recorded_results"]), report
        assert report["seconds"] < 30
    buckets = [b["Name"] for b in s3_client(s3_env).list_buckets()["Buckets"]]
    assert "no-such-bucket" not in buckets  # nothing written anywhere, not even a bucket
    assert CheckpointStore(NO_BUCKET).latest_committed() is None
    assert CheckpointStore(NO_BUCKET).list() == []


def test_a_shard_upload_failing_on_one_rank_never_commits_and_every_rank_agrees(w2_run, s3_env):
    from elastic.checkpoint.store import MARKER, CheckpointStore

    reports = w2_run["reports"]["upload_fails_on_one_rank"]
    for report in reports:
        assert report["good"]["committed"] is True, report
        assert report.get("raised") is None, report
        result = report["result"]
        assert result["committed"] is False and result["attempts"] == 2, report  # retries=1, on both ranks
        assert report["seconds"] < 30, report
    errors = {r["rank"]: r["result"]["error"] for r in reports}
    assert "simulated S3 error writing a shard" in errors[1] and errors[0], errors
    folder = keys_under(s3_env, "run-upload-fails/step-000000006/")
    assert MARKER not in folder, folder
    store = CheckpointStore(RUN_UPLOAD_FAILS)
    assert store.latest_committed().step == 3


def test_a_failed_save_is_retried_and_reported_as_a_failed_result(w2_run):
    for report in w2_run["reports"]["fail"]:
        assert report.get("raised") is None, f"rank {report['rank']}: wait() raised {report.get('raised')}"
        result = report["result"]
        assert result["committed"] is False and result["error"], report
        assert result["attempts"] == 2, report  # retries=1: two attempts
        assert report["recorded_results"] == [result]


def test_a_process_killed_during_upload_leaves_the_previous_checkpoint_latest(w2_run, s3_env):
    from elastic.checkpoint.store import MARKER, CheckpointStore

    reports = w2_run["reports"]["kill"]
    for report in reports:
        assert report["good"]["committed"] is True, report
        assert report["in_flight_after_save"] and report["in_flight_at_exit"], "the save finished before the exit"
        assert report["torn_shard_seen"], "the upload never started: nothing was torn"

    torn = keys_under(s3_env, "run-kill/step-000000020/")
    assert "__0_0.distcp" in torn and MARKER not in torn, torn  # a torn checkpoint: some shards, no marker
    store = CheckpointStore(RUN_KILL)
    latest = store.latest_committed()
    assert latest is not None and latest.step == 10
    assert store.verify(10) == []
    assert [(i.step, i.committed) for i in store.list()] == [(10, True), (20, False)]
    assert MARKER in store.verify(20)[0]


def test_a_process_killed_just_before_the_marker_leaves_the_previous_checkpoint_latest(w3_run, s3_env):
    from elastic.checkpoint.store import DCP_METADATA, MARKER, CheckpointStore

    reports = w3_run["kill_before_marker"]
    assert reports[0]["good"]["committed"] is True
    assert reports[0]["reached_commit"] is True
    torn = keys_under(s3_env, "run-kill-late/step-000000020/")
    # a complete-looking DCP checkpoint: .metadata and every rank's shard; only the marker is missing
    assert DCP_METADATA in torn and MARKER not in torn, torn
    assert {"__0_0.distcp", "__1_0.distcp", "__2_0.distcp"} <= set(torn), torn

    store = CheckpointStore(RUN_KILL_LATE)
    assert store.latest_committed().step == 10
    assert store.info(20).committed is False
    problems = store.verify(20)
    assert len(problems) == 1 and MARKER in problems[0]
    # retention treats the torn folder as a save in flight (newer than the newest commit): never deleted
    assert store.retain(keep=1) == []
    assert store.latest_committed().step == 10


def test_a_transient_marker_failure_on_rank_0_leaves_all_ranks_agreeing(w2_run):
    from elastic.checkpoint.store import CheckpointStore

    reports = w2_run["reports"]["commit_fails_once"]
    committed_in_store = CheckpointStore(RUN_FLAKY).info(7).committed
    outcomes = [r["result"]["committed"] if r["result"] else f"raised {r['raised']}" for r in reports]
    assert outcomes == [committed_in_store] * 2, f"ranks say {outcomes}, the store says {committed_in_store}"


# ---------------------------------------------------------------------------------------------------------
# a store in a long-lived process must see commits made by other processes


def _commit_elsewhere(env: dict, run_uri: str, *steps: int) -> None:
    """Commit from another process (a training worker), as the real system does."""
    code = (
        "import sys; from elastic.checkpoint.store import CheckpointStore; s = CheckpointStore(sys.argv[1]); "
        "[s.commit(int(a), 1) for a in sys.argv[2:]]"
    )
    subprocess.run(
        [sys.executable, "-c", code, run_uri, *map(str, steps)],
        env={**os.environ, **env},
        check=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )


def _write_folder(store, step: int) -> None:
    store.fs.pipe({f"{store.path(step)}/.metadata": b"m", f"{store.path(step)}/__0_0.distcp": b"shard"})


def test_a_commit_by_another_process_is_seen_by_a_store_that_listed_the_folder_before(s3_env):
    from elastic.checkpoint.store import CheckpointStore

    run_uri = f"s3://{BUCKET}/run-stale"
    store = CheckpointStore(run_uri)
    _write_folder(store, 10)
    assert [(i.step, i.committed) for i in store.list()] == [(10, False)]  # an upload in flight
    _commit_elsewhere(s3_env, run_uri, 10)
    assert "COMMITTED.json" in keys_under(s3_env, "run-stale/step-000000010/")
    latest = CheckpointStore(run_uri).latest_committed()
    assert latest is not None and latest.step == 10


def test_retain_never_deletes_a_checkpoint_another_process_committed(s3_env):
    from elastic.checkpoint.store import CheckpointStore

    run_uri = f"s3://{BUCKET}/run-stale-retain"
    store = CheckpointStore(run_uri)
    _write_folder(store, 10)
    assert [(i.step, i.committed) for i in store.list()] == [(10, False)]
    _write_folder(store, 20)
    _commit_elsewhere(s3_env, run_uri, 10, 20)
    store.retain(keep=2)
    assert set(keys_under(s3_env, "run-stale-retain/")) >= {
        "step-000000010/COMMITTED.json",
        "step-000000020/COMMITTED.json",
    }


# ---------------------------------------------------------------------------------------------------------
# d) the checkpoint benchmark users run against their own bucket works end to end


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_checkpoint_benchmark_measures_and_loads_back_exactly(s3_env, parallelism):
    from elastic.bench.checkpointing import bench_checkpoint

    result = bench_checkpoint(f"s3://{BUCKET}/bench", size_mb=8, workers=2, repeats=2, parallelism=parallelism)
    assert result.loaded_equal, "the benchmark's load did not give back the saved state"
    assert result.parallelism == parallelism
    if parallelism == "fsdp":  # each rank wrote its own shards: about half the checkpoint each
        assert result.bytes_per_rank_ratio <= 0.5 + 0.05, result.bytes_per_rank_ratio
    assert len(result.throughput_ratios) == len(result.load_ratios) == result.repeats == 2
    assert min(result.throughput_ratios) <= result.throughput_ratio <= max(result.throughput_ratios)
    assert result.workers == 2 and result.size_mb >= 8 and result.shards >= 2  # whole layers: 12 MB at least
    for figure in (result.raw_put_mb_s, result.save_mb_s, result.raw_get_mb_s, result.load_mb_s):
        assert figure > 0
    assert 0 < result.stall_ratio < 1 and result.throughput_ratio > 0 and result.load_ratio > 0
    # torch's own path ran on the same state in the same run, and its load gave the state back too (loaded_equal)
    for figure in (result.torch_save_mb_s, result.torch_load_mb_s, result.save_vs_torch, result.load_vs_torch):
        assert figure > 0
    assert 0 < result.torch_async_save_stall_ratio < 1
    assert keys_under(s3_env, "bench/") == {}, "the benchmark left objects behind"
