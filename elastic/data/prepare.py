"""`elastic data prepare SRC DEST`: a dataset in a bucket from Parquet, CSV, JSON lines, NumPy (.npy/.npz) or
a Python generator, as Parquet shards of about `shard_mb` with row groups of about `row_group_mb`, optionally
shuffled once globally (`shuffle_seed`), written in parallel, committed by its manifest (elastic.data.manifest).

Safe to re-run: a marker says the dataset is being written (readers refuse it meanwhile), the old manifest goes
first, shards are written under fixed names, shards a previous run left beyond the new count are removed, and
the new manifest is written last. This runs on one machine, reading the source into memory when it shuffles.
"""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from elastic.data.manifest import (
    MANIFEST_NAME,
    PARQUET_SUFFIXES,
    PREPARING_NAME,
    DatasetError,
    Manifest,
    index,
)
from elastic.storage import fsspec_filesystem

_log = logging.getLogger(__name__)

SHARD_NAME = "part-{:05d}.parquet"
FORMATS = {".parquet": "parquet", ".parq": "parquet", ".csv": "csv", ".jsonl": "json", ".json": "json"}


def read_source(source: str) -> pa.Table:
    """The rows of `source`: a file or folder of Parquet/CSV/JSON lines, a .npy/.npz file, or `module:function`
    (a generator of dicts; `path/to/file.py:function` works too)."""
    if ":" in source and "://" not in source and not Path(source).exists():
        return _from_generator(source)
    suffix = Path(source.rstrip("/")).suffix.lower()
    if suffix in (".npy", ".npz"):
        return _from_numpy(source)
    fs, path = fsspec_filesystem(source)
    if not fs.exists(path):
        raise DatasetError(f"{source}: no such file or folder; check the path")
    if fs.isdir(path):
        files = sorted(fs.find(path))
        kinds = {FORMATS.get(Path(f).suffix.lower()) for f in files} - {None}
        if len(kinds) != 1:
            raise DatasetError(
                f"{source}: expected one kind of file ({', '.join(sorted(FORMATS))}), found {sorted(kinds) or 'none'}"
            )
        kind = kinds.pop()
        files = [f for f in files if FORMATS.get(Path(f).suffix.lower()) == kind]
    else:
        kind = FORMATS.get(suffix)
        if kind is None:
            raise DatasetError(f"{source}: unknown kind of file; use Parquet, CSV, JSON lines, .npy/.npz or module:fn")
        files = [path]
    try:
        return pads.dataset(files, format=kind, filesystem=fs).to_table()
    except (pa.ArrowInvalid, OSError) as err:
        raise DatasetError(f"{source}: cannot be read as {kind} ({str(err).splitlines()[0]})") from None


def prepare(
    source: str,
    dest: str,
    shard_mb: float = 128.0,
    row_group_mb: float = 4.0,
    shuffle_seed: int | None = None,
    threads: int = 8,
) -> Manifest:
    table = read_source(source)
    if table.num_rows == 0:
        raise DatasetError(f"{source}: no rows to write")
    if shuffle_seed is not None:
        table = table.take(np.random.default_rng(shuffle_seed).permutation(table.num_rows))
    row_bytes = max(1.0, table.nbytes / table.num_rows)
    group_rows = max(1, int(row_group_mb * 2**20 / row_bytes))
    shard_rows = max(group_rows, int(shard_mb * 2**20 / row_bytes) // group_rows * group_rows)
    shards = math.ceil(table.num_rows / shard_rows)
    root = dest.rstrip("/")
    fs, path = fsspec_filesystem(root)
    fs.makedirs(path, exist_ok=True)
    with fs.open(f"{path}/{PREPARING_NAME}", "w") as handle:
        handle.write("elastic data prepare is writing this dataset\n")
    if fs.exists(f"{path}/{MANIFEST_NAME}"):
        fs.rm(f"{path}/{MANIFEST_NAME}")
    _log.info(f"{root}: {table.num_rows} rows in {shards} shard(s) of <= {shard_rows} rows, row groups of {group_rows}")

    def write(shard: int) -> None:
        part = table.slice(shard * shard_rows, shard_rows)
        with fs.open(f"{path}/{SHARD_NAME.format(shard)}", "wb") as handle:
            pq.write_table(part, handle, row_group_size=group_rows)

    with ThreadPoolExecutor(max_workers=max(1, min(threads, shards))) as pool:
        list(pool.map(write, range(shards)))
    keep = {SHARD_NAME.format(i) for i in range(shards)}
    stale = [p for p in fs.find(path) if p.lower().endswith(PARQUET_SUFFIXES) and p.rsplit("/", 1)[-1] not in keep]
    for leftover in stale:
        fs.rm(leftover)
    fs.rm(f"{path}/{PREPARING_NAME}")
    return index(root)


def _from_numpy(source: str) -> pa.Table:
    try:
        loaded = np.load(source, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise DatasetError(f"{source}: not a readable NumPy file ({err})") from None
    arrays = dict(loaded.items()) if isinstance(loaded, np.lib.npyio.NpzFile) else {"x": loaded}
    lengths = {name: len(a) for name, a in arrays.items()}
    if len(set(lengths.values())) != 1:
        raise DatasetError(f"{source}: arrays of different lengths {lengths}; each array is a column, one per row")
    return pa.table({name: _column(a) for name, a in arrays.items()})


def _column(array: np.ndarray) -> pa.Array:
    if array.ndim == 1:
        return pa.array(array)
    flat = array.reshape(len(array), -1)  # rows of higher rank become fixed-size lists of their values
    return pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])


def _from_generator(target: str, chunk: int = 65536) -> pa.Table:
    module_name, _, function_name = target.rpartition(":")
    try:
        if module_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location("elastic_prepare_source", module_name)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        function = getattr(module, function_name)
    except (ImportError, AttributeError, FileNotFoundError) as err:
        raise DatasetError(
            f"{target}: cannot load the generator ({err}); use module:function or file.py:function"
        ) from None
    batches = [pa.Table.from_pylist(rows) for rows in _chunks(function(), chunk)]
    return pa.concat_tables(batches) if batches else pa.table({})


def _chunks(rows: Iterator[dict], size: int) -> Iterator[list[dict]]:
    batch: list[dict] = []
    for row in rows:
        batch.append(row)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
