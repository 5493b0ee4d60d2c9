"""`StreamingDataset`: a dataset in a bucket (sharded Parquet with a manifest, elastic.data.manifest), read
row group by row group in the order elastic.data.block_order gives, with the next window's row groups fetched
ahead in parallel while the current one trains.

Used through `session.loader(dataset, batch_size=B)` like any map-style dataset: the loader's sampler takes
its epoch order from the dataset (`epoch_order`), so positions stay global and exactly-once holds across any
resize, and the sampler's state records the dataset's fingerprint and shuffle window, so a resume on a changed
dataset is refused with one line instead of reading other rows at the saved positions.

Reads happen in the training process (DataLoader num_workers=0 is the intended use: the I/O is on threads of
its own); a decoded row group is kept until its window has been trained, plus the windows prefetched.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset, default_collate

from elastic.data import manifest as manifests
from elastic.data.block_order import BlockShuffleOrder
from elastic.data.cache import RowGroupCache, parse_size
from elastic.data.parquet import _column_reader, _is_numeric
from elastic.data.windows import WindowBuffer, WindowLayout
from elastic.storage import pyarrow_filesystem

_log = logging.getLogger(__name__)

READ_RETRIES = 4  # a row group read that fails with a storage error is tried again this many times ...
READ_BACKOFF_SECONDS = 0.5  # ... after 0.5, 1, 2, 4 s
DEFAULT_SHUFFLE_WINDOW = 64  # row groups shuffled together (label-sorted data: see block_order's quality)
OPEN_FILES = 64  # files whose open handle and footer a process keeps (a handle costs one HEAD to open)


class EpochRows:
    """One epoch's order as the sampler reads it: positions -> global row ids (file order, row group order)."""

    def __init__(self, order: BlockShuffleOrder, group_starts: np.ndarray):
        self.order = order
        self._group_starts = group_starts

    def slice(self, start: int, stop: int) -> np.ndarray:
        groups, rows = self.order.locate(start, stop)
        return self._group_starts[groups] + rows


class DecodedColumn:
    """A decoded column of one row group, converted once: numeric values and fixed-size numeric lists as numpy
    arrays (rows taken by fancy indexing), anything else through pyarrow, row by row."""

    def __init__(self, array: pa.Array):
        self.values: np.ndarray | None = None  # the rows as one numpy array, or None: read through pyarrow
        if array.null_count == 0 and _is_numeric(array.type):
            self.values = array.to_numpy(zero_copy_only=False)
        elif pa.types.is_fixed_size_list(array.type) and _is_numeric(array.type.value_type):
            flat = array.flatten()
            if array.null_count == 0 and flat.null_count == 0:
                width = array.type.list_size
                self.values = flat.to_numpy(zero_copy_only=False).reshape(len(array), width)
        if self.values is None:
            self._read = _column_reader(array)

    def adopt(self, values: np.ndarray) -> None:
        """Hold the rows as `values` (a copy of them in a window buffer) and let the decoded ones go."""
        values.flags.writeable = False
        self.values = values

    def take(self, rows: np.ndarray) -> Sequence[Any]:
        if self.values is not None:
            return self.values[rows]  # a copy (fancy indexing): writable, though the decoded column is not
        return [self._read(int(r)) for r in rows]


class ColumnarRows(Sequence):
    """Rows gathered column by column: row k is {name: column[k]}, as a map-style dataset's rows are, and
    `collate()` gives what torch's default_collate would make of those rows (a tensor per numeric column, a
    list per other column) without building them one by one."""

    def __init__(self, columns: dict[str, Any], length: int):
        self.columns = columns
        self._length = length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(self._length))]
        if not -self._length <= k < self._length:  # an empty batch has no columns to raise it
            raise IndexError(f"row {k} of {self._length}")
        return {name: values[k] for name, values in self.columns.items()}

    def __iter__(self):
        return (self[k] for k in range(self._length))

    def collate(self) -> dict[str, Any]:
        return {
            name: torch.as_tensor(values) if isinstance(values, np.ndarray) else default_collate(values)
            for name, values in self.columns.items()
        }


