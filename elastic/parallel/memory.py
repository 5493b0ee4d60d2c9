"""What a rank holds of a model's training state: estimated from a parameter count (pure, for planning) and
measured from the tensors themselves (what the run logs at start)."""

from __future__ import annotations

from dataclasses import dataclass

GB = 1024**3
# AdamW keeps two values a parameter (exp_avg, exp_avg_sq); SGD with momentum one; plain SGD none.
OPTIMIZER_SLOTS = {"AdamW": 2, "Adam": 2, "SGD": 1, "none": 0}


@dataclass(frozen=True)
class StateBytes:
    """Bytes of one rank's parameters, gradients and optimizer state."""

    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    def describe(self) -> str:
        return (
            f"{self.total / GB:.2f} GB a rank (parameters {self.parameters / GB:.2f}, gradients "
            f"{self.gradients / GB:.2f}, optimizer {self.optimizer / GB:.2f})"
        )


def estimate(
    parameters: int, parallelism: str, world_size: int, optimizer_slots: int = 2, bytes_per_value: int = 4
) -> StateBytes:
    """The steady state of a rank: ddp holds all of it, fsdp 1/W of it (rounded up; the transient all-gather
    of one unit's parameters comes on top)."""
    share = parameters if parallelism == "ddp" else -(-parameters // max(1, world_size))
    values = share * bytes_per_value
    return StateBytes(parameters=values, gradients=values, optimizer=values * optimizer_slots)


def measured(model, optimizer=None) -> StateBytes:
    """The bytes this rank holds of the model's parameters, their gradients' size and the optimizer's state,
    counted from the local tensors (a DTensor's local shard)."""
    from elastic.parallel.fsdp import local

    def nbytes(tensor) -> int:
        part = local(tensor)
        return part.numel() * part.element_size()

    params = sum(nbytes(p) for p in model.parameters())
    grads = sum(nbytes(p) for p in model.parameters() if p.requires_grad)
    state = 0
    if optimizer is not None and optimizer.state:
        for slots in optimizer.state.values():
            state += sum(nbytes(v) for v in slots.values() if hasattr(v, "numel") and v.dim() > 0)
    elif optimizer is not None:  # before its first step: what it will allocate (a value a slot a parameter)
        state = grads * OPTIMIZER_SLOTS.get(type(optimizer).__name__, 2)
    return StateBytes(parameters=params, gradients=grads, optimizer=state)
