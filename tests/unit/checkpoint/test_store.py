"""Unit tests for CheckpointStore (elastic/checkpoint/store.py) on the local filesystem: listing, commit markers,
retention, crash safety of deletion and verification. No torch.distributed process group, no object store.

Checkpoint folders are built by hand (a `.metadata` file and `__R_0.distcp` shards), except for the checks
of DCP's metadata, which need a real `.metadata` written by a single-process DCP save.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from elastic.checkpoint.store import DCP_METADATA, MARKER, TOMBSTONE, CheckpointStore, Retention, prunable

# the single-process DCP save of the fixture below warns that no process group is initialized: intended
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SHARDS = {"__0_0.distcp": b"a" * 100, "__1_0.distcp": b"b" * 60}
METADATA = b"not really DCP metadata"


def step_dir(run: Path, step: int) -> Path:
    return run / CheckpointStore.folder_name(step)


def make_folder(run: Path, step: int, metadata: bool = True, shards: dict[str, bytes] | None = None) -> Path:
    """A checkpoint folder as DCP leaves it before the commit marker: shards (+ .metadata once finished)."""
    folder = step_dir(run, step)
    folder.mkdir(parents=True)
    for name, data in (SHARDS if shards is None else shards).items():
        (folder / name).write_bytes(data)
    if metadata:
        (folder / DCP_METADATA).write_bytes(METADATA)
    return folder


def make_checkpoints(store: CheckpointStore, run: Path, committed: list[int], uncommitted: list[int] = ()):
    for step in sorted([*committed, *uncommitted]):
        make_folder(run, step)
        if step in committed:
            store.commit(step, world_size=2)


def steps_on_disk(run: Path) -> list[int]:
    """Step folders that still hold a checkpoint (retired ones keep only their tombstone)."""
    return sorted(
        int(p.name.split("-")[1]) for p in run.iterdir() if p.name.startswith("step-") and not (p / TOMBSTONE).exists()
    )


@pytest.fixture
def run(tmp_path) -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    return folder


@pytest.fixture
def store(run) -> CheckpointStore:
    return CheckpointStore(str(run))


# ---------------------------------------------------------------------------------------------------------
# naming and listing


def test_folder_names_are_zero_padded_so_lexical_order_is_numeric(store, run):
    assert CheckpointStore.folder_name(10) == "step-000000010"
    assert store.uri(7) == f"{run}/step-000000007"
    assert store.path(7).endswith("/step-000000007")


def test_list_of_a_run_that_does_not_exist_is_empty(tmp_path):
    assert CheckpointStore(str(tmp_path / "nothing-here")).list() == []
    assert CheckpointStore(str(tmp_path / "nothing-here")).latest_committed() is None


def test_list_orders_by_step_and_reports_committed_flags(store, run):
    for step in (100, 10, 30, 20):  # created out of order
        make_folder(run, step)
    store.commit(10, world_size=2)
    store.commit(30, world_size=4)
    # things in the run folder that are not checkpoints
    (run / "step-12").mkdir()
    (run / "step-0000000200-old").mkdir()
    (run / "notes.txt").write_text("hi")

    infos = store.list()
    assert [i.step for i in infos] == [10, 20, 30, 100]
    assert [i.committed for i in infos] == [True, False, True, False]
    by_step = {i.step: i for i in infos}
    assert by_step[30].world_size == 4 and by_step[10].world_size == 2
    assert by_step[20].world_size is None and by_step[20].time is None
    for info in infos:
        assert info.uri == store.uri(info.step)
        assert info.shards == 2
        assert info.size_bytes == 100 + 60 + len(METADATA)
        assert MARKER not in info.files


# ---------------------------------------------------------------------------------------------------------
# commit


def test_commit_writes_a_marker_listing_every_file_with_its_size(store, run):
    folder = make_folder(run, 10)
    info = store.commit(10, world_size=2, extra={"note": "x"})

    marker = json.loads((folder / MARKER).read_text())
    assert marker["step"] == 10
    assert marker["world_size"] == 2
    assert marker["note"] == "x"
    assert isinstance(marker["time"], float)
    assert marker["files"] == {"__0_0.distcp": 100, "__1_0.distcp": 60, DCP_METADATA: len(METADATA)}
    assert store.manifest(10) == marker
    assert info.committed and info.step == 10 and info.world_size == 2
    assert info.shards == 2
    assert info.size_bytes == 160 + len(METADATA)
    assert info.files == marker["files"]


def test_commit_refuses_a_folder_without_dcp_metadata(store, run):
    folder = make_folder(run, 10, metadata=False)
    with pytest.raises(RuntimeError, match=r"\.metadata"):
        store.commit(10, world_size=2)
    assert not (folder / MARKER).exists()
    assert store.info(10).committed is False


def test_commit_refuses_a_folder_that_does_not_exist(store, run):
    with pytest.raises(RuntimeError):
        store.commit(10, world_size=1)
    assert not step_dir(run, 10).exists() or not (step_dir(run, 10) / MARKER).exists()


# ---------------------------------------------------------------------------------------------------------
# latest_committed


def test_latest_committed_ignores_newer_uncommitted_folders(store, run):
    make_checkpoints(store, run, committed=[10, 20], uncommitted=[30, 40])
    latest = store.latest_committed()
    assert latest is not None and latest.step == 20 and latest.committed


def test_latest_committed_is_none_without_any_commit(store, run):
    make_checkpoints(store, run, committed=[], uncommitted=[10, 20])
    assert store.latest_committed() is None


def test_restorable_steps_are_the_commits_and_torn_saves_after_them_go(store, run):
    make_checkpoints(store, run, committed=[10, 30], uncommitted=[20, 40, 50])
    store.retire(10)
    assert store.restorable_steps() == [30]
    # Torn saves after the latest commit would be reused by the next save of their step: deleted. The one
    # before it is retention's to remove.
    assert steps_on_disk(run) == [20, 30]


def test_restorable_steps_without_any_commit_clear_every_torn_save(store, run):
    make_checkpoints(store, run, committed=[], uncommitted=[10, 20])
    assert store.restorable_steps() == []
    assert steps_on_disk(run) == []


# ---------------------------------------------------------------------------------------------------------
# retention


def test_retain_keeps_the_newest_committed_and_never_an_in_flight_save(store, run):
    make_checkpoints(store, run, committed=[10, 30, 40, 50], uncommitted=[20, 45, 60])
    deleted = store.retain(keep=2)
    assert sorted(deleted) == [10, 20, 30, 45]
    # 40 and 50: the two newest committed; 60: newer than the newest commit (a save in flight), kept
    assert steps_on_disk(run) == [40, 50, 60]
    assert [(i.step, i.committed) for i in store.list()] == [(40, True), (50, True), (60, False)]
    assert store.latest_committed().step == 50


def test_retain_keeps_every_folder_newer_than_the_newest_commit(store, run):
    make_checkpoints(store, run, committed=[10], uncommitted=[20, 30, 40])
    assert store.retain(keep=1) == []
    assert steps_on_disk(run) == [10, 20, 30, 40]


def test_retain_without_any_commit_deletes_nothing(store, run):
    make_checkpoints(store, run, committed=[], uncommitted=[10, 20])
    assert store.retain(keep=1) == []
    assert steps_on_disk(run) == [10, 20]


def test_retain_is_idempotent(store, run):
    make_checkpoints(store, run, committed=[10, 20, 30])
    assert store.retain(keep=2) == [10]
    assert store.retain(keep=2) == []
    assert steps_on_disk(run) == [20, 30]


def test_retain_keep_every_keeps_multiples(store, run):
    make_checkpoints(store, run, committed=[10, 20, 30, 40, 50, 60, 70], uncommitted=[35, 80])
    deleted = store.retain(keep=1, keep_every=20)
    assert sorted(deleted) == [10, 30, 35, 50]
    # 20, 40, 60: multiples of 20; 70: the newest; 80: in flight
    assert steps_on_disk(run) == [20, 40, 60, 70, 80]
    assert all(i.committed for i in store.list() if i.step != 80)


def test_retain_keep_every_does_not_keep_uncommitted_multiples(store, run):
    make_checkpoints(store, run, committed=[10, 30], uncommitted=[20])
    assert sorted(store.retain(keep=1, keep_every=20)) == [10, 20]
    assert steps_on_disk(run) == [30]


def test_prunable_is_the_rule_retain_applies():
    folders = {10: True, 20: False, 30: True, 40: True, 45: False, 50: True, 60: False}
    assert prunable(folders, keep=2) == [10, 20, 30, 45]
    assert prunable(folders, keep=1, keep_every=20) == [10, 20, 30, 45]  # 40: a multiple of 20
    assert prunable({10: False, 20: False}, keep=1) == []
    assert prunable({}, keep=3) == []


def _commit(store: CheckpointStore, run: Path, step: int) -> dict[str, int]:
    """A save's commit as the checkpointer makes it: the writer tells the marker its files (no listing)."""
    make_folder(run, step)
    files = {**{name: len(data) for name, data in SHARDS.items()}, DCP_METADATA: len(METADATA)}
    return store.commit(step, world_size=2, files=files).files


