"""`elastic bench data`: reading a dataset from a bucket, ours and the floors side by side in one run.

Streamed: StreamingDataset through the session's sampler and loader (the path a job takes), one process per
simulated rank in turn, in storage order (`sequential`) and in the block-shuffled order (`shuffled`); the
floor: the same files fetched whole with parallel GETs (`raw_get_mb_per_s`) and scanned by pyarrow. Read
amplification: column-chunk bytes fetched by all ranks over the bytes of the rows they trained.

Synthetic (`synthetic_rows`): the order alone, on a manifest of that many rows and no data: the memory the
epoch order holds and the time to a first batch at the start and deep into an epoch, beside the sampler's
former `torch.randperm` order (measured at a size this machine holds; it grows linearly).
"""

from __future__ import annotations

import logging
import tempfile
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import torch

from elastic.data import ResumableLoader, ResumableSampler, StreamingDataset
from elastic.data.block_order import BlockShuffleOrder
from elastic.data.cache import CACHE_DIR_VARIABLE
from elastic.data.manifest import DatasetError, load
from elastic.data.prepare import prepare
from elastic.environment import overridden
from elastic.storage import fsspec_filesystem, pyarrow_filesystem

_log = logging.getLogger(__name__)

MB = 1024 * 1024


def generated_dataset(uri: str, rows: int, row_bytes: int, row_group_mb: float) -> str:
    """A dataset of `rows` rows of ~`row_bytes` (an id, a label, a float payload) at `uri`, written once."""
    try:
        manifest = load(uri, build=False)
        if manifest.rows == rows:
            return uri
    except DatasetError:
        pass
    width = max(1, (row_bytes - 16) // 4)
    rng = np.random.default_rng(0)
    table = pa.table(
        {
            "id": np.arange(rows, dtype=np.int64),
            "label": rng.integers(0, 10, rows),
            "payload": pa.FixedSizeListArray.from_arrays(pa.array(rng.random(rows * width, dtype=np.float32)), width),
        }
    )
    with tempfile.TemporaryDirectory() as folder:
        source = f"{folder}/rows.parquet"
        pq.write_table(table, source)
        prepare(source, uri, shard_mb=32, row_group_mb=row_group_mb)
    return uri


def bench_data(uri: str, ranks: int = 2, batch_size: int = 256, shuffle_window: int = 16) -> dict:
    """The ranks are taken to share one node: with the node cache (a fresh one, in a temp dir) they fetch
    each row group once between them; `read_amplification_uncached` is each rank fetching its own."""
    manifest = load(uri)
    dataset_bytes = manifest.bytes
    sequential = _stream(uri, ranks, batch_size, shuffle_window, shuffle=False)
    uncached = _stream(uri, ranks, batch_size, shuffle_window, shuffle=True)
    with tempfile.TemporaryDirectory() as cache:
        shuffled = _stream(uri, ranks, batch_size, shuffle_window, shuffle=True, cache=cache)
    raw_seconds = _raw_get_seconds(uri, [f.path for f in manifest.files])
    started = time.perf_counter()
    arrow_fs, root = pyarrow_filesystem(uri)
    scanned = pads.dataset(root, format="parquet", filesystem=arrow_fs).to_table()  # skips _elastic_* files
    scan_seconds = time.perf_counter() - started
    raw_mb_s = dataset_bytes / MB / raw_seconds
    shuffled_mb_s = dataset_bytes / MB / shuffled["seconds"]
    return {
        "uri": uri,
        "rows": manifest.rows,
        "row_groups": manifest.num_row_groups,
        "dataset_mb": round(dataset_bytes / MB, 1),
        "ranks": ranks,
        "shuffle_window": shuffle_window,
        "sequential_rows_per_s": round(manifest.rows / sequential["seconds"]),
        "shuffled_rows_per_s": round(manifest.rows / shuffled["seconds"]),
        "pyarrow_scan_rows_per_s": round(scanned.num_rows / scan_seconds),
        "raw_get_mb_per_s": round(raw_mb_s, 1),
        "shuffled_mb_per_s": round(shuffled_mb_s, 1),
        "shuffled_vs_raw": round(shuffled_mb_s / raw_mb_s, 3),
        "shuffled_vs_sequential": round(sequential["seconds"] / shuffled["seconds"], 3),
        "shuffled_uncached_rows_per_s": round(manifest.rows / uncached["seconds"]),
        "read_amplification": round(shuffled["fetched"] / dataset_bytes, 3),
        "read_amplification_uncached": round(uncached["fetched"] / dataset_bytes, 3),
        "rows_each_once": shuffled["exactly_once"] and sequential["exactly_once"] and uncached["exactly_once"],
    }


def _stream(uri: str, ranks: int, batch_size: int, window: int, shuffle: bool, cache: str | None = None) -> dict:
    """An epoch read by `ranks` ranks (one after the other, each with its own dataset, as separate processes
    would): seconds summed over ranks (what one process per rank would take in parallel, times the ranks)."""
    seconds, fetched, seen = 0.0, 0, []
    with overridden({CACHE_DIR_VARIABLE: cache} if cache is not None else {}):
        for rank in range(ranks):
            dataset = StreamingDataset(
                uri,
                columns=["id", "payload"],
                shuffle_window=window,
                verify=False,
                cache_limit="64GB" if cache is not None else None,
            )
            sampler = ResumableSampler(len(dataset), batch_size, rank, ranks, shuffle=shuffle, order_source=dataset)
            loader = ResumableLoader(dataset, sampler, collate_fn=_ids)
            started = time.perf_counter()
            for ids in loader:
                seen.append(ids)
            seconds += time.perf_counter() - started
            fetched += dataset.bytes_fetched
    ids = np.concatenate(seen) if seen else np.empty(0)
    return {
        "seconds": seconds / ranks,  # ranks read in parallel on a cluster: the time of one rank
        "fetched": fetched,
        "exactly_once": len(ids) == len(np.unique(ids)) == load(uri).rows,
    }


def _ids(rows: list[dict]) -> np.ndarray:
    return np.fromiter((row["id"] for row in rows), dtype=np.int64, count=len(rows))


def _raw_get_seconds(uri: str, paths: list[str], threads: int = 8) -> float:
    fs, root = fsspec_filesystem(uri)
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(lambda path: fs.cat_file(f"{root}/{path}"), paths))
    return time.perf_counter() - started


