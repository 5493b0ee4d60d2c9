"""Which checkpoint a restore tries, and what it does when the newest cannot be read.

The loads are collective, so every rank must try the same checkpoints in the same order: rank 0 lists them and
shares the list. After a fall back to an older checkpoint, the newer ones that could not be read are retired,
so a later restore never jumps ahead to a checkpoint of the abandoned history."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch.distributed as dist

from elastic.checkpoint.store import CheckpointStore

_log = logging.getLogger(__name__)


def shared_restorable_steps(store: CheckpointStore, rank: int, group) -> list[int]:
    """Rank 0's listing (CheckpointStore.restorable_steps, which also removes torn saves newer than the latest
    commit), broadcast to every rank of `group`."""
    shared = [store.restorable_steps() if rank == 0 else []]
    if group is not None and dist.is_initialized():
        dist.broadcast_object_list(shared, src=0, group=group)
    return shared[0]


def retire_unreadable(store: CheckpointStore, step: int, committed: list[int], log: Callable[[str], None]) -> None:
    """Rank 0, after falling back to `step`: retire the committed checkpoints newer than it (their sample records
    were superseded). Best effort: the store may still be failing."""
    for newer in (s for s in committed if s > step):
        try:
            store.retire(newer)
            log(f"retired checkpoint at step {newer}: it could not be read, the run goes on from {step}")
        except Exception as err:  # storage errors vary by backend; the run goes on either way
            _log.warning("could not retire unreadable checkpoint at step %d: %s", newer, err)
