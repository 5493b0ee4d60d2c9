"""The global sample order and the resumable sampler over it: exactly-once, seeded, resumable data loading
that survives a change of worker count (pure position arithmetic, no I/O).

The "global stream" model: every epoch has one global order of sample indices (a permutation of
range(N) seeded by (seed, epoch), independent of the world size). Each training step consumes the next
W*B positions of that order, rank r taking the contiguous slice [consumed + r*B, consumed + (r+1)*B).
The whole position is therefore one global number, `consumed`, identical on every rank: rank 0 saves it
and any world size restores it, continuing the same order from the same position, so each sample is seen
exactly once per epoch across any number of resizes. A final partial global batch is split as evenly as
possible (sizes differ by at most one, so a rank may get an empty batch) instead of dropped or padded.

The shuffled order is a keyed permutation (elastic.data.order: O(1) memory, any position computed on its own),
order version 2. Version 1, `torch.randperm` (O(N) memory and time at every epoch start and restart), is kept
for positions saved by earlier releases: a checkpoint without an order version resumes in the order it began.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from elastic.data.order import KeyedPermutation, round_keys

_STATE_KEYS = ("epoch", "consumed", "seed", "num_samples", "shuffle")
ORDER_VERSION = 2  # 1: torch.randperm (checkpoints of earlier releases); 2: a keyed permutation
ORDER_VERSIONS = (1, 2)


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


def epoch_order(
    num_samples: int, seed: int, epoch: int, shuffle: bool = True, version: int = ORDER_VERSION
) -> torch.Tensor:
    """The global order of sample indices for one epoch, whole; it does not depend on the world size. (The
    sampler computes only the slices it needs: see epoch_permutation.)"""
    if not shuffle:
        return torch.arange(num_samples)
    if version == 1:
        generator = torch.Generator().manual_seed(_epoch_seed(seed, epoch))
        return torch.randperm(num_samples, generator=generator)
    return torch.from_numpy(epoch_permutation(num_samples, seed, epoch).slice(0, num_samples))


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> KeyedPermutation:
    """Order version 2 of one epoch: position -> sample index, computed per position in O(1) memory."""
    return KeyedPermutation(num_samples, round_keys(_epoch_seed(seed, epoch), "sampler"))


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
        order_source: Any = None,
    ) -> None:
        """`order_source`, when given, is a dataset that owns its epoch order (StreamingDataset): its
        `epoch_order(seed, epoch, shuffle)` replaces the sampler's own permutation and its `source` (the data's
        fingerprint and shuffle window) is kept in the state, so a resume on other data is refused."""
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
        self.order = ORDER_VERSION  # how the shuffled order is computed; a restored position keeps its own
        self._order_source = order_source
        self._order_cache: tuple[int, Any] | None = None

    # --- state

    def state_dict(self) -> dict[str, Any]:
        """The global position; identical on every rank, so rank 0's copy is the one to checkpoint."""
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
            "order": self.order,
            **({"source": self._order_source.source} if self._order_source is not None else {}),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a position saved at any world size; the dataset, seed and shuffle must be the same."""
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"sampler state is missing {', '.join(missing)}; was it saved by ResumableSampler?")
        mine = self._order_source.source if self._order_source is not None else None
        if state.get("source") != mine:
            raise ValueError(
                f"the data changed since the checkpoint: it was read from {state.get('source') or 'an in-memory dataset'}"
                f", now from {mine or 'an in-memory dataset'}; resume on the same data (and shuffle window), or "
                "start a fresh run"
            )
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
        order = int(state.get("order", 1))  # saved before order versions existed: torch.randperm's
        if order not in ORDER_VERSIONS:
            raise ValueError(f"sampler state has order version {order}; this elastic knows {ORDER_VERSIONS}")
        self.epoch, self.consumed, self.order = epoch, consumed, order
        self._order_cache = None

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
        if self._order_source is not None:
            if self._order_cache is None or self._order_cache[0] != epoch:
                self._order_cache = (epoch, self._order_source.epoch_order(self.seed, epoch, self.shuffle))
            return self._order_cache[1].slice(start, stop).tolist()
        if not self.shuffle:
            return list(range(start, stop))
        if self._order_cache is None or self._order_cache[0] != epoch:
            if self.order == 1:
                order = epoch_order(self.num_samples, self.seed, epoch, shuffle=True, version=1)
            else:
                order = epoch_permutation(self.num_samples, self.seed, epoch)
            self._order_cache = (epoch, order)
        order = self._order_cache[1]
        if isinstance(order, KeyedPermutation):
            return order.slice(start, stop).tolist()
        return order[start:stop].tolist()