def forbid_listing(store: CheckpointStore, monkeypatch) -> None:
    def listing(*args, **kwargs):
        raise AssertionError("retention listed the run folder after its first use")

    for name in ("find", "ls", "glob", "walk"):
        monkeypatch.setattr(store.fs, name, listing)


def test_retention_lists_once_then_prunes_from_what_it_committed(store, run, monkeypatch):
    # a previous placement's checkpoints (and one of its failed saves) are found by the one listing
    make_checkpoints(store, run, committed=[10, 20], uncommitted=[15])
    retention = Retention(store, keep=2)
    assert retention.committed(30, _commit(store, run, 30)) == [10, 15]
    forbid_listing(store, monkeypatch)
    assert retention.committed(40, _commit(store, run, 40)) == [20]
    assert retention.committed(50, _commit(store, run, 50)) == [30]
    assert steps_on_disk(run) == [40, 50]
    # retired folders keep only their tombstone, as with retain()
    assert sorted(p.name for p in step_dir(run, 30).iterdir()) == [TOMBSTONE]
    monkeypatch.undo()
    assert [i.step for i in store.list()] == [40, 50] and store.latest_committed().step == 50


def test_retention_deletes_a_failed_save_once_a_newer_one_commits(store, run, monkeypatch):
    retention = Retention(store, keep=1)
    assert retention.committed(10, _commit(store, run, 10)) == []
    forbid_listing(store, monkeypatch)
    make_folder(run, 20, metadata=False, shards={"__0_0.distcp": b"torn"})  # a save whose upload failed
    retention.failed(20)
    assert steps_on_disk(run) == [10, 20]
    assert retention.committed(30, _commit(store, run, 30)) == [10, 20]
    assert steps_on_disk(run) == [30]


