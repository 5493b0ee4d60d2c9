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