def bench_order(rows: int, row_groups: int, batch_size: int = 512, ranks: int = 2, baseline_rows: int = 10**7) -> dict:
    """The epoch order alone at `rows` rows: its memory and the time to a first global batch, fresh and at a
    resume 70% into the epoch; beside torch.randperm at `baseline_rows` (it grows linearly with rows)."""
    counts = np.full(row_groups, rows // row_groups, dtype=np.int64)
    counts[: rows - int(counts.sum())] += 1
    figures = {}
    for name, position in (("first_batch_seconds", 0), ("resume_first_batch_seconds", int(rows * 0.7))):
        tracemalloc.start()
        started = time.perf_counter()
        order = BlockShuffleOrder(counts, seed=0, epoch=0, window=16)
        spans = order.rows(position, position + batch_size * ranks)
        figures[name] = round(time.perf_counter() - started, 4)
        figures[name.replace("seconds", "peak_bytes")] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        if sum(len(s.rows) for s in spans) != batch_size * ranks:
            raise RuntimeError(f"the order gave {sum(len(s.rows) for s in spans)} rows for one global batch")
    tracemalloc.start()
    started = time.perf_counter()
    torch.randperm(baseline_rows, generator=torch.Generator().manual_seed(0))
    randperm_seconds = time.perf_counter() - started
    tracemalloc.stop()
    return {
        "synthetic_rows": rows,
        "row_groups": row_groups,
        "order_state_bytes": order.state_bytes,
        **figures,
        "randperm_rows": baseline_rows,
        "randperm_seconds": round(randperm_seconds, 3),
        "randperm_bytes": baseline_rows * 8,  # int64 indices: what torch.randperm holds
        "randperm_seconds_at_synthetic_rows": round(randperm_seconds * rows / baseline_rows, 1),
        "randperm_bytes_at_synthetic_rows": rows * 8,
    }
