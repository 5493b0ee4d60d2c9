"""Unit tests for datasets in buckets on a local folder: `prepare` from every source kind, `index` of Parquet
written by others, the manifest's checks (missing, changed, mixed schemas, empty, half-written), and
StreamingDataset through the session's sampler and loader: every row once per epoch at any world size and
across a resize mid-epoch, and a resume on changed data refused."""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elastic.data import ResumableLoader, ResumableSampler, StreamingDataset
from elastic.data.manifest import MANIFEST_NAME, PREPARING_NAME, DatasetError, index, load, verify
from elastic.data.prepare import prepare

ROWS = 3000


@pytest.fixture
def source(tmp_path):
    """3000 rows, stored sorted by label (the hardest order for a block shuffle)."""
    path = tmp_path / "digits.npz"
    rng = np.random.default_rng(0)
    np.savez(
        path, x=rng.random((ROWS, 16), dtype=np.float32), y=np.repeat(np.arange(10), ROWS // 10), i=np.arange(ROWS)
    )
    return path


@pytest.fixture
def dataset_dir(source, tmp_path):
    dest = tmp_path / "dataset"
    prepare(str(source), str(dest), shard_mb=0.05, row_group_mb=0.005)
    return dest


def test_prepare_writes_shards_row_groups_and_a_manifest_last(dataset_dir):
    manifest = load(str(dataset_dir))
    assert manifest.rows == ROWS and len(manifest.files) > 1 and manifest.num_row_groups > len(manifest.files)
    assert manifest.summary()["columns"] == {"x": "fixed_size_list<element: float>[16]", "y": "int64", "i": "int64"}
    written = json.loads((dataset_dir / MANIFEST_NAME).read_text())
    assert written["rows"] == ROWS and written["fingerprint"] == manifest.fingerprint
    assert not (dataset_dir / PREPARING_NAME).exists()
    assert pq.read_table(dataset_dir).column("i").to_pylist() == list(range(ROWS))  # in the source's order


def test_a_rerun_replaces_the_dataset_and_removes_shards_it_no_longer_has(source, dataset_dir):
    before = sorted(p.name for p in dataset_dir.glob("*.parquet"))
    manifest = prepare(str(source), str(dataset_dir), shard_mb=1.0, row_group_mb=0.005, shuffle_seed=3)
    assert sorted(p.name for p in dataset_dir.glob("*.parquet")) == ["part-00000.parquet"] != before
    ids = pq.read_table(dataset_dir).column("i").to_pylist()
    assert sorted(ids) == list(range(ROWS)) and ids != list(range(ROWS))  # shuffled once, globally
    assert load(str(dataset_dir)).fingerprint == manifest.fingerprint


def test_every_source_kind_prepares(tmp_path):
    rows = [{"text": f"row {i}", "n": i} for i in range(50)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rows.csv").write_text("text,n\n" + "".join(f"{r['text']},{r['n']}\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    np.save(tmp_path / "rows.npy", np.arange(50))
    (tmp_path / "gen.py").write_text(
        "def rows():\n    for i in range(50):\n        yield {'text': f'row {i}', 'n': i}\n"
    )
    for src in ("rows.jsonl", "rows.csv", "rows.parquet", "rows.npy", "gen.py:rows"):
        manifest = prepare(str(tmp_path / src), str(tmp_path / f"out-{src.replace(':', '-')}"))
        assert manifest.rows == 50, src


def test_parquet_written_by_others_is_indexed_from_its_footers(tmp_path):
    folder = tmp_path / "foreign"
    folder.mkdir()
    for part in range(3):
        table = pa.table({"a": np.arange(part * 100, part * 100 + 100), "b": np.ones(100)})
        pq.write_table(table, folder / f"part-{part}.parquet", row_group_size=30)
    manifest = load(str(folder))  # no manifest yet: built once, on first use
    assert manifest.rows == 300 and manifest.row_group_rows() == [30, 30, 30, 10] * 3
    assert (folder / MANIFEST_NAME).exists()
    dataset = StreamingDataset(str(folder))
    assert [dataset[i]["a"] for i in (0, 150, 299)] == [0, 150, 299]


def test_bad_datasets_are_one_line_naming_the_problem_and_the_fix(tmp_path, dataset_dir):
    with pytest.raises(DatasetError, match="no such dataset"):
        load(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no Parquet files"):
        index(str(tmp_path / "empty"))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    pq.write_table(pa.table({"a": [1]}), mixed / "1.parquet")
    pq.write_table(pa.table({"b": ["x"]}), mixed / "2.parquet")
    with pytest.raises(DatasetError, match=r"2.parquet has columns \(b: string\) but 1.parquet has \(a: int64\)"):
        index(str(mixed))
    with pytest.raises(DatasetError, match="no column"):
        StreamingDataset(str(dataset_dir), columns=["nope"])
    manifest = load(str(dataset_dir))
    shard = dataset_dir / manifest.files[1].path
    stamp = shard.stat().st_mtime + 5
    os.utime(shard, (stamp, stamp))  # rewritten since the manifest (same size, new ETag/mtime)
    with pytest.raises(DatasetError, match=f"{manifest.files[1].path} changed since the manifest"):
        verify(manifest)
    shard.unlink()
    with pytest.raises(DatasetError, match=f"{manifest.files[1].path} is missing"):
        StreamingDataset(str(dataset_dir))
    (dataset_dir / PREPARING_NAME).write_text("")
    with pytest.raises(DatasetError, match="being written by `elastic data prepare`"):
        load(str(dataset_dir))


def _epoch(dataset, world, batch=64, seed=0, states=None, steps=None):
    """Run `steps` global steps (or the epoch) with `world` ranks; return the rows seen and rank 0's state."""
    samplers = [ResumableSampler(len(dataset), batch, r, world, seed=seed, order_source=dataset) for r in range(world)]
    loaders = [ResumableLoader(dataset, s) for s in samplers]
    if states is not None:
        for loader in loaders:
            loader.load_state_dict(states)
    seen = []
    iterators = [iter(loader) for loader in loaders]
    taken = 0
    while steps is None or taken < steps:
        try:
            batches = [next(it) for it in iterators]
        except StopIteration:
            break
        seen += [int(i) for b in batches for i in b["i"]]
        taken += 1
    return seen, loaders[0].state_dict()


@pytest.mark.parametrize("world", [1, 3])
def test_an_epoch_reads_every_row_once_at_any_world_size(dataset_dir, world):
    dataset = StreamingDataset(str(dataset_dir), shuffle_window=4)
    seen, state = _epoch(dataset, world)
    assert sorted(seen) == list(range(ROWS))
    assert state["epoch"] == 1 and state["source"] == dataset.source


def test_a_resize_mid_epoch_keeps_every_row_exactly_once(dataset_dir):
    dataset = StreamingDataset(str(dataset_dir), shuffle_window=4)
    first, state = _epoch(dataset, 2, steps=7)
    rest, end = _epoch(StreamingDataset(str(dataset_dir), shuffle_window=4), 3, states=state)
    counts = Counter(first + rest)
    assert sorted(counts) == list(range(ROWS)) and set(counts.values()) == {1}
    assert end["epoch"] == 1
    # The same order, whatever the world size: 2 ranks for 7 steps then 3 = 1 rank all the way.
    whole, _ = _epoch(StreamingDataset(str(dataset_dir), shuffle_window=4), 1, batch=1)
    assert sorted(first) == sorted(whole[: len(first)])


def test_a_resume_on_changed_data_or_another_window_is_refused(source, dataset_dir, tmp_path):
    dataset = StreamingDataset(str(dataset_dir), shuffle_window=4)
    _, state = _epoch(dataset, 2, steps=3)
    with pytest.raises(ValueError, match="the data changed since the checkpoint"):
        _epoch(StreamingDataset(str(dataset_dir), shuffle_window=8), 2, states=state)
    time.sleep(0.01)
    prepare(str(source), str(dataset_dir), shard_mb=0.05, row_group_mb=0.005, shuffle_seed=1)
    with pytest.raises(ValueError, match="the data changed since the checkpoint"):
        _epoch(StreamingDataset(str(dataset_dir), shuffle_window=4), 2, states=state)


def test_a_window_is_fetched_whole_the_next_one_ahead_and_windows_behind_are_let_go(dataset_dir):
    dataset = StreamingDataset(str(dataset_dir), shuffle_window=2, prefetch=1)
    order = dataset.epoch_order(0, 0)
    first = order.slice(0, 10)
    dataset.__getitems__(first.tolist())
    ahead = set(order.order.window_groups(1).tolist())
    assert ahead <= set(dataset._loads)  # window 1's row groups are being fetched while window 0 trains
    late = order.order.starts[4 * 2]  # a position in window 4
    dataset.__getitems__(order.slice(int(late), int(late) + 1).tolist())
    windows = {int(dataset._window_of_group[g]) for g in dataset._loads}
    assert min(windows) >= 3  # windows 0-2 are let go
    # One row of window 4 asked for: all of window 4 is fetched at once (a batch draws from every row group of
    # its window; asked one by one, they would arrive one after the other), and window 5 is on its way.
    assert set(order.order.window_groups(4).tolist()) <= set(dataset._loads)
    assert set(order.order.window_groups(5).tolist()) <= set(dataset._loads)


def test_a_transient_storage_error_is_retried_and_a_missing_shard_is_one_line(dataset_dir, monkeypatch):
    from elastic.data import streaming

    monkeypatch.setattr(streaming, "READ_BACKOFF_SECONDS", 0.0)
    dataset = StreamingDataset(str(dataset_dir), shuffle_window=4)
    real, failures = dataset._fetch, []

    def flaky(file_index, row_group):
        if len(failures) < 2:
            failures.append(row_group)
            raise OSError("503 SlowDown")  # what a fault window of the S3 proxy returns
        return real(file_index, row_group)

    monkeypatch.setattr(dataset, "_fetch", flaky)
    assert int(dataset[5]["i"]) == 5 and len(failures) == 2
    (dataset_dir / dataset.manifest.files[-1].path).unlink()
    fresh = StreamingDataset(str(dataset_dir), shuffle_window=4, verify=False)
    with pytest.raises(DatasetError, match="is missing; restore it or rebuild the manifest"):
        fresh[ROWS - 1]

    # A shard rewritten with other rows after the manifest (its size differs) is refused when it is opened,
    # rather than read as if it were the file the manifest describes.
    other = dataset_dir / fresh.manifest.files[0].path
    pq.write_table(pa.table({"x": [[0.0] * 16], "y": [0], "i": [0]}), other)
    with pytest.raises(DatasetError, match=f"{fresh.manifest.files[0].path} changed since the manifest was written"):
        fresh[0]


def test_the_ranks_of_a_node_fetch_each_row_group_once_through_the_disk_cache(dataset_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_DATA_CACHE", str(tmp_path / "cache"))
    ranks = [StreamingDataset(str(dataset_dir), shuffle_window=4, cache_limit="1GB") for _ in range(2)]
    seen = []
    for rank, dataset in enumerate(ranks):
        sampler = ResumableSampler(len(dataset), 64, rank, 2, order_source=dataset)
        for batch in ResumableLoader(dataset, sampler):
            seen += [int(i) for i in batch["i"]]
    assert sorted(seen) == list(range(ROWS))
    groups = load(str(dataset_dir)).num_row_groups
    assert ranks[0]._cache.misses == groups and ranks[1]._cache.misses == 0  # rank 1 read rank 0's files
    assert ranks[1]._cache.hits == groups and ranks[1].bytes_fetched == 0
    # A limit smaller than the data keeps the cache within it (least recently used out first).
    small = StreamingDataset(str(dataset_dir), shuffle_window=4, cache_limit=20_000)
    small.__getitems__(list(range(0, ROWS, 7)))
    held = sum(p.stat().st_size for p in small._cache.folder.glob("*.arrow"))
    assert 0 < held <= 20_000 + max(p.stat().st_size for p in small._cache.folder.glob("*.arrow"))


def test_a_batch_is_collated_column_by_column_into_what_default_collate_makes_of_its_rows(tmp_path):
    """Numeric, fixed-size list, string and nullable columns, a batch straddling row groups: the columnar
    batch gives the same tensors and lists as torch's default_collate over the row dicts; a transform still
    sees one row dict at a time."""
    import torch
    from torch.utils.data import default_collate

    table = pa.table(
        {
            "i": np.arange(200, dtype=np.int64),
            "x": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(800, dtype=np.float32)), 4),
            "name": [f"row-{k}" for k in range(200)],
            "maybe": [float(k) if k % 7 else None for k in range(200)],
        }
    )
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=50)
    index(str(tmp_path))
    dataset = StreamingDataset(str(tmp_path), columns=["i", "x", "name"])
    picks = [3, 170, 55, 4, 199, 120]  # four row groups, out of order
    batch = dataset.__getitems__(picks)
    columnar = ResumableLoader(dataset, ResumableSampler(200, 6, 0, 1))._dataloader.collate_fn(batch)
    by_rows = default_collate([dict(row) for row in batch])
    assert set(columnar) == {"i", "x", "name"}
    assert torch.equal(columnar["i"], by_rows["i"]) and columnar["i"].tolist() == picks
    assert torch.equal(columnar["x"], by_rows["x"]) and columnar["x"].dtype == torch.float32
    assert columnar["x"][1].tolist() == [680.0, 681.0, 682.0, 683.0]
    assert columnar["name"] == by_rows["name"] == [f"row-{k}" for k in picks]
    nullable = StreamingDataset(str(tmp_path), columns=["maybe"]).__getitems__([6, 7, 8])
    assert [row["maybe"] for row in nullable] == [6.0, None, 8.0]
    shaped = StreamingDataset(str(tmp_path), columns=["i"], transform=lambda row: int(row["i"]) * 2)
    assert shaped.__getitems__(picks) == [2 * k for k in picks] and shaped[5] == 10


def test_an_empty_batch_is_empty_with_or_without_a_transform(dataset_dir):
    """A rank's empty tail batch (possible at some world sizes): no rows, not endless empty row dicts (a
    transform was handed {} and failed with KeyError in charlm's verify-resume)."""
    assert list(StreamingDataset(str(dataset_dir)).__getitems__([])) == []
    assert StreamingDataset(str(dataset_dir), transform=lambda row: row["x"]).__getitems__([]) == []
    rows = StreamingDataset(str(dataset_dir)).__getitems__([0, 1])
    assert [int(row["i"]) for row in rows] == [0, 1] and rows[-1]["i"] == 1
    with pytest.raises(IndexError):
        rows[2]


def _same_column(got, want):
    assert type(got) is type(want)
    if isinstance(want, np.ndarray):
        # equal_nan: a null among a float column's numeric row groups is a NaN, with or without buffers
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want, equal_nan=True)
    else:
        assert got == want


