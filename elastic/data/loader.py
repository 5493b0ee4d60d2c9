"""Exactly-once, seeded, resumable data loading that survives a change of worker count.

The "global stream" model: every epoch has one global order of sample indices (a permutation of
range(N) seeded by (seed, epoch), independent of the world size). Each training step consumes the next
W*B positions of that order, rank r taking the contiguous slice [consumed + r*B, consumed + (r+1)*B).
The whole position is therefore one global number, `consumed`, identical on every rank: rank 0 saves it
and any world size restores it, continuing the same order from the same position, so each sample is seen
exactly once per epoch across any number of resizes. A final partial global batch is split as evenly as
possible (sizes differ by at most one, so a rank may get an empty batch) instead of dropped or padded.

`ResumableLoader` counts a step when it hands the batch to the caller, never when DataLoader workers
prefetch it, so its `state_dict()` always matches what training has actually received.

Randomness stays exact across a resume. Creating an iterator never draws from the global torch generator
(PyTorch's DataLoader draws its workers' base seed from it; ours comes from the loader's own generator, seeded
by the position). In DataLoader worker processes (num_workers > 0), python's, numpy's and torch's generators
are seeded from (seed, epoch, sample index) before each sample is fetched, so a random augmentation of sample
i in epoch e is the same in an uninterrupted run, after any resume, at any worker count and any num_workers.
With num_workers=0 the dataset draws from the training process's own streams, which the session checkpoints.
`ParquetDataset` is a map-style dataset over Parquet shards at any fsspec URI (local, file://, s3://).
"""

from __future__ import annotations

import bisect
import hashlib
import os
import random
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from fsspec.implementations.local import LocalFileSystem
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from elastic.storage import fsspec_filesystem

__all__ = ["ParquetDataset", "ResumableLoader", "ResumableSampler", "epoch_order", "sample_seed", "seed_sample"]

_STATE_KEYS = ("epoch", "consumed", "seed", "num_samples", "shuffle")


# ---------------------------------------------------------------------------------------------------------
# The global order and how one step of it is split across ranks (pure functions)


def _stable_seed(purpose: str, *parts: int) -> int:
    # A stable hash (not Python's hash()) so every process, host and Python version agrees on it.
    text = f"elastic.{purpose}:" + ":".join(map(str, parts))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & ((1 << 63) - 1)


def _epoch_seed(seed: int, epoch: int) -> int:
    return _stable_seed("data", seed, epoch)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample `index`'s random draws (augmentation) in `epoch`: the same in every process and run."""
    return _stable_seed("sample", seed, epoch, index)