def test_retention_keeps_every_mth_and_agrees_with_retain(tmp_path):
    runs = {name: tmp_path / name for name in ("incremental", "listing")}
    stores = {name: CheckpointStore(str(folder)) for name, folder in runs.items()}
    for folder in runs.values():
        folder.mkdir()
    retention = Retention(stores["incremental"], keep=2, keep_every=30)
    for step in range(10, 110, 10):
        pruned = retention.committed(step, _commit(stores["incremental"], runs["incremental"], step))
        _commit(stores["listing"], runs["listing"], step)
        assert pruned == stores["listing"].retain(keep=2, keep_every=30)
    assert steps_on_disk(runs["incremental"]) == steps_on_disk(runs["listing"]) == [30, 60, 90, 100]


def test_retention_retries_a_prune_that_failed(store, run, monkeypatch):
    retention = Retention(store, keep=1)
    retention.committed(10, _commit(store, run, 10))
    real_rm = store.fs.rm
    monkeypatch.setattr(store.fs, "rm", lambda *a, **k: (_ for _ in ()).throw(OSError("endpoint unavailable")))
    with pytest.raises(OSError):
        retention.committed(20, _commit(store, run, 20))
    monkeypatch.setattr(store.fs, "rm", real_rm)
    assert retention.committed(30, _commit(store, run, 30)) == [10, 20]
    assert steps_on_disk(run) == [30]


# ---------------------------------------------------------------------------------------------------------
# crash safety of deletion


def test_delete_removes_the_marker_before_the_shards(store, run, monkeypatch):
    make_checkpoints(store, run, committed=[10, 20])
    calls = []
    real_rm = store.fs.rm

    def recording_rm(path, recursive=False, **kwargs):
        calls.append((str(path), recursive))
        return real_rm(path, recursive=recursive, **kwargs)

    monkeypatch.setattr(store.fs, "rm", recording_rm)
    store.delete(10)
    assert calls, "delete() removed nothing through the filesystem"
    assert calls[0][0].endswith(f"step-000000010/{MARKER}") and not calls[0][1]
    assert steps_on_disk(run) == [20]


def test_retire_keeps_the_folder_with_only_a_tombstone(store, run):
    """Ray's run snapshot names every reported checkpoint folder; it must keep existing after pruning."""
    make_checkpoints(store, run, committed=[10, 20])
    store.retain(keep=1)
    assert sorted(p.name for p in step_dir(run, 10).iterdir()) == [TOMBSTONE]
    assert [i.step for i in store.list()] == [20]


