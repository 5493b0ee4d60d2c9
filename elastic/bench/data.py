"""`elastic bench data`: reading a dataset from a bucket, ours and the floors side by side in one run.

Streamed: StreamingDataset through the session's sampler and loader (the path a job takes), one process per
simulated rank in turn, in storage order (`sequential`) and in the block-shuffled order (`shuffled`); the
floor: the same files fetched whole with parallel GETs (`raw_get_mb_per_s`) and scanned by pyarrow. Read
amplification: column-chunk bytes fetched by all ranks over the bytes of the rows they trained. Quality: how
well the order mixes a label-sorted store of the same layout. Training (elastic.bench.data_training): a small
DDP loop fed from the bucket over the same loop fed from memory.

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

from elastic.bench import data_floor
from elastic.bench.data_peers import bench_peers
from elastic.bench.data_training import bench_training
from elastic.data import ResumableLoader, ResumableSampler, StreamingDataset
from elastic.data.block_order import BlockShuffleOrder
from elastic.data.cache import CACHE_DIR_VARIABLE
from elastic.data.manifest import DatasetError, load
from elastic.data.prepare import prepare
from elastic.data.streaming import DEFAULT_SHUFFLE_WINDOW
from elastic.environment import overridden
from elastic.storage import fsspec_filesystem, pyarrow_filesystem

_log = logging.getLogger(__name__)

MB = 1024 * 1024
READ_COLUMNS = ["id", "payload"]  # what the ranks read (the generated set also has a label)


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


def bench_data(
    uri: str, ranks: int = 2, batch_size: int = 256, shuffle_window: int = DEFAULT_SHUFFLE_WINDOW, peers: bool = True
) -> dict:
    """The ranks are taken to share one node: with the node cache (a fresh one, in a temp dir) they fetch
    each row group once between them; `read_amplification_uncached` is each rank fetching its own."""
    manifest = load(uri)
    dataset_bytes = manifest.bytes
    sequential = _stream(uri, ranks, batch_size, shuffle_window, shuffle=False)
    uncached = _stream(uri, ranks, batch_size, shuffle_window, shuffle=True)
    with tempfile.TemporaryDirectory() as cache:
        shuffled = _stream(uri, ranks, batch_size, shuffle_window, shuffle=True, cache=cache)
    raw_seconds = _raw_get_seconds(uri, [f.path for f in manifest.files])
    range_seconds, range_bytes = _raw_range_get_seconds(uri, [f.path for f in manifest.files], READ_COLUMNS)
    floor = data_floor.fetch_decode(uri, manifest, data_floor.row_groups(manifest), READ_COLUMNS)
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
        # The floor of a reader that shuffles row groups: one GET a row group for the same column-chunk bytes
        # (whole-file GETs are not an option for it), as many in flight as the reader has (io_threads).
        "raw_range_get_mb_per_s": round(range_bytes / MB / range_seconds, 1),
        "shuffled_vs_range_get": round(range_seconds / shuffled["seconds"], 3),  # the same rows' bytes, rows/s
        # The floor of any reader of these rows here (elastic.bench.data_floor): those ranges fetched and decoded
        # into arrays, nothing else. Raw over it is what decoding costs on cores the S3 server shares.
        "fetch_decode_mb_per_s": round(dataset_bytes / MB / floor["seconds"], 1),
        "shuffled_vs_fetch_decode": round(floor["seconds"] / shuffled["seconds"], 3),
        "shuffled_vs_sequential": round(sequential["seconds"] / shuffled["seconds"], 3),
        "shuffled_uncached_rows_per_s": round(manifest.rows / uncached["seconds"]),
        "read_amplification": round(shuffled["fetched"] / dataset_bytes, 3),
        "read_amplification_uncached": round(uncached["fetched"] / dataset_bytes, 3),
        "rows_each_once": shuffled["exactly_once"] and sequential["exactly_once"] and uncached["exactly_once"],
        **order_quality(manifest.row_group_rows(), shuffle_window, batch_size * ranks),
        **bench_training(uri, ranks=ranks, batch_size=batch_size),
        # Ray Data and MosaicML Streaming over the same rows (elastic.bench.data_peers); --no-peers skips them.
        "peers": bench_peers(uri, batch_size, manifest.rows / (shuffled["seconds"] * ranks), shuffle_window)
        if peers
        else {"skipped": "--no-peers"},
    }


def order_quality(
    row_counts, window: int, global_batch: int, classes: int = 10, batches: int = 400, seed: int = 0
) -> dict:
    """How well the block shuffle mixes the hardest store: every row group's rows labelled in storage order
    with `classes` labels, sorted (so a row group holds one or two labels). The label entropy of each global
    batch of the epoch order, over that of batches drawn from a full random permutation of the same labels:
    `quality` is the mean's ratio, `quality_worst` the lowest batch's (up to `batches` batches, spread over
    the epoch)."""
    counts = np.asarray(row_counts, dtype=np.int64)
    rows = int(counts.sum())
    label_of = np.minimum(np.arange(rows, dtype=np.int64) * classes // max(rows, 1), classes - 1)
    group_starts = np.concatenate([[0], np.cumsum(counts)])
    order = BlockShuffleOrder(counts, seed=seed, epoch=0, window=window)
    total = rows // global_batch
    picks = np.unique(np.linspace(0, total - 1, num=min(batches, total)).astype(np.int64))
    ours = []
    for b in picks.tolist():
        groups, within = order.locate(b * global_batch, (b + 1) * global_batch)
        ours.append(_entropy(label_of[group_starts[groups] + within], classes))
    rng = np.random.default_rng(seed)
    random = [_entropy(rng.choice(label_of, size=global_batch, replace=False), classes) for _ in range(len(picks))]
    reference = float(np.mean(random))
    return {
        "quality": round(float(np.mean(ours)) / reference, 3),
        "quality_worst": round(float(np.min(ours)) / reference, 3) + 0.0,  # + 0.0: never "-0.0"
        "quality_window": window,
        "quality_batches": len(picks),
    }


def _entropy(labels: np.ndarray, classes: int) -> float:
    p = np.bincount(labels, minlength=classes) / max(len(labels), 1)
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def _stream(uri: str, ranks: int, batch_size: int, window: int, shuffle: bool, cache: str | None = None) -> dict:
    """An epoch read by `ranks` ranks (one after the other, each with its own dataset, as separate processes
    would): seconds summed over ranks (what one process per rank would take in parallel, times the ranks)."""
    seconds, fetched, seen = 0.0, 0, []
    with overridden({CACHE_DIR_VARIABLE: cache} if cache is not None else {}):
        for rank in range(ranks):
            dataset = StreamingDataset(
                uri,
                columns=READ_COLUMNS,
                shuffle_window=window,
                verify=False,
                cache_limit="64GB" if cache is not None else None,
            )
            sampler = ResumableSampler(len(dataset), batch_size, rank, ranks, shuffle=shuffle, order_source=dataset)
            loader = ResumableLoader(dataset, sampler)  # default collation, as a job's loader has
            started = time.perf_counter()
            for batch in loader:
                seen.append(batch["id"].numpy())
            seconds += time.perf_counter() - started
            fetched += dataset.bytes_fetched
    ids = np.concatenate(seen) if seen else np.empty(0)
    return {
        "seconds": seconds / ranks,  # ranks read in parallel on a cluster: the time of one rank
        "fetched": fetched,
        "exactly_once": len(ids) == len(np.unique(ids)) == load(uri).rows,
    }


def _raw_range_get_seconds(uri: str, paths: list[str], columns: list[str], threads: int = 8) -> tuple[float, int]:
    """Seconds to GET every row group's column chunks of `columns` (one range a row group, footers read
    beforehand, untimed), `threads` at a time; and the bytes."""
    fs, root = fsspec_filesystem(uri)
    ranges = []
    for path in paths:
        with fs.open(f"{root}/{path}", "rb") as handle:
            meta = pq.read_metadata(handle)
        wanted = [i for i in range(meta.num_columns) if meta.schema.column(i).path.split(".")[0] in columns]
        for g in range(meta.num_row_groups):
            chunks = [meta.row_group(g).column(i) for i in wanted]
            starts = [c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset for c in chunks]
            end = max(s + c.total_compressed_size for s, c in zip(starts, chunks))
            ranges.append((f"{root}/{path}", min(starts), end))
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        fetched = sum(pool.map(lambda r: len(fs.cat_file(r[0], start=r[1], end=r[2])), ranges))
    return time.perf_counter() - started, fetched


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
