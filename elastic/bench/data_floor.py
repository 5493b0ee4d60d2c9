"""The floors of `elastic bench data`: the least work any reader of these rows must do on this machine.

`fetch_decode`: each row group's column chunks fetched with exact range GETs and decoded into numpy arrays,
`threads` row groups at a time, footers read beforehand (untimed), and nothing else: no epoch order, no node
cache, no sampler or loader, no collation. It is the same fetch and decode the streaming reader does
(elastic.data.streaming), so a reader at 1.0 of it spends nothing on top; what separates it from raw GETs is
the decoding, which on a small machine competes for the same cores as the S3 server that serves the bytes.

`beside`: runs a function while `fetch_decode` of given row groups runs in a thread beside it: the training
loop fed from memory, slowed only by the bytes it would need crossing the same cores (the training floor).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import pyarrow.parquet as pq

from elastic.data.manifest import Manifest
from elastic.data.streaming import DecodedColumn
from elastic.storage import fsspec_filesystem

T = TypeVar("T")


def row_groups(manifest: Manifest) -> list[tuple[int, int]]:
    """(file index, row group) of every row group, in manifest order (the global row group numbering)."""
    return [(f, g) for f, entry in enumerate(manifest.files) for g in range(len(entry.row_groups))]


def groups_of_rows(manifest: Manifest, rows: np.ndarray) -> list[tuple[int, int]]:
    """The row groups holding the given global row indices, each once."""
    starts = np.cumsum([0, *manifest.row_group_rows()])
    numbers = np.unique(np.searchsorted(starts, np.asarray(rows), side="right") - 1)
    everything = row_groups(manifest)
    return [everything[int(n)] for n in numbers]


def fetch_decode(
    uri: str, manifest: Manifest, groups: list[tuple[int, int]], columns: list[str], threads: int = 8
) -> dict:
    """Seconds to fetch and decode `groups` (columns `columns`), the column-chunk bytes fetched and the rows."""
    fs, root = fsspec_filesystem(uri)
    footers = {}
    for file_index in sorted({f for f, _ in groups}):
        entry = manifest.files[file_index]
        with fs.open(f"{root}/{entry.path}", "rb", size=entry.bytes) as handle:
            footers[file_index] = pq.read_metadata(handle)

    def one(group: tuple[int, int]) -> tuple[int, int]:
        file_index, row_group = group
        entry = manifest.files[file_index]
        with fs.open(f"{root}/{entry.path}", "rb", cache_type="none", size=entry.bytes) as handle:
            parquet = pq.ParquetFile(handle, pre_buffer=True, metadata=footers[file_index])
            table = parquet.read_row_group(row_group, columns=columns)
        for column in table.columns:
            DecodedColumn(column.combine_chunks())  # what the reader makes of each column, and no more
        meta = footers[file_index].row_group(row_group)
        fetched = sum(meta.column(i).total_compressed_size for i in range(meta.num_columns))
        return fetched, table.num_rows

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        done = list(pool.map(one, groups))
    return {
        "seconds": time.perf_counter() - started,
        "fetched": sum(f for f, _ in done),
        "rows": sum(r for _, r in done),
    }


def beside(work: Callable[[], T], uri: str, manifest: Manifest, groups, columns: list[str]) -> tuple[T, dict]:
    """`work()`'s result while fetch_decode of `groups` runs in a thread beside it, and fetch_decode's figures."""
    floor: dict = {}
    reader = threading.Thread(target=lambda: floor.update(fetch_decode(uri, manifest, groups, columns)))
    reader.start()
    try:
        result = work()
    finally:
        reader.join()
    return result, floor