def test_a_crash_between_marker_and_shards_leaves_the_latest_loadable(store, run, monkeypatch):
    make_checkpoints(store, run, committed=[10, 20])
    real_rm = store.fs.rm

    def crashing_rm(path, recursive=False, **kwargs):
        if any(str(p).endswith(".distcp") for p in (path if isinstance(path, list) else [path])):
            raise OSError("simulated crash: the process died before the shards were removed")
        return real_rm(path, recursive=recursive, **kwargs)

    monkeypatch.setattr(store.fs, "rm", crashing_rm)
    with pytest.raises(OSError, match="simulated crash"):
        store.retain(keep=1)

    # the half-retired folder still holds its shards, but it is not a checkpoint any more
    assert (step_dir(run, 10) / "__0_0.distcp").exists()
    assert not (step_dir(run, 10) / MARKER).exists()
    assert [i.step for i in store.list()] == [20]
    assert store.latest_committed().step == 20
    assert store.verify(10) and MARKER in store.verify(10)[0]
    monkeypatch.setattr(store.fs, "rm", real_rm)
    store.retire(10)  # finishing the job later leaves just the tombstone
    assert sorted(p.name for p in step_dir(run, 10).iterdir()) == [TOMBSTONE]


def test_delete_of_a_missing_folder_is_a_no_op(store, run):
    make_checkpoints(store, run, committed=[10])
    store.delete(99)
    assert steps_on_disk(run) == [10]


# ---------------------------------------------------------------------------------------------------------
# verify: manifest checks (hand-built folders) and DCP metadata checks (a real single-process DCP save)


