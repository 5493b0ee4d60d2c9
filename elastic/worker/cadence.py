"""When a periodic checkpoint is due: the spec's every_steps / every_seconds, agreed on by every rank."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from elastic.config.spec import CheckpointSpec


class CheckpointCadence:
    """Pure policy: is a checkpoint due at this step, given the spec's every_steps / every_seconds?"""

    def __init__(self, spec: CheckpointSpec, clock=time.monotonic):
        self._every_steps = spec.every_steps
        self._every_seconds = spec.every_seconds
        self._clock = clock
        self._last_time = clock()

    @property
    def time_based(self) -> bool:
        return self._every_seconds is not None

    def due(self, step: int) -> bool:
        if self._every_steps is not None and step > 0 and step % self._every_steps == 0:
            return True
        return self._every_seconds is not None and self._clock() - self._last_time >= self._every_seconds

    def due_on_every_rank(self, step: int) -> bool:
        """`due`, made the same on every rank: clocks differ by rank, and a save only some ranks start hangs."""
        due = self.due(step)
        if self.time_based and dist.is_initialized():
            flag = torch.tensor([1 if due else 0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            due = bool(flag.item())
        return due

    def saved(self) -> None:
        self._last_time = self._clock()
