"""The resumable loader: a torch DataLoader over a ResumableSampler whose position moves only when training
receives a batch.

`ResumableLoader` counts a step when it hands the batch to the caller, never when DataLoader workers
prefetch it, so its `state_dict()` always matches what training has actually received.

Randomness stays exact across a resume. Creating an iterator never draws from the global torch generator
(PyTorch's DataLoader draws its workers' base seed from it; ours comes from the loader's own generator, seeded
by the position). In DataLoader worker processes (num_workers > 0), python's, numpy's and torch's generators
are seeded from (seed, epoch, sample index) before each sample is fetched, so a random augmentation of sample
i in epoch e is the same in an uninterrupted run, after any resume, at any worker count and any num_workers.
With num_workers=0 the dataset draws from the training process's own streams, which the session checkpoints.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from elastic.data.sampler import ResumableSampler, _position_seed, seed_sample


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
            if self.collate_fn is default_collate and callable(getattr(samples, "collate", None)):
                return samples.collate()  # a columnar batch (StreamingDataset): the same tensors, column-wise
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
        self.wait_seconds = 0.0  # time the caller spent waiting for batches, since take_wait_seconds()
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
        batches = iter(self._dataloader)
        while True:
            started = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            # What the loop waits for data: reads, decoding, collation, or workers behind (input-bound runs).
            self.wait_seconds += time.perf_counter() - started
            if self._observer is not None:
                self._observer(position[0], self.sampler.batch_at(position))
            position = self.sampler.advance(position)
            yield batch

    def take_wait_seconds(self) -> float:
        """Seconds spent waiting for batches since the last call (the session asks once per step)."""
        waited, self.wait_seconds = self.wait_seconds, 0.0
        return waited

    def epochs(self, num_epochs: int) -> Iterator[tuple[int, Any]]:
        """(epoch, batch) for the rest of the current epoch and every further epoch below num_epochs."""
        while self.sampler.epoch < num_epochs:
            epoch = self.sampler.epoch
            for batch in self:
                yield epoch, batch
            if self.sampler.epoch == epoch:  # only possible if the state was changed under us
                raise RuntimeError(f"epoch {epoch} did not finish; was the loader's state changed mid-epoch?")
