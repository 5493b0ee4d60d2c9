"""ParquetDataset over a real S3 endpoint (moto's server over HTTP), and an exactly-once resize resume on it.

Needs no Ray: it starts only `moto_server`, once for the module.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elastic.data import ParquetDataset, ResumableLoader, ResumableSampler

pytestmark = pytest.mark.integration

BUCKET = "elastic-data"
SHARDS = [(5, 17), (8, 40), (16, 23)]  # (row group size, rows) per shard
ROWS = sum(count for _, count in SHARDS)


@pytest.fixture(scope="module")
def s3_data(moto_s3) -> Iterator[str]:
    """The module's S3 endpoint (conftest.moto_s3) with s3://BUCKET/data/part-{0,1,2}.parquet."""
    _write_shards(moto_s3["AWS_ENDPOINT_URL"])
    return f"s3://{BUCKET}/data/"


def _write_shards(endpoint: str) -> None:
    import boto3
    import s3fs

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
    start = 0
    for shard, (group_size, count) in enumerate(SHARDS):
        ids = list(range(start, start + count))
        start += count
        table = pa.table({"id": pa.array(ids, pa.int64()), "text": [f"row-{i}" for i in ids]})
        with fs.open(f"{BUCKET}/data/part-{shard}.parquet", "wb") as out:
            pq.write_table(table, out, row_group_size=group_size)


def test_parquet_dataset_reads_every_row_from_s3(s3_data):
    dataset = ParquetDataset(s3_data)
    assert dataset.files == [f"s3://{BUCKET}/data/part-{i}.parquet" for i in range(3)]
    assert len(dataset) == ROWS
    for i in range(ROWS):
        row = dataset[i]
        assert (int(row["id"]), row["text"]) == (i, f"row-{i}")


def test_resume_from_two_workers_to_one_on_s3_is_exactly_once(s3_data):
    def loaders(world: int) -> list[ResumableLoader]:
        dataset = ParquetDataset(s3_data, columns=["id"])
        return [
            ResumableLoader(dataset, ResumableSampler(len(dataset), 4, rank, world, seed=21), num_workers=2)
            for rank in range(world)
        ]

    seen: list[int] = []
    first = loaders(2)
    iterators = [iter(loader) for loader in first]
    for _ in range(5):  # 5 steps of 2 x 4 rows, then the "preemption"
        for it in iterators:
            seen += [int(i) for i in next(it)["id"]]
    state = first[0].state_dict()
    assert state == first[1].state_dict() and state["consumed"] == 40

    (resumed,) = loaders(1)
    resumed.load_state_dict(state)
    for batch in resumed:
        seen += [int(i) for i in batch["id"]]

    counts = Counter(seen)
    assert sorted(counts) == list(range(ROWS)) and set(counts.values()) == {1}
    assert resumed.state_dict()["epoch"] == 1


def test_a_streamed_epoch_from_s3_survives_fault_windows_and_a_resize_reading_every_row_once(s3_data, monkeypatch):
    """The shards above, written by pyarrow (not `prepare`): indexed from their footers on S3 (sizes and
    ETags), then streamed by StreamingDataset through a fault proxy that answers 503 to a run of GETs and
    resets others mid-epoch; the reads are retried, 2 ranks hand over to 1 mid-epoch, every row comes once."""
    from elastic.data import StreamingDataset, streaming
    from elastic.data.manifest import index
    from elastic.local.s3_faults import running_proxy

    manifest = index(s3_data)
    assert manifest.rows == ROWS and all(f.etag for f in manifest.files)
    monkeypatch.setattr(streaming, "READ_BACKOFF_SECONDS", 0.05)
    with running_proxy(moto_endpoint(), seed=3) as (url, control):
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)

        def loaders(world: int) -> list[ResumableLoader]:
            dataset = StreamingDataset(s3_data, columns=["id"], shuffle_window=2, io_threads=2)
            return [
                ResumableLoader(dataset, ResumableSampler(len(dataset), 4, r, world, seed=5, order_source=dataset))
                for r in range(world)
            ]

        seen: list[int] = []
        first = loaders(2)
        iterators = [iter(loader) for loader in first]
        control.open_window("503", requests=4, match={"methods": ["GET"], "path_contains": "/data/part-"})
        for _ in range(5):
            for it in iterators:
                seen += [int(i) for i in next(it)["id"]]
        control.open_window("reset", requests=2, match={"methods": ["GET"], "path_contains": "/data/part-"})
        (resumed,) = loaders(1)
        resumed.load_state_dict(first[0].state_dict())
        for batch in resumed:
            seen += [int(i) for i in batch["id"]]
        injected = control.stats()
    counts = Counter(seen)
    assert sorted(counts) == list(range(ROWS)) and set(counts.values()) == {1}
    assert sum(injected.get("injected", {}).values()) >= 4, injected


def moto_endpoint() -> str:
    import os

    return os.environ["AWS_ENDPOINT_URL"]