def test_a_shuffled_batch_comes_from_window_buffers_exactly_as_plain_indexing_gives_it(tmp_path):
    """A shuffled order's batches gather numeric columns from their windows' buffers (elastic.data.windows):
    the same values, dtypes and column order as plain indexing, within a window, straddling two, and with
    columns a buffer cannot hold (strings; nulls in one row group) gathered group by group beside them."""
    n = 400
    table = pa.table(
        {
            "i": np.arange(n, dtype=np.int64),
            "x": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(4 * n, dtype=np.float32)), 4),
            "name": [f"row-{k}" for k in range(n)],
            "maybe": [None if k == 130 else float(k) for k in range(n)],  # nulls in one row group only
        }
    )
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=25)
    index(str(tmp_path))
    plain = StreamingDataset(str(tmp_path), shuffle_window=3)
    shuffled = StreamingDataset(str(tmp_path), shuffle_window=3)
    rows = shuffled.epoch_order(0, 0)
    boundary = int(rows.order.starts[3])  # the first position of window 1
    for start, stop in [(0, 40), (boundary - 20, boundary + 20), (150, 151), (0, n)]:
        ids = rows.slice(start, stop).tolist()
        got, want = shuffled.__getitems__(ids), plain.__getitems__(ids)
        assert list(got.columns) == list(want.columns) == ["i", "x", "name", "maybe"]
        assert got.columns["i"].tolist() == ids
        for name in want.columns:
            _same_column(got.columns[name], want.columns[name])
    buffers = shuffled._layout.buffers
    assert buffers and all(
        set(b.columns) <= {"i", "x", "maybe"} and {"i", "x"} <= set(b.columns) for b in buffers.values()
    )
    assert "maybe" not in buffers[int(shuffled._window_of_group[5])].columns  # row group 5 holds the null
    sequential = StreamingDataset(str(tmp_path), shuffle_window=3)
    sequential.epoch_order(0, 0, shuffle=False)
    _same_column(
        sequential.__getitems__(list(range(20, 60))).columns["x"], plain.__getitems__(list(range(20, 60))).columns["x"]
    )
    assert sequential._layout.buffers == {}  # a sequential batch reads one or two groups: no buffers


def test_a_window_buffer_holds_its_row_groups_rows_once_and_goes_with_them(dataset_dir):
    dataset = StreamingDataset(str(dataset_dir), shuffle_window=2, prefetch=1)
    rows = dataset.epoch_order(0, 0)
    dataset.__getitems__(rows.slice(0, 60).tolist())
    buffer = dataset._layout.buffers[0]
    assert buffer.complete and set(buffer.columns) == {"x", "y", "i"}
    for group in rows.order.window_groups(0).tolist():
        assert dataset._loads[group].result()["x"].values.base is buffer.columns["x"]  # a view, not a copy
    late = int(rows.order.starts[4 * 2])  # a position in window 4
    dataset.__getitems__(rows.slice(late, late + 1).tolist())
    assert min(dataset._layout.buffers) >= 3  # windows 0-2's buffers are let go with their row groups
