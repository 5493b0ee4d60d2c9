"""Whether a model's training state fits the GPUs a run will get, decided before anything starts (pure).

A rank holds its parameters, their gradients and the optimizer's slots (elastic.parallel.memory.estimate);
what is left must hold activations, the all-gathered unit of an FSDP step and the CUDA context, so the state
may use at most STATE_SHARE of a GPU's memory."""

from __future__ import annotations

import math
from dataclasses import dataclass

from elastic.parallel.memory import OPTIMIZER_SLOTS, estimate

GB = 1e9  # GPU memory is sold in decimal gigabytes (a "24 GB" A10G)
STATE_SHARE = 0.8

# Memory of the GPU types Ray names in its `accelerator_type:<name>` resource (ray.util.accelerators); where a
# type comes in two sizes, the smaller: a plan must hold on the smaller card.
ACCELERATOR_MEMORY_GB = {
    "K80": 12,
    "P4": 8,
    "P100": 16,
    "T4": 16,
    "V100": 16,
    "A10G": 24,
    "L4": 24,
    "L40S": 48,
    "A100": 40,
    "H100": 80,
    "H20": 96,
    "H200": 141,
    "B200": 180,
}


@dataclass(frozen=True)
class ModelPlan:
    """What a job declares of its model: how many parameters, and which optimizer (for its slots a parameter)."""

    parameters: int
    optimizer: str = "AdamW"

    @property
    def optimizer_slots(self) -> int:
        return OPTIMIZER_SLOTS.get(self.optimizer, 2)

    def describe(self) -> str:
        count = f"{self.parameters / 1e9:.1f}B" if self.parameters >= 1e9 else f"{self.parameters / 1e6:.0f}M"
        return f"{count} parameters with {self.optimizer}"


def state_gb(plan: ModelPlan, parallelism: str, workers: int) -> float:
    state = estimate(plan.parameters, parallelism, workers, optimizer_slots=plan.optimizer_slots)
    return state.total / GB


def workers_needed(plan: ModelPlan, gpu_memory_gb: float) -> int:
    """The fewest fsdp workers whose share of the state fits one GPU."""
    return max(1, math.ceil(state_gb(plan, "ddp", 1) / (gpu_memory_gb * STATE_SHARE)))


def refusal(
    plan: ModelPlan, parallelism: str, workers: int, gpu_memory_gb: float, gpu: str, cpu_offload: bool = False
) -> str | None:
    """One line saying why the state cannot fit and what would make it fit; None when it fits. `workers` is the
    fewest the run trains with (an elastic run shrinks to it); `gpu` names the GPU in the line."""
    if parallelism == "fsdp" and cpu_offload:
        return None  # the sharded state lives in host memory; the GPU holds one unit at a time
    need = state_gb(plan, parallelism, workers)
    if need <= gpu_memory_gb * STATE_SHARE:
        return None
    enough = workers_needed(plan, gpu_memory_gb)
    where = "under ddp" if parallelism == "ddp" else f"under fsdp with {workers} worker{'s' * (workers != 1)}"
    if parallelism == "ddp":
        fix = f"set train.parallelism: fsdp with >= {enough} workers (or fsdp with train.fsdp.cpu_offload: true)"
    else:
        fix = f"set workers.min >= {enough} (or train.fsdp.cpu_offload: true)"
    return f"{plan.describe()} {where} need ~{need:.0f} GB per GPU; {gpu} has {gpu_memory_gb:g} GB: {fix}"


def smallest_gpu_memory(accelerator_types: list[str]) -> tuple[str, float] | None:
    """(type, GB) of the smallest known GPU among the types a cluster's nodes report; None if none is known."""
    known = [(name, ACCELERATOR_MEMORY_GB[name]) for name in accelerator_types if name in ACCELERATOR_MEMORY_GB]
    return min(known, key=lambda item: item[1]) if known else None