def seed_sample(seed: int, epoch: int, index: int) -> None:
    """Seed python's, numpy's and torch's (CPU) global generators for one sample's draws."""
    value = sample_seed(seed, epoch, index)
    random.seed(value)
    np.random.seed(value & 0xFFFFFFFF)
    # Not torch.manual_seed: that also seeds every CUDA device (and costs ~100 us); workers draw on the CPU.
    torch.default_generator.manual_seed(value)


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The global order of sample indices for one epoch; it does not depend on the world size."""
    if not shuffle:
        return torch.arange(num_samples)
    generator = torch.Generator().manual_seed(_epoch_seed(seed, epoch))
    return torch.randperm(num_samples, generator=generator)


def _step_span(
    consumed: int, total: int, world: int, batch: int, rank: int, drop_last: bool
) -> tuple[int, int, int] | None:
    """(start, stop, step_size) of `rank`'s positions in the next global step, or None at the epoch's end.

    step_size is how many positions the whole step consumes (the same on every rank).
    """
    left = total - consumed
    full = world * batch
    if left >= full:
        start = consumed + rank * batch
        return start, start + batch, full
    if left <= 0 or drop_last:
        return None
    # The partial tail: contiguous chunks in rank order whose sizes differ by at most one.
    base, extra = divmod(left, world)
    start = consumed + rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0), left


def _position_seed(seed: int, epoch: int, consumed: int) -> int:
    return _stable_seed("loader", seed, epoch, consumed)


def _steps_left(consumed: int, total: int, world: int, batch: int, drop_last: bool) -> int:
    left = max(total - consumed, 0)
    full, tail = divmod(left, world * batch)
    return full + (1 if tail and not drop_last else 0)


# ---------------------------------------------------------------------------------------------------------
# Sampler


class ResumableSampler(Sampler[list[int]]):
    """A batch sampler over the global stream: yields this rank's list of indices per step.

    Iterating it directly advances the position as each batch is yielded. Do not hand it to a plain
    DataLoader (which prefetches ahead of training and would over-count); use `ResumableLoader`, which
    reads `pending()` and advances only when the caller receives a batch.

    Every rank takes the same number of steps per epoch. With drop_last=False (the default) the last
    step may give a rank fewer than batch_size samples, or none when fewer than world_size are left: the
    training loop must tolerate an empty batch (e.g. make its loss contribute zero). drop_last=True drops
    a final partial global batch instead, so those samples are not seen that epoch (not exactly-once).
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.consumed = 0  # positions of this epoch's global order consumed by all ranks together
        self._order_cache: tuple[int, torch.Tensor] | None = None

    # --- state

    def state_dict(self) -> dict[str, Any]:
        """The global position; identical on every rank, so rank 0's copy is the one to checkpoint."""
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a position saved at any world size; the dataset, seed and shuffle must be the same."""
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"sampler state is missing {', '.join(missing)}; was it saved by ResumableSampler?")
        for key in ("num_samples", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state mismatch: {key} is {state[key]!r} in the checkpoint but {getattr(self, key)!r} "
                    f"here; resume with the same dataset and data settings, or start a fresh run"
                )
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        if epoch < 0 or not 0 <= consumed <= self.num_samples:
            raise ValueError(
                f"sampler state is out of range: epoch={epoch}, consumed={consumed} (num_samples={self.num_samples})"
            )
        self.epoch, self.consumed = epoch, consumed

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of `epoch`; a no-op when already in it, so a restored mid-epoch position
        survives the usual `set_epoch(e)` at the top of each epoch."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    @property
    def position(self) -> tuple[int, int]:
        return self.epoch, self.consumed

    # --- iteration

    def __len__(self) -> int:
        """Steps (batches, possibly empty) left for this rank in the current epoch; the same on every rank."""
        return _steps_left(self.consumed, self.num_samples, self.world_size, self.batch_size, self.drop_last)

    def pending(self) -> Iterator[list[int]]:
        """This rank's remaining batches of the current epoch, from the position at the time of the call;
        iterating it does not move the position."""
        return self._batches_from(self.epoch, self.consumed)

    def _batches_from(self, epoch: int, consumed: int) -> Iterator[list[int]]:
        while True:
            span = _step_span(consumed, self.num_samples, self.world_size, self.batch_size, self.rank, self.drop_last)
            if span is None:
                return
            start, stop, size = span
            yield self._indices(epoch, start, stop)
            consumed += size

    def __iter__(self) -> Iterator[list[int]]:
        position = self.position
        for batch in self.pending():
            position = self.advance(position)
            yield batch
        self.finish_epoch()

    def advance(self, expected: tuple[int, int]) -> tuple[int, int]:
        """Count one global step as received; roll over to the next epoch when this one is done.

        `expected` is the position the caller believes it is at; a mismatch means the state was changed
        (load_state_dict/set_epoch) under a running iteration, which would silently skip or repeat data.
        """
        if self.position != expected:
            raise RuntimeError(
                f"sampler position changed during iteration (expected {expected}, found {self.position}); "
                f"start a new iteration after load_state_dict or set_epoch"
            )
        span = _step_span(self.consumed, self.num_samples, self.world_size, self.batch_size, 0, self.drop_last)
        if span is None:
            raise RuntimeError(f"no step left in epoch {self.epoch} to advance over")
        self.consumed += span[2]
        self.finish_epoch()
        return self.position

    def batch_at(self, position: tuple[int, int]) -> list[int]:
        """This rank's indices for the step at `position` (epoch, consumed); empty past the epoch's end."""
        epoch, consumed = position
        span = _step_span(consumed, self.num_samples, self.world_size, self.batch_size, self.rank, self.drop_last)
        return [] if span is None else self._indices(epoch, span[0], span[1])

    def finish_epoch(self) -> None:
        """Roll over to {epoch + 1, consumed 0} if the current epoch has no step left."""
        if len(self) == 0:
            self.epoch, self.consumed = self.epoch + 1, 0

    def _indices(self, epoch: int, start: int, stop: int) -> list[int]:
        if not self.shuffle:
            return list(range(start, stop))
        if self._order_cache is None or self._order_cache[0] != epoch:
            self._order_cache = (epoch, epoch_order(self.num_samples, self.seed, epoch, shuffle=True))
        return self._order_cache[1][start:stop].tolist()


# ---------------------------------------------------------------------------------------------------------
# Loader


class _PendingBatches(Sampler[list]):
    """What the DataLoader iterates: the sampler's pending batches, read-only (prefetching moves nothing).

    With `keyed`, each index comes as (epoch, index), for `_SeededSamples` in the DataLoader's workers."""

    def __init__(self, sampler: ResumableSampler, keyed: bool = False) -> None:
        self.sampler = sampler
        self.keyed = keyed

    def __iter__(self) -> Iterator[list]:
        if not self.keyed:
            return self.sampler.pending()
        epoch = self.sampler.epoch
        return ([(epoch, index) for index in batch] for batch in self.sampler.pending())

    def __len__(self) -> int:
        return len(self.sampler)


