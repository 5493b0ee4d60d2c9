"""`elastic data prepare --address`: the conversion as Ray tasks (one local Ray of 2 CPUs for the module) writes
the dataset the local path writes from the same files (the same shards, rows, row groups and schema: both run
elastic.data.prepare.convert_files), every row exactly once and in the source's order, replaces an earlier run's
shards on a re-run, and refuses what it cannot distribute (a shuffle, a generator, a NumPy file, an unreachable
address, a task's unreadable file) with one line."""

from __future__ import annotations

import importlib
import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
from click.testing import CliRunner

from elastic.data.manifest import MANIFEST_NAME, PREPARING_NAME, DatasetError, index, load
from elastic.data.prepare import Written, begin, commit, plan_source, prepare
from elastic.data.prepare_ray import _one_line, check_distributable, prepare_on_ray, storage_env

FILE_ROWS = (4000, 500, 200, 4000)  # with shard_mb=0.05: the first file alone, the small ones grouped
ROWS = sum(FILE_ROWS)
SIZES = {"shard_mb": 0.05, "row_group_mb": 0.01}

cli_main = importlib.import_module("elastic.cli.main")  # elastic.cli re-exports main(), the function


@pytest.fixture(scope="module")
def cluster():
    patch = pytest.MonkeyPatch()
    patch.delenv("RAY_ADDRESS", raising=False)  # a local Ray of its own, whatever the shell points at
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    patch.undo()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Parquet files of consecutive ids, as a folder (sorted by name: the source's order)."""
    folder = tmp_path_factory.mktemp("source")
    start = 0
    for i, rows in enumerate(FILE_ROWS):
        ids = np.arange(start, start + rows)
        table = pa.table({"id": ids, "value": ids * 0.5, "text": [f"row {j}" for j in ids]})
        pq.write_table(table, folder / f"events-{i}.parquet")
        start += rows
    return str(folder)


def _layout(manifest):
    return [(f.path, f.rows, f.row_groups) for f in manifest.files]


def _ids(dest) -> list[int]:
    return pq.read_table(dest).column("id").to_pylist()


def test_the_ray_path_writes_what_the_local_path_writes(cluster, source, tmp_path):
    groups = plan_source(source).groups(SIZES["shard_mb"])
    assert groups == [[0], [1, 2, 3]]  # a task per big file, small files together
    local = prepare(source, str(tmp_path / "local"), **SIZES)
    remote = prepare_on_ray(source, str(tmp_path / "remote"), **SIZES)
    assert remote.rows == local.rows == ROWS and remote.schema == local.schema
    assert _layout(remote) == _layout(local) and remote.num_row_groups > len(remote.files) > len(groups)
    assert {f.path.split("-")[1] for f in remote.files} == {"00000", "00001"}  # part-<first source index>-<n>
    assert _ids(tmp_path / "remote") == list(range(ROWS))  # every row once, in the source's order
    assert load(str(tmp_path / "remote")).fingerprint == remote.fingerprint
    assert not (tmp_path / "remote" / PREPARING_NAME).exists()
    # The manifest from what the tasks reported is the one the files' footers give.
    assert _layout(index(str(tmp_path / "remote"), write=False)) == _layout(remote)


def test_json_lines_too(cluster, tmp_path):
    folder = tmp_path / "jsonl"
    folder.mkdir()
    for part in range(3):
        rows = [{"id": part * 100 + i, "text": f"t{i}"} for i in range(100)]
        (folder / f"{part}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    local = prepare(str(folder), str(tmp_path / "local"), shard_mb=0.001, row_group_mb=0.001)
    remote = prepare_on_ray(str(folder), str(tmp_path / "remote"), shard_mb=0.001, row_group_mb=0.001)
    assert _layout(remote) == _layout(local) and remote.schema == local.schema and len(remote.files) >= 3
    assert _ids(tmp_path / "remote") == list(range(300))


def test_a_rerun_replaces_the_shards_cleanly(cluster, source, tmp_path):
    dest = tmp_path / "dataset"
    first = prepare_on_ray(source, str(dest), shard_mb=0.02, row_group_mb=0.01)
    again = prepare_on_ray(source, str(dest), shard_mb=0.02, row_group_mb=0.01)
    assert _layout(again) == _layout(first)  # the same names: overwritten, nothing added
    fewer = prepare_on_ray(source, str(dest), shard_mb=1.0, row_group_mb=0.01)
    assert len(fewer.files) < len(first.files)
    on_disk = sorted(p.name for p in dest.glob("*.parquet"))
    assert on_disk == [f.path for f in fewer.files]  # the first run's extra shards are gone
    assert sorted(_ids(dest)) == list(range(ROWS))
    assert json.loads((dest / MANIFEST_NAME).read_text())["fingerprint"] == load(str(dest)).fingerprint


def test_a_file_a_task_cannot_read_is_one_line_naming_it(cluster, source, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    pq.write_table(pa.table({"id": [1, 2]}), broken / "a.parquet")
    (broken / "b.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError) as raised:
        prepare_on_ray(str(broken), str(tmp_path / "out"), shard_mb=0.000001)
    assert "b.parquet" in str(raised.value) and "\n" not in str(raised.value)


def test_a_storage_error_in_a_task_and_shards_this_machine_cannot_see_are_one_line(source, tmp_path):
    from ray.exceptions import RayTaskError

    plan = plan_source(source)
    err = _one_line(RayTaskError("convert_files", "Traceback ...", PermissionError("Access Denied")), plan, [1, 2])
    assert isinstance(err, DatasetError) and "\n" not in str(err)
    assert "events-1.parquet (and 1 more)" in str(err) and "PermissionError: Access Denied" in str(err)
    begin(str(tmp_path / "elsewhere"))  # a node wrote to its own disk: nothing here
    shard = Written(path="part-00000-00000.parquet", bytes=10, row_groups=(5,), schema="s")
    with pytest.raises(DatasetError, match="is not there as this machine sees") as raised:
        commit(str(tmp_path / "elsewhere"), [shard])
    assert "\n" not in str(raised.value) and (tmp_path / "elsewhere" / PREPARING_NAME).exists()


def test_the_cli_converts_on_the_cluster_it_joins(cluster, source, tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_LOG_LEVEL", "WARNING")  # -q sets it for children: gone after this test
    monkeypatch.setattr(logging.getLogger("elastic"), "level", logging.getLogger("elastic").level)
    dest = tmp_path / "cli"
    args = ["-q", "data", "prepare", source, str(dest), "--address", "auto", "--json", "--shard-mb", "0.05"]
    result = CliRunner().invoke(cli_main.cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["rows"] == ROWS and ray.is_initialized()  # the process's connection stays


@pytest.mark.parametrize(
    "args, says",
    [
        (["--address", "auto", "--shuffle-seed", "3"], "--shuffle-seed cannot be combined with --address"),
        (["--address", "127.0.0.1:1"], "cannot reach the Ray cluster at 127.0.0.1:1"),
        (["--address", "http://127.0.0.1:8265"], "is a job API URL"),
    ],
)
def test_refusals_are_one_line_and_exit_2(source, tmp_path, args, says, cli_entry):
    finished = cli_entry("data", "prepare", source, str(tmp_path / "out"), *args)
    code, err = finished.returncode, finished.stderr
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_what_cannot_be_distributed_is_refused_before_connecting(tmp_path):
    for source, says in (("jobs.gen:rows", "a generator runs in this process"), ("d.npz", "a .npy/.npz")):
        with pytest.raises(DatasetError, match=says) as raised:
            check_distributable(source, None)
        assert "without --address" in str(raised.value) and "\n" not in str(raised.value)


def test_the_tasks_get_the_clients_storage_variables_only():
    env = {
        "AWS_ENDPOINT_URL": "http://s3:9000",
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
        "FSSPEC_S3_ENDPOINT_URL": "http://s3:9000",
        "AWS_PROFILE": "laptop",
        "AWS_SHARED_CREDENTIALS_FILE": "/home/me/.aws/credentials",
        "RAY_AUTH_TOKEN": "t",
        "HOME": "/home/me",
    }
    assert storage_env(env) == {
        "AWS_ENDPOINT_URL": "http://s3:9000",
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
        "FSSPEC_S3_ENDPOINT_URL": "http://s3:9000",
    }
