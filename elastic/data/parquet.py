"""`ParquetDataset` is a map-style dataset over Parquet shards at any fsspec URI (local, file://, s3://)."""

from __future__ import annotations

import bisect
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem
from torch.utils.data import Dataset

from elastic.storage import fsspec_filesystem

_PARQUET_SUFFIXES = (".parquet", ".parq")
_NUMERIC = (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean)


def _is_numeric(data_type: pa.DataType) -> bool:
    return any(check(data_type) for check in _NUMERIC)


def _is_list(data_type: pa.DataType) -> bool:
    return pa.types.is_list(data_type) or pa.types.is_large_list(data_type) or pa.types.is_fixed_size_list(data_type)


def _column_reader(array: pa.Array) -> Callable[[int], Any]:
    """Row -> value: numpy scalars for numeric columns, numpy arrays for numeric lists, else Python values."""
    if array.null_count == 0 and _is_numeric(array.type):
        values = array.to_numpy(zero_copy_only=False)  # converted once per row group, then O(1) per row
        return values.__getitem__
    if array.null_count == 0 and _is_list(array.type) and _is_numeric(array.type.value_type):
        if array.flatten().null_count == 0:
            return lambda row: array[row].values.to_numpy(zero_copy_only=False)
    return lambda row: array[row].as_py()


def _list_parquet(uri: str) -> list[str]:
    fs, path = fsspec_filesystem(uri)
    local = isinstance(fs, LocalFileSystem)

    def to_uri(found: str) -> str:  # plain paths stay plain; object-store keys get their scheme back
        return found if local else fs.unstrip_protocol(found)

    if any(char in path for char in "*?["):
        found = fs.glob(path)
    elif fs.isdir(path):
        found = [p for p in fs.find(path) if p.lower().endswith(_PARQUET_SUFFIXES)]
    elif fs.isfile(path):
        found = [path]
    else:
        raise FileNotFoundError(f"{uri}: no such file, directory or prefix")
    if not found:
        raise FileNotFoundError(f"{uri}: no Parquet files ({', '.join('*' + s for s in _PARQUET_SUFFIXES)}) found")
    return [to_uri(p) for p in found]


class _ParquetHandle:
    """An fsspec file handle and the pyarrow ParquetFile reading it; closing closes both."""

    def __init__(self, uri: str) -> None:
        fs, path = fsspec_filesystem(uri)
        # No fsspec read-ahead: pyarrow asks for exact byte ranges (footer, then a row group's column chunks,
        # coalesced by pre_buffer), and s3fs's default read-ahead would fetch tens of MB more per read.
        self.handle = fs.open(path, "rb", cache_type="none")
        try:
            self.parquet = pq.ParquetFile(self.handle, pre_buffer=True)
        except BaseException:
            self.handle.close()
            raise

    def close(self) -> None:
        self.parquet.close()
        self.handle.close()


class ParquetDataset(Dataset):
    """Map-style dataset over Parquet shards at any fsspec URI; row i of the concatenated, path-sorted shards.

    `source` is a directory or S3 prefix (every *.parquet / *.parq below it), a glob, one file, or a list of
    files. Files are always sorted by URI so index i names the same row in every process and every run.
    Only footers are read up front; __getitem__ reads the whole row group holding the row and keeps the
    last `cache_row_groups` of them, so sequential-ish access is cheap (a global shuffle over large row
    groups is not: prefer smaller row groups, or shuffle within them, when that matters).
    Items are dicts column -> value (numpy scalar, numpy array for numeric lists, Python value otherwise),
    passed through `transform` when given. Picklable: files are opened lazily in each process.
    """

    def __init__(
        self,
        source: str | Sequence[str],
        columns: Sequence[str] | None = None,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        cache_row_groups: int = 4,
        metadata_threads: int = 16,
    ) -> None:
        uris = _list_parquet(source) if isinstance(source, str) else [str(uri) for uri in source]
        if not uris:
            raise ValueError("ParquetDataset needs at least one file")
        self.files: list[str] = sorted(uris)
        self.columns: list[str] | None = list(columns) if columns is not None else None
        self.transform = transform
        self.cache_row_groups = max(1, cache_row_groups)

        # Footers only, in parallel: startup cost is one small read per shard, not a scan.
        with ThreadPoolExecutor(max_workers=max(1, min(metadata_threads, len(self.files)))) as pool:
            metadata = list(pool.map(self._read_metadata, self.files))
        # One entry per row group, in file order: (file index, row group index) and the first global row.
        self._row_groups: list[tuple[int, int]] = []
        self._starts: list[int] = []
        total = 0
        for file_index, meta in enumerate(metadata):
            for group in range(meta.num_row_groups):
                rows = meta.row_group(group).num_rows
                if rows == 0:
                    continue
                self._row_groups.append((file_index, group))
                self._starts.append(total)
                total += rows
        self.num_rows = total
        self._reset_process_state()

    def _read_metadata(self, uri: str) -> pq.FileMetaData:
        opened = _ParquetHandle(uri)
        try:
            names = set(opened.parquet.schema_arrow.names)
            missing = [c for c in self.columns or () if c not in names]
            if missing:
                raise ValueError(f"{uri}: no column(s) {', '.join(missing)}; it has {', '.join(sorted(names))}")
            return opened.parquet.metadata
        finally:
            opened.close()

    # --- per-process state (open files, decoded row groups), never pickled

    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._open: OrderedDict[int, _ParquetHandle] = OrderedDict()
        self._cache: OrderedDict[int, dict[str, Callable[[int], Any]]] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_pid", "_lock", "_open", "_cache"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_process_state()

    # --- access

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, index: int) -> Any:
        index = int(index)
        if index < 0:
            index += self.num_rows
        if not 0 <= index < self.num_rows:
            raise IndexError(f"row {index} out of range for {self.num_rows} rows")
        group = bisect.bisect_right(self._starts, index) - 1
        readers = self._row_group(group)
        row = index - self._starts[group]
        item = {name: read(row) for name, read in readers.items()}
        return self.transform(item) if self.transform is not None else item

    def _row_group(self, group: int) -> dict[str, Callable[[int], Any]]:
        if self._pid != os.getpid():
            # Forked into a DataLoader worker: the parent's handles (and s3fs sessions) are not ours to use.
            self._reset_process_state()
        with self._lock:
            cached = self._cache.get(group)
            if cached is not None:
                self._cache.move_to_end(group)
                return cached
            file_index, row_group = self._row_groups[group]
            table = self._file(file_index).parquet.read_row_group(row_group, columns=self.columns)
            readers = {name: _column_reader(table.column(name).combine_chunks()) for name in table.column_names}
            self._cache[group] = readers
            if len(self._cache) > self.cache_row_groups:
                self._cache.popitem(last=False)
            return readers

    def _file(self, file_index: int) -> _ParquetHandle:
        opened = self._open.get(file_index)
        if opened is None:
            opened = self._open[file_index] = _ParquetHandle(self.files[file_index])
            if len(self._open) > max(self.cache_row_groups, 8):  # bound open handles when there are many shards
                _, oldest = self._open.popitem(last=False)
                oldest.close()
        else:
            self._open.move_to_end(file_index)
        return opened