def _empty_like(batch: Any) -> Any:
    """A zero-length batch with the same structure (tensors/arrays sliced to [:0], leaf lists emptied)."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return batch[:0]
    if isinstance(batch, Mapping):
        return type(batch)({key: _empty_like(value) for key, value in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, (list, tuple)):
        if any(isinstance(item, (torch.Tensor, np.ndarray, Mapping, list, tuple)) for item in batch):
            items = [_empty_like(item) for item in batch]
            return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
        return type(batch)()  # a batch of plain values (e.g. strings): its empty version
    return batch


class _SeededSamples(Dataset):
    """The dataset as DataLoader workers fetch it: (epoch, index) -> dataset[index], drawn after seeding the
    worker's generators from (seed, epoch, index). A worker's own stream (seeded once per iterator by PyTorch)
    would depend on which worker got which batch, and that changes when a run resumes mid-epoch."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        seed_sample(self.seed, epoch, index)
        return self.dataset[index]


class _Collate:
    """collate_fn that also turns an empty index list into a structured zero-length batch.

    Picklable, so it runs in DataLoader workers; the empty batch is built from dataset[0]'s structure so a
    rank left without samples in the epoch's last step can still run its forward pass (and DDP collectives).
    """

    def __init__(self, dataset: Dataset, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn

    def __call__(self, samples: list[Any]) -> Any:
        if samples:
            return self.collate_fn(samples)
        return _empty_like(self.collate_fn([self.dataset[0]]))


class ResumableLoader:
    """A torch DataLoader over a map-style dataset and a ResumableSampler whose position moves only when
    the caller receives a batch.

    `for batch in loader` yields the rest of the current epoch (then the state is {epoch + 1, consumed 0});
    `for epoch, batch in loader.epochs(num_epochs)` runs every remaining epoch below num_epochs, starting
    mid-epoch after a restore. `state_dict()` is global: save rank 0's copy, load it at any world size.
    Extra keyword arguments (pin_memory, prefetch_factor, persistent_workers, ...) go to the DataLoader.
    """

    def __init__(
        self,
        dataset: Dataset,
        sampler: ResumableSampler,
        *,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        observer: Callable[[int, list[int]], None] | None = None,
        **dataloader_kwargs: Any,
    ) -> None:
        size = len(dataset)  # type: ignore[arg-type]
        if size != sampler.num_samples:
            raise ValueError(f"the dataset has {size} samples but the sampler was built for {sampler.num_samples}")
        if dataloader_kwargs.get("in_order", True) is not True:
            # Out-of-order delivery would make "k batches received" differ from "the first k steps".
            raise ValueError("ResumableLoader needs in_order=True")
        if "generator" in dataloader_kwargs:
            raise ValueError("ResumableLoader owns its generator (seeded by its position); drop generator=")
        self.dataset = dataset
        self.sampler = sampler
        self._observer = observer  # told (epoch, indices) of every batch handed out: the audit ledger
        # Seeded from the position before each iterator is made: creating one never touches the global stream.
        self._generator = torch.Generator()
        workers = num_workers > 0
        self._dataloader = DataLoader(
            _SeededSamples(dataset, sampler.seed) if workers else dataset,
            batch_sampler=_PendingBatches(sampler, keyed=workers),
            num_workers=num_workers,
            collate_fn=_Collate(dataset, collate_fn or default_collate),
            generator=self._generator,
            **dataloader_kwargs,
        )

    @property
    def epoch(self) -> int:
        """The epoch of the next batch."""
        return self.sampler.epoch

    def __len__(self) -> int:
        """Batches left for this rank in the current epoch."""
        return len(self.sampler)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        position = self.sampler.position
        if len(self.sampler) == 0:  # nothing left (e.g. restored at an epoch's end): just roll over
            self.sampler.finish_epoch()
            return
        # The DataLoader snapshots the position here and may prefetch far ahead; we count on delivery.
        self._generator.manual_seed(_position_seed(self.sampler.seed, *position))
        for batch in self._dataloader:
            if self._observer is not None:
                self._observer(position[0], self.sampler.batch_at(position))
            position = self.sampler.advance(position)
            yield batch

    def epochs(self, num_epochs: int) -> Iterator[tuple[int, Any]]:
        """(epoch, batch) for the rest of the current epoch and every further epoch below num_epochs."""
        while self.sampler.epoch < num_epochs:
            epoch = self.sampler.epoch
            for batch in self:
                yield epoch, batch
            if self.sampler.epoch == epoch:  # only possible if the state was changed under us
                raise RuntimeError(f"epoch {epoch} did not finish; was the loader's state changed mid-epoch?")


# ---------------------------------------------------------------------------------------------------------
# Parquet


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