class StreamingDataset(Dataset):
    """Rows of a dataset in a bucket. `columns` picks columns; `transform(row_dict)` maps each row; the shuffle
    mixes rows of `shuffle_window` row groups; `prefetch` windows are fetched ahead with `io_threads` GETs in
    flight. `verify` checks every file's size and ETag against the manifest up front. `cache_limit` (bytes or
    "20GB") turns on the node-local disk cache of decoded row groups (elastic.data.cache, under
    $ELASTIC_DATA_CACHE): the ranks of a node then fetch each row group once between them."""

    def __init__(
        self,
        uri: str,
        columns: Sequence[str] | None = None,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        shuffle_window: int = DEFAULT_SHUFFLE_WINDOW,
        prefetch: int = 1,
        io_threads: int = 8,
        verify: bool = True,
        cache_limit: int | str | None = None,
    ):
        self.uri = uri.rstrip("/")
        self.manifest = manifests.load(self.uri)
        if verify:
            manifests.verify(self.manifest)
        names = self.manifest.arrow_schema().names
        unknown = [c for c in columns or () if c not in names]
        if unknown:
            raise manifests.DatasetError(f"{self.uri}: no column(s) {', '.join(unknown)}; it has {', '.join(names)}")
        self.columns = list(columns) if columns is not None else None
        self.transform = transform
        self.shuffle_window = shuffle_window
        self.prefetch = max(0, prefetch)
        self.io_threads = max(1, io_threads)
        self.cache_limit = parse_size(cache_limit) if cache_limit is not None else None
        # Row group g (dataset order): its file, its index in the file, and its first global row.
        self._groups = [(f, i) for f, entry in enumerate(self.manifest.files) for i in range(len(entry.row_groups))]
        counts = np.asarray(self.manifest.row_group_rows(), dtype=np.int64)
        self._row_counts = counts
        self._group_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._reset_process_state()

    # --- what the sampler asks (elastic.data.sampler)

    @property
    def source(self) -> str:
        """Identity of the order, kept in the sampler's state: a resume on other data or another window is refused."""
        return f"{self.uri}#{self.manifest.fingerprint}/window={self.shuffle_window}"

    def epoch_order(self, seed: int, epoch: int, shuffle: bool = True) -> EpochRows:
        order = BlockShuffleOrder(self._row_counts, seed, epoch, self.shuffle_window, shuffle=shuffle)
        layout = WindowLayout(order)
        with self._lock:
            self._order, self._layout = order, layout
            self._window_of_group = layout.window_of_group
            self._prefetched_window = -1
        return EpochRows(order, self._group_starts)

    # --- access

    def __len__(self) -> int:
        return self.manifest.rows

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> Sequence[Any]:
        """The rows at `indices`: with a transform, a list of what it returns for each row dict; without one, a
        ColumnarRows (a sequence of row dicts that the loader's default collation turns into tensors a column
        at a time, not a row at a time)."""
        ids = np.asarray(indices, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"row {int(ids.max())} out of range for {len(self)} rows")
        groups = np.searchsorted(self._group_starts, ids, side="right") - 1
        rows = ids - self._group_starts[groups]
        gathered: dict[str, Any] = {}
        if self._pid != os.getpid():  # forked into a DataLoader worker: our own handles, lock and buffers
            self._reset_process_state()
        layout = self._layout
        if layout is not None and layout.order.shuffle and ids.size:
            # A shuffled batch draws from every group of its window: its numeric columns come from the
            # window's buffers (elastic.data.windows), one fancy index per column; the others group by group.
            gathered, names = layout.gather(groups, rows, lambda ws: self._window_buffers(layout, ws), self._row_groups)
            if len(gathered) < len(names):
                self._gather_groups(groups, rows, gathered, skip=set(gathered))
                gathered = {name: gathered[name] for name in names}  # the columns' order, as without buffers
        else:
            self._gather_groups(groups, rows, gathered)
        batch = ColumnarRows(gathered, len(ids))
        if self.transform is None:
            return batch
        return [self.transform(row) for row in batch]

    def _gather_groups(self, groups: np.ndarray, rows: np.ndarray, gathered: dict[str, Any], skip=()) -> None:
        """Columns (but `skip`) of the rows into `gathered`: a take per group and column, the groups under one lock."""
        unique, inverse = np.unique(groups, return_inverse=True)
        by_group = np.argsort(inverse, kind="stable")
        bounds = np.searchsorted(inverse[by_group], np.arange(len(unique) + 1))
        for k, decoded in enumerate(self._row_groups(unique.tolist())):
            where = by_group[bounds[k] : bounds[k + 1]]
            for name, column in decoded.items():
                if name in skip:
                    continue
                values = column.take(rows[where])
                if name not in gathered:
                    gathered[name] = (
                        np.empty((len(groups), *values.shape[1:]), dtype=values.dtype)
                        if isinstance(values, np.ndarray)
                        else [None] * len(groups)
                    )
                target = gathered[name]
                if isinstance(target, np.ndarray):
                    target[where] = values
                else:
                    for slot, value in zip(where.tolist(), values):
                        target[slot] = value

    # --- row groups: fetched once, ahead of need

    def _window_buffers(self, layout: WindowLayout, windows: list[int]) -> list[WindowBuffer]:
        """The buffers of `windows` (made if needed), the windows after the last started ahead."""
        with self._lock:
            if layout is self._layout and windows[-1] > self._prefetched_window:
                self._prefetch_after(windows[-1])
                self._prefetched_window = windows[-1]
            return [layout.buffer(w) for w in windows]

    def _row_groups(self, groups: list[int]) -> list[dict[str, DecodedColumn]]:
        """Row groups `groups`, decoded (fetched now if no prefetch asked for them yet), in that order."""
        pending = []
        with self._lock:
            for group in groups:
                load = self._loads.get(group)
                if load is None:
                    load = self._loads[group] = self._pool.submit(self._read, group)
                self._loads.move_to_end(group)
                pending.append(load)
                if self._order is None:  # no epoch order asked for (plain indexing): keep the last few row groups
                    while len(self._loads) > 2 * self.shuffle_window:
                        self._loads.popitem(last=False)
                elif (window := int(self._window_of_group[group])) > self._prefetched_window:
                    # Once a window, not once a row group: a batch touches every row group of its window.
                    self._prefetch_after(window)
                    self._prefetched_window = window
        return [load.result() for load in pending]

    def _prefetch_after(self, window: int) -> None:
        """Under the lock: start fetching the rest of `window` and the windows after it, and forget the row
        groups of windows before the previous one (a batch may straddle two windows). The rest of `window` too:
        a batch draws from every row group of its window, so asked for one by one they would arrive one
        after the other (seen: the first window took most of a short epoch, its groups fetched serially)."""
        for w in range(window, min(window + 1 + self.prefetch, self._order.windows())):
            for g in self._order.window_groups(w).tolist():
                if g not in self._loads:
                    self._loads[g] = self._pool.submit(self._read, g)
        for g in [g for g in self._loads if self._window_of_group[g] < window - 1]:
            del self._loads[g]
        self._layout.forget_before(window - 1)  # their buffers with them

    def _read(self, group: int) -> dict[str, DecodedColumn]:
        """Row group `group`, decoded; a transient storage error (a 503, a reset connection) is retried with
        backoff, a missing or changed file is one line naming it."""
        file_index, row_group = self._groups[group]
        entry = self.manifest.files[file_index]
        for attempt in range(READ_RETRIES + 1):
            try:
                decoded = self._fetch(file_index, row_group)
            except FileNotFoundError:
                raise manifests.DatasetError(
                    f"{self.uri}: {entry.path} is missing; restore it or rebuild the manifest with "
                    f"`elastic data index {self.uri}`"
                ) from None
            except OSError as err:
                if attempt == READ_RETRIES:
                    raise
                delay = READ_BACKOFF_SECONDS * 2**attempt
                _log.warning(f"reading {entry.path} row group {row_group} failed ({err}); retrying in {delay:g} s")
                time.sleep(delay)
                continue
            self._buffer_group(group, decoded)
            return decoded
        raise AssertionError("unreachable")

    def _buffer_group(self, group: int, decoded: dict[str, DecodedColumn]) -> None:
        """Copy a decoded group into its window's buffer here, on the I/O thread, not on the training loop's
        (a shuffled order's windows from the one read on: not an old window a row was asked of once)."""
        layout = self._layout
        if layout is not None and layout.order.shuffle:
            window = int(layout.window_of_group[group])
            with self._lock:
                wanted = layout is self._layout and window >= self._prefetched_window - 1
                buffer = layout.buffer(window) if wanted else None
            if buffer is not None:
                buffer.fill(layout.slot_of(group), decoded)

    def _fetch(self, file_index: int, row_group: int) -> dict[str, DecodedColumn]:
        entry = self.manifest.files[file_index]
        if self._cache is None:
            table = self._fetch_table(entry, row_group)
        else:
            key = f"{file_index}-{row_group}-{'.'.join(self.columns or ['all'])}"
            table = self._cache.get(key, lambda: self._fetch_table(entry, row_group))
        return {name: DecodedColumn(table.column(name).combine_chunks()) for name in table.column_names}

    def _fetch_table(self, entry: manifests.FileEntry, row_group: int) -> pa.Table:
        # Through pyarrow's own filesystem (for S3 its C++ client): the GETs and the decoding run outside the
        # interpreter lock, beside the training loop (s3fs's event loop and its Python-side reads took turns
        # with the loop and each other: a one-process shuffled epoch took 3.8-5.6 s with it, 2.5 s with this).
        # Exact ranges: the row group's column chunks (pre_buffer coalesces them into few GETs); each file's
        # handle and footer are opened and read once per process, not once a row group: on an object store each
        # request costs more than a row group's bytes take to arrive.
        handle, footer = self._open(entry)
        parquet = pq.ParquetFile(handle, pre_buffer=True, metadata=footer)
        table = parquet.read_row_group(row_group, columns=self.columns)
        metadata = footer.row_group(row_group)
        chunk_bytes = sum(metadata.column(i).total_compressed_size for i in range(metadata.num_columns))
        with self._lock:
            self.bytes_fetched += chunk_bytes  # the row group's column chunks (footers not counted)
        if table.num_rows != entry.row_groups[row_group]:
            raise self._changed(entry)
        return table

    def _open(self, entry: manifests.FileEntry) -> tuple[pa.NativeFile, pq.FileMetaData]:
        """The file's random-access handle and footer, kept for the OPEN_FILES files used last. A handle is
        shared by the I/O threads (Arrow's ReadAt is thread-safe; each read is its own ranged GET), and one
        dropped from here is closed when the last read using it lets go of it."""
        with self._lock:
            opened = self._files.get(entry.path)
            if opened is not None:
                self._files.move_to_end(entry.path)
                return opened
            if self._filesystem is None:
                self._filesystem, self._root = pyarrow_filesystem(self.uri)
        handle = self._filesystem.open_input_file(f"{self._root}/{entry.path}")  # one HEAD: the file's size
        if handle.size() != entry.bytes:
            raise self._changed(entry)
        opened = (handle, pq.read_metadata(handle))
        with self._lock:
            self._files[entry.path] = opened
            while len(self._files) > OPEN_FILES:
                self._files.popitem(last=False)
        return opened

    def _changed(self, entry: manifests.FileEntry) -> manifests.DatasetError:
        return manifests.DatasetError(
            f"{self.uri}: {entry.path} changed since the manifest was written; rebuild it with "
            f"`elastic data index {self.uri}`"
        )

    # --- per-process state, never pickled

    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self.bytes_fetched = 0  # column-chunk bytes read from storage by this process (the benchmark's measure)
        self._cache = (
            RowGroupCache(self.manifest.fingerprint, self.cache_limit) if self.cache_limit is not None else None
        )
        self._pool = ThreadPoolExecutor(max_workers=self.io_threads, thread_name_prefix="elastic-data")
        self._loads: OrderedDict[int, Future] = OrderedDict()
        self._filesystem = None  # pyarrow's, opened on first read in each process
        self._root = ""
        self._files: OrderedDict[str, tuple[pa.NativeFile, pq.FileMetaData]] = OrderedDict()
        self._order: BlockShuffleOrder | None = None
        self._layout: WindowLayout | None = None  # the order's window buffers (shuffled orders only)
        self._window_of_group = np.empty(0, dtype=np.int64)  # the epoch order's window of each row group
        self._prefetched_window = -1  # the windows after this one are being fetched

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in (
            "_pid",
            "_lock",
            "_pool",
            "_loads",
            "_order",
            "_layout",
            "_window_of_group",
            "_prefetched_window",
            "bytes_fetched",
            "_cache",
            "_filesystem",
            "_files",
        ):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_process_state()
