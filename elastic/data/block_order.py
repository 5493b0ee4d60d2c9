"""The epoch order of a dataset stored as row groups: a permutation of the row groups, then the rows of each
window of K consecutive (permuted) groups shuffled together. Pure and world-size independent, like the
sampler's order (elastic.data.sampler): position p of an epoch names one (row group, row) whatever the world
size, so the position stays one global number and exactly-once holds across any resize.

Why windows: a row group is the unit a reader fetches and decodes. A full permutation of rows would touch a
different row group for nearly every row; shuffling within a window of K groups needs only those K decoded
at a time (bounded memory, each group fetched once per epoch) while a batch still mixes rows of K groups,
drawn from anywhere in the dataset. `quality` of the order (label entropy of a batch of label-sorted data)
grows with K; the benchmark measures it.

Memory: the permutations are keyed (elastic.data.order), so the state is the row count of each group and
their prefix sums in permuted order: 16 bytes a row group (1.6 MB for 1e5 groups of 1e4 rows = 1e9 rows),
plus the row order of the window being read (8 bytes a row of one window of up to 4M rows, computed when the
window is first asked for), nothing per row of the dataset. Seeking to any position is a binary search.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from elastic.data.order import KeyedPermutation, round_keys


@dataclass(frozen=True)
class RowSpan:
    """Rows `rows` (indices within the group) of row group `group`, in the order they are trained."""

    group: int
    rows: np.ndarray


class BlockShuffleOrder:
    """Position -> (row group, row) for one epoch. `row_counts[g]` is the number of rows of group g."""

    def __init__(self, row_counts, seed: int, epoch: int, window: int, shuffle: bool = True):
        if window < 1:
            raise ValueError(f"shuffle window of {window} row groups: use 1 or more")
        counts = np.asarray(row_counts, dtype=np.int64)
        self.num_groups = len(counts)
        self.window = window
        self.shuffle = shuffle
        self._key = (seed, epoch)
        if shuffle:
            groups = KeyedPermutation(self.num_groups, round_keys(_seed(seed, epoch, -1), "row-groups"))
            self.group_sequence = groups.slice(0, self.num_groups)
        else:
            self.group_sequence = np.arange(self.num_groups, dtype=np.int64)
        # starts[j]: the epoch position of the first row of the j-th group of the sequence.
        self.starts = np.zeros(self.num_groups + 1, dtype=np.int64)
        np.cumsum(counts[self.group_sequence], out=self.starts[1:])
        self.num_rows = int(self.starts[-1])
        # The row permutation of the window read last, computed whole: a batch asks for a few hundred positions
        # of it at a time, and the Feistel rounds over a few hundred values cost numpy's per-call overhead many
        # times over (seen: 1.9 ms a batch, a fifth of a shuffled epoch's time). 8 bytes a row of one window.
        self._window_rows: tuple[int, np.ndarray] | None = None

    @property
    def state_bytes(self) -> int:
        """What this order holds in memory (the benchmark reports it)."""
        cached = self._window_rows[1].nbytes if self._window_rows is not None else 0
        return self.group_sequence.nbytes + self.starts.nbytes + cached

    def windows(self) -> int:
        """Windows of `window` row groups; the remainder joins the last one (a window of a few groups at
        the epoch's end would mix few labels), so the last has between `window` and 2 * `window` - 1."""
        return max(1, self.num_groups // self.window)

    def window_of_sequence_index(self, j: int) -> int:
        """The window of the j-th row group of the sequence."""
        return min(j // self.window, self.windows() - 1)

    def window_of(self, position: int) -> int:
        return self.window_of_sequence_index(int(np.searchsorted(self.starts, position, side="right") - 1))

    def window_bounds(self, window: int) -> tuple[int, int]:
        """Sequence indices first..last-1 of the row groups of `window`."""
        first = window * self.window
        last = self.num_groups if window == self.windows() - 1 else min(first + self.window, self.num_groups)
        return first, last

    def window_groups(self, window: int) -> np.ndarray:
        """The row groups of `window`, in sequence order: what a reader fetches for it."""
        first, last = self.window_bounds(window)
        return self.group_sequence[first:last]

    def rows(self, start: int, stop: int) -> list[RowSpan]:
        """The rows at positions start..stop-1, as runs of one row group each, in training order."""
        groups, rows = self.locate(start, stop)
        cut = np.flatnonzero(np.diff(groups)) + 1  # a shuffled window alternates groups row by row
        return [RowSpan(int(g[0]), r) for g, r in zip(np.split(groups, cut), np.split(rows, cut)) if len(g)]

    def locate(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(row group, row within it) of positions start..stop-1, in training order: two int64 arrays."""
        if not 0 <= start <= stop <= self.num_rows:
            raise IndexError(f"positions {start}..{stop} outside an epoch of {self.num_rows} rows")
        all_groups, all_rows = [], []
        position = start
        while position < stop:
            window = self.window_of(position)
            first, last = self.window_bounds(window)
            window_start, window_stop = int(self.starts[first]), int(self.starts[last])
            end = min(stop, window_stop)
            if self.shuffle and window_stop - window_start <= WINDOW_CACHE_MAX_ROWS:
                offsets = self._window_permutation(window, window_stop - window_start)
                offsets = offsets[position - window_start : end - window_start]
            elif self.shuffle:  # a window of huge row groups: the positions asked for only
                offsets = self._rows_of(window, window_stop - window_start).at(
                    np.arange(position - window_start, end - window_start, dtype=np.int64)
                )
            else:
                offsets = np.arange(position - window_start, end - window_start, dtype=np.int64)
            # Offsets within the window -> (j-th group of the sequence, row within that group).
            local_starts = self.starts[first : last + 1] - window_start
            j = np.searchsorted(local_starts, offsets, side="right") - 1
            all_rows.append(offsets - local_starts[j])
            all_groups.append(self.group_sequence[first + j])
            position = end
        if not all_groups:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        return np.concatenate(all_groups), np.concatenate(all_rows)

    def _rows_of(self, window: int, size: int) -> KeyedPermutation:
        """The keyed permutation of the `size` rows of `window` in this epoch."""
        return KeyedPermutation(size, round_keys(_seed(*self._key, window), "rows"))

    def _window_permutation(self, window: int, size: int) -> np.ndarray:
        """Row offsets within `window` (of `size` rows) in training order: the keyed permutation, whole."""
        cached = self._window_rows
        if cached is not None and cached[0] == window:
            return cached[1]
        perm = self._rows_of(window, size)
        # In chunks: the rounds' temporaries stay a few MB however large the window.
        chunks = [perm.slice(s, min(s + WINDOW_CHUNK_ROWS, size)) for s in range(0, size, WINDOW_CHUNK_ROWS)]
        offsets = np.concatenate(chunks) if chunks else np.empty(0, dtype=np.int64)
        self._window_rows = (window, offsets)
        return offsets


WINDOW_CHUNK_ROWS = 1 << 16
# A window's row order is kept whole up to this many rows (32 MB); a larger one (row groups of millions of rows)
# is computed for the positions asked for, as the order's memory must not grow with the rows of a group.
WINDOW_CACHE_MAX_ROWS = 1 << 22


def _seed(seed: int, epoch: int, window: int) -> int:
    return (seed * 1_000_003 + epoch) * 1_000_033 + window
