"""Window buffers for block-shuffled batches: the numeric columns of a window's row groups, one array per column.

A shuffled batch (elastic.data.block_order) draws a few rows from every row group of its window: 256 rows from
~64 groups at the default window. Gathered group by group, that is a few numpy calls per group and column
(~1 ms a batch, most of what a shuffled epoch costs over a sequential one); with the window's rows in one
array per column, it is one fancy index per column, two where a batch straddles two windows.

Memory: a row group is copied into its window's arrays once, by the I/O thread that decoded it (or by the
first batch that needs it, if it was decoded under another order), and its decoded columns then point into
them (views), so its rows are held once, as before; a buffer is let go with its window's row groups
(StreamingDataset._prefetch_after) or with its epoch order. The copy, once per row group and off the
training thread, cost 1-2 ms of CPU per MB (fresh pages included) on a loaded 2-core machine; the per-group
gathers it replaces cost more than that, a few numpy calls for each of the ~100 batches reading a group.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from elastic.data.block_order import BlockShuffleOrder


class WindowBuffer:
    """One window's numeric columns, its row groups in sequence order, filled group by group. A column that
    some group cannot give as a numpy array of the same dtype and shape (nulls in that group, a string column)
    is not kept: the reader gathers it group by group, as without a buffer."""

    def __init__(self, starts: np.ndarray):
        self._starts = starts  # starts[k]: the first row of the window's k-th group; starts[-1]: its rows
        self.filled = np.zeros(len(starts) - 1, dtype=bool)
        self.complete = False
        self.names: list[str] | None = None  # every column, in the decoded order (the first fill's)
        self.columns: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def fill(self, slot: int, decoded: dict[str, Any]) -> None:
        """Copy the window's `slot`-th row group (its DecodedColumns) into place; they then hold views of it.
        Called from the I/O threads as groups are decoded, and by a batch for any group still missing."""
        start, stop = int(self._starts[slot]), int(self._starts[slot + 1])
        with self._lock:
            if self.filled[slot]:
                return
            if self.names is None:
                self.names = list(decoded)
                rows = int(self._starts[-1])  # np.empty: pages are taken as groups are copied in, not up front
                self.columns = {
                    name: np.empty((rows, *values.shape[1:]), dtype=values.dtype)
                    for name, column in decoded.items()
                    if (values := column.values) is not None
                }
            columns = self.columns
        unfit = []
        for name, array in columns.items():  # the copies outside the lock: other groups copy in beside it
            column = decoded.get(name)
            values = None if column is None else column.values
            if values is None or values.dtype != array.dtype or values.shape != (stop - start, *array.shape[1:]):
                unfit.append(name)
                continue
            array[start:stop] = values
            column.adopt(array[start:stop])
        with self._lock:
            if unfit:  # a new dict, not changed in place: a batch may be reading the old one
                self.columns = {name: array for name, array in self.columns.items() if name not in unfit}
            self.filled[slot] = True
            self.complete = bool(self.filled.all())


class WindowLayout:
    """Where each row group's rows lie in its window's buffer under one epoch order, and the buffers made."""

    def __init__(self, order: BlockShuffleOrder):
        self.order = order
        sequence_index = np.empty(order.num_groups, dtype=np.int64)
        sequence_index[order.group_sequence] = np.arange(order.num_groups)
        self._sequence_index = sequence_index
        self.window_of_group = np.minimum(sequence_index // order.window, order.windows() - 1)
        # The group's first row, counted from its window's first row (epoch positions, see BlockShuffleOrder).
        self.offset_of_group = order.starts[sequence_index] - order.starts[self.window_of_group * order.window]
        self.buffers: dict[int, WindowBuffer] = {}

    def buffer(self, window: int) -> WindowBuffer:
        """The buffer of `window`, made empty if there is none (the caller holds the reader's lock)."""
        buffer = self.buffers.get(window)
        if buffer is None:
            first, last = self.order.window_bounds(window)
            buffer = self.buffers[window] = WindowBuffer(self.order.starts[first : last + 1] - self.order.starts[first])
        return buffer

    def slot_of(self, group: int) -> int:
        """The index of `group` among its window's groups."""
        return int(self._sequence_index[group]) - int(self.window_of_group[group]) * self.order.window

    def forget_before(self, window: int) -> None:
        """Let go of the buffers of the windows before `window` (the caller holds the reader's lock)."""
        for w in [w for w in self.buffers if w < window]:
            del self.buffers[w]

    def gather(
        self,
        groups: np.ndarray,
        rows: np.ndarray,
        buffers_for: Callable[[list[int]], list[WindowBuffer]],
        row_groups: Callable[[list[int]], list[dict[str, Any]]],
    ) -> tuple[dict[str, np.ndarray], list[str]]:
        """The numeric columns of rows `rows` of groups `groups` (a non-empty batch), from the windows' buffers,
        filled first where the batch needs groups not yet in them; and every column's name, in order (the
        columns not returned are for the caller to gather group by group). `buffers_for(windows)`: their
        buffers, made if needed (it also starts the windows ahead); `row_groups(groups)`: decoded groups."""
        windows = self.window_of_group[groups]
        offsets = self.offset_of_group[groups] + rows
        low, high = int(windows.min()), int(windows.max())
        touched = [low] if low == high else np.unique(windows).tolist()
        buffers = buffers_for(touched)
        masks = [None] if low == high else [windows == w for w in touched]
        for window, buffer, mask in zip(touched, buffers, masks):
            if not buffer.complete:
                self._fill(window, buffer, groups if mask is None else groups[mask], row_groups)
        first = buffers[0].columns
        numeric = [
            name
            for name, array in first.items()
            if all(
                (other := b.columns.get(name)) is not None
                and other.dtype == array.dtype
                and other.shape[1:] == array.shape[1:]
                for b in buffers[1:]
            )
        ]
        gathered: dict[str, np.ndarray] = {}
        for name in numeric:
            if len(buffers) == 1:
                gathered[name] = first[name][offsets]  # a copy (fancy indexing), as DecodedColumn.take gives
                continue
            target = np.empty((len(groups), *first[name].shape[1:]), dtype=first[name].dtype)
            for buffer, mask in zip(buffers, masks):
                target[mask] = buffer.columns[name][offsets[mask]]
            gathered[name] = target
        return gathered, list(buffers[0].names or ())

    def _fill(self, window: int, buffer: WindowBuffer, groups: np.ndarray, row_groups: Callable) -> None:
        """Copy in the groups of `groups` (all in `window`) that `buffer` lacks."""
        first = window * self.order.window
        slots = self._sequence_index[groups] - first
        missing = np.unique(slots[~buffer.filled[slots]])
        if missing.size:
            needed = self.order.group_sequence[first + missing].tolist()
            for slot, decoded in zip(missing.tolist(), row_groups(needed)):
                buffer.fill(slot, decoded)
