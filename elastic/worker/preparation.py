"""`session.prepare`'s model side: activation checkpointing, the device, and the wrapper of the spec's
`train.parallelism` (DDP, or FSDP2's fully_shard with the optimizer rebound to the sharded parameters)."""

from __future__ import annotations

import logging

import torch

from elastic.config.spec import TrainSpec
from elastic.parallel.fsdp import shard_model
from elastic.parallel.memory import measured as measured_state
from elastic.worker.optimizer_step import apply_activation_checkpointing, autocast_forward

_log = logging.getLogger(__name__)


def wrap_model(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    train: TrainSpec,
    device: torch.device,
    world_size: int,
    checkpoint_layers=None,
    shard=None,
    chief: bool = True,
) -> torch.nn.Module:
    """The model as this rank trains it; logs (rank 0) what was applied and the state's bytes per rank."""
    say = _log.info if chief else _log.debug
    if train.activation_checkpointing:
        count = apply_activation_checkpointing(model, checkpoint_layers)
        say(f"activation checkpointing on {count} modules")
    model = model.to(device)
    if train.parallelism == "fsdp":
        wrapped, line = shard_model(model, optimizer, train.fsdp, train.precision, shard)
        say(line)
    else:
        autocast_forward(model, train.precision, device)
        device_ids = [device.index] if device.type == "cuda" else None
        wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    say(f"{train.parallelism} at world size {world_size}: {measured_state(wrapped, optimizer).describe()}")
    return wrapped