@pytest.fixture
def dcp_checkpoint(store, run):
    """A real DCP checkpoint at step 100 (one file per tensor, so several shards), not yet committed."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    generator = torch.Generator().manual_seed(0)
    state = {
        "model": {"w": torch.randn(64, 32, generator=generator), "b": torch.randn(64, generator=generator)},
        "optim": {"m": torch.randn(64, 32, generator=generator), "v": torch.randn(64, 32, generator=generator)},
    }
    folder = step_dir(run, 100)
    dcp.save(state, storage_writer=FileSystemWriter(str(folder), single_file_per_rank=False), no_dist=True)
    shards = sorted(p.name for p in folder.iterdir() if p.name.endswith(".distcp"))
    assert len(shards) >= 2 and (folder / DCP_METADATA).exists()
    return folder, shards


def truncate(path: Path, keep_bytes: int) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(keep_bytes)


def test_verify_of_a_good_checkpoint_is_clean(store, dcp_checkpoint):
    store.commit(100, world_size=1)
    assert store.verify(100) == []


def test_verify_reports_a_missing_marker(store, run):
    make_folder(run, 10)
    problems = store.verify(10)
    assert len(problems) == 1
    assert MARKER in problems[0] and "step-000000010" in problems[0]


def test_verify_reports_a_missing_shard(store, dcp_checkpoint):
    folder, shards = dcp_checkpoint
    store.commit(100, world_size=1)
    os.remove(folder / shards[0])
    problems = store.verify(100)
    assert problems and all(shards[0] in p for p in problems), problems
    assert any(p.startswith(f"{shards[0]}: missing") for p in problems)


def test_verify_reports_a_truncated_shard_against_the_manifest(store, dcp_checkpoint):
    folder, shards = dcp_checkpoint
    store.commit(100, world_size=1)
    size = (folder / shards[-1]).stat().st_size
    truncate(folder / shards[-1], size - 10)
    problems = store.verify(100)
    assert any(p.startswith(shards[-1]) and f"manifest says {size}" in p for p in problems), problems
    assert all(shards[-1] in p for p in problems), problems


def test_verify_reports_a_shard_shorter_than_the_metadata_needs(store, dcp_checkpoint):
    """Truncated *before* the commit: the manifest agrees with the short file; only DCP's metadata knows."""
    folder, shards = dcp_checkpoint
    size = (folder / shards[0]).stat().st_size
    truncate(folder / shards[0], size // 2)
    store.commit(100, world_size=1)
    problems = store.verify(100)
    assert problems == [f"{shards[0]}: {size // 2} bytes, the metadata needs {size}"], problems


def test_verify_reports_a_shard_the_metadata_references_but_nobody_listed(store, dcp_checkpoint):
    folder, shards = dcp_checkpoint
    os.remove(folder / shards[0])  # lost before the commit: the manifest does not know it
    store.commit(100, world_size=1)
    problems = store.verify(100)
    assert problems == [f"{shards[0]}: missing (the metadata references it)"], problems


def test_verify_reports_unreadable_metadata(store, run):
    make_folder(run, 10)  # .metadata holds garbage, not a pickled DCP Metadata
    store.commit(10, world_size=2)
    problems = store.verify(10)
    assert len(problems) == 1 and problems[0].startswith(f"{DCP_METADATA}: unreadable"), problems


def test_remove_torn_deletes_only_failed_saves_older_than_the_newest_commit(tmp_path):
    store = CheckpointStore(str(tmp_path / "run-torn"))
    for step, committed in [(10, True), (20, False), (30, True), (40, False)]:
        folder = tmp_path / "run-torn" / f"step-{step:09d}"
        folder.mkdir(parents=True)
        (folder / ".metadata").write_bytes(b"m")
        (folder / "__0_0.distcp").write_bytes(b"x" * 8)
        if committed:
            store.commit(step, world_size=1)
    assert store.remove_torn() == [20]
    assert [(i.step, i.committed) for i in store.list()] == [(10, True), (30, True), (40, False)]


def test_the_verify_command_exits_1_naming_the_missing_shard(store, run, dcp_checkpoint, tmp_path):
    import subprocess
    import sys

    folder, shards = dcp_checkpoint
    store.commit(100, world_size=1)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_"))}
    env["ELASTIC_HOME"] = str(tmp_path / "home")  # no local stack: the run is addressed by its path
    command = [sys.executable, "-m", "elastic", "checkpoints", "verify", str(run)]
    ok = subprocess.run(command, capture_output=True, text=True, env=env)
    assert ok.returncode == 0 and "ok (" in ok.stdout, ok.stderr
    (folder / shards[0]).unlink()
    broken = subprocess.run(command, capture_output=True, text=True, env=env)
    assert broken.returncode == 1
    assert f"{shards[0]}: missing" in broken.stderr and "Traceback" not in broken.stderr


def test_each_save_records_why_it_was_written_in_its_marker(store, run):
    """Periodic saves, the just-in-time one at a reclaim notice and the final one say so: `elastic checkpoints
    ls` shows it, so a resume from a just-in-time checkpoint is visible after the fact."""
    import torch

    from elastic.checkpoint.checkpointer import ShardedCheckpointer

    checkpointer = ShardedCheckpointer(store, rank=0, world_size=1)
    state = {"model": {"w": torch.arange(6.0)}}
    checkpointer.save(10, state, asynchronous=False)
    checkpointer.save(13, state, asynchronous=False, reason="just-in-time")
    assert checkpointer.wait().committed
    assert [(i.step, i.reason) for i in store.list()] == [(10, "periodic"), (13, "just-in-time")]
    assert store.info(13).to_json()["reason"] == "just-in-time"
    assert json.loads((step_dir(run, 13) / MARKER).read_text())["reason"] == "just-in-time"


def test_prunable_keeps_pinned_committed_steps():
    folders = {10: True, 20: True, 30: True, 40: True}
    assert prunable(folders, keep=1, pinned={20}) == [10, 30]
    assert prunable(folders, keep=1, pinned={25, 99}) == [10, 20, 30]  # a pin of no checkpoint keeps nothing


def test_a_pinned_checkpoint_survives_retention_until_unpinned(store, run):
    """PBT's exploit: the donor's checkpoint a recipient is about to copy is pinned (one pin per recipient, a
    new one replaces it); a sweep trial's retention keeps it; once the recipient unpins, it goes."""
    make_checkpoints(store, run, committed=[10])
    store.pin(10, holder="sweep-b")
    store.pin(10, holder="sweep-c")
    assert store.pinned_steps() == {10}
    retention = Retention(store, keep=1)
    retention.honor_pins = True
    assert retention.committed(20, _commit(store, run, 20)) == []
    assert retention.committed(30, _commit(store, run, 30)) == [20]
    assert steps_on_disk(run) == [10, 30]
    store.pin(30, holder="sweep-c")  # c's new exploit replaces its pin
    store.unpin("sweep-b")
    store.unpin("sweep-b")  # twice: harmless
    assert store.pinned_steps() == {30}
    assert retention.committed(40, _commit(store, run, 40)) == [10]
    assert steps_on_disk(run) == [30, 40]


def test_retention_of_a_plain_run_does_not_read_pins(store, run, monkeypatch):
    make_checkpoints(store, run, committed=[10])
    store.pin(10, holder="someone")
    monkeypatch.setattr(store, "pinned_steps", lambda: pytest.fail("a plain run lists no pins"))
    assert Retention(store, keep=1).committed(20, _commit(store, run, 20)) == [10]
