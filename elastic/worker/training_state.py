"""What a checkpoint holds of a training worker, as one torch `Stateful` (the way torchtitan's ModelWrapper
does it): model and optimizer through DCP's get_state_dict/set_state_dict (so they reshard to another world
size), plus one replicated blob with the step, every tracked object, `extras` and each rank's random streams."""

from __future__ import annotations

import pickle
import random
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from elastic.parallel.fsdp import local


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> Any: ...


def capture_rng() -> dict:
    """This process's random streams: python, numpy, torch CPU and (if in use) this rank's CUDA device."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        # The current device's stream only: a rank drives one GPU, and a resumed rank may sit on a node with
        # another number of them (get/set_rng_state_all would not fit).
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if isinstance(cuda, (list, tuple)):  # written by an earlier version: every device's state
            cuda = cuda[torch.cuda.current_device() % len(cuda)]
        torch.cuda.set_rng_state(cuda)


def gather_rng(world_size: int) -> list[dict]:
    """Every rank's streams, in rank order (a collective when torch.distributed is up)."""
    if not dist.is_initialized():
        return [capture_rng()]
    streams: list[Any] = [None] * world_size
    dist.all_gather_object(streams, capture_rng())
    return streams


class TrainingState:
    """Model, optimizer, tracked objects, `extras`, the step and the random streams of one rank.

    `state_dict()` is what DCP saves: "model" and "optim" as DCP state dicts, and "elastic", a pickled blob
    every rank writes alike (DCP keeps one copy). `load_state_dict()` applies a loaded one; rank r continues
    saved random stream r mod W, so the streams stay deterministic when the world size changed."""

    def __init__(self, rank: int, world_size: int, gather: Callable[[int], list[dict]] = gather_rng):
        self.rank = rank
        self.world_size = world_size
        self._gather = gather
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.tracked: dict[str, Stateful] = {}
        self.extras: dict[str, Any] = {}
        self.step = 0

    def state_dict(self) -> dict:
        state: dict[str, Any] = self._tensors()
        # One replicated blob for everything that is not a tensor: DCP writes it once.
        state["elastic"] = pickle.dumps(
            {
                "step": self.step,
                "world_size": self.world_size,
                "rng": self._gather(self.world_size),
                "tracked": {name: obj.state_dict() for name, obj in self.tracked.items()},
                "extras": self.extras,
            }
        )
        return state

    def template(self) -> dict:
        """What DCP loads into: the tensors' current state dicts (their shapes and shardings), an empty blob.
        The blob is left empty (no streams gathered, nothing pickled): the load replaces it whole."""
        state = self._tensors()
        state["elastic"] = b""
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.model is not None:
            set_state_dict(
                self.model, self._optimizers(), model_state_dict=state["model"], optim_state_dict=state.get("optim", {})
            )
        blob = pickle.loads(state["elastic"])
        self.step = int(blob["step"])
        for name, obj in self.tracked.items():
            if name in blob["tracked"]:
                obj.load_state_dict(blob["tracked"][name])
        self.extras = dict(blob["extras"])
        rng = blob["rng"]
        # Same world size: each rank continues its own random stream. Otherwise streams cannot map 1:1;
        # rank r takes saved stream r mod W so every rank is still deterministic.
        restore_rng(rng[self.rank % len(rng)])

    def changed_only_by_optimizer(self) -> Callable[[torch.Tensor], bool] | None:
        """Predicate for tensors an async save may copy after it returns: parameters and optimizer state,
        which change only in optimizer.step() (guarded by the session's pre-hook). Buffers (e.g. BatchNorm
        statistics, updated by forward) are staged before the save returns."""
        if self.model is None or self.optimizer is None:
            return None
        storage = lambda tensor: local(tensor).untyped_storage().data_ptr()  # noqa: E731  (a DTensor: its shard)
        storages = {storage(p) for p in self.model.parameters()}
        for state in self.optimizer.state.values():
            storages |= {storage(t) for t in state.values() if isinstance(t, torch.Tensor)}
        return lambda tensor: storage(tensor) in storages

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer] if self.optimizer is not None else []

    def _tensors(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self.model is not None:
            model_state, optim_state = get_state_dict(self.model, self._optimizers())
            state["model"] = model_state
            if self.optimizer is not None:
                state["optim"] = optim_state
        return state
