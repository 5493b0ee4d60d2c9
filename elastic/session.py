"""The per-worker harness a training function receives: DDP, restore, checkpoint cadence, metrics.

User code stays plain PyTorch::

    def train(session):
        model = session.wrap(Net())
        state = session.restore()            # None on a fresh run
        for step in ...:
            ...
            if session.checkpoint_due(step):
                session.save(step, {"model": model.module.state_dict(), ...}, {"loss": loss})

Checkpoints go to the job's checkpoint URI through Ray Train, which records each one, restores the latest
when the run restarts (after a failure, a preemption, or a resubmission of the same job) and keeps the last
`checkpoint.keep`.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from elastic.labels import MARKET_LABEL
from elastic.spec import CheckpointSpec, JobSpec

STATE_FILE = "state.pt"


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

    def saved(self) -> None:
        self._last_time = self._clock()


class Session:
    """Per-worker view of the run. Created by the trainer on every worker; never by user code."""

    def __init__(self, spec: JobSpec, run_name: str):
        import ray.train

        self.spec = spec
        self.config: dict[str, Any] = dict(spec.config)
        self.run_name = run_name
        context = ray.train.get_context()
        self.rank = context.get_world_rank()
        self.world_size = context.get_world_size()
        self.local_rank = context.get_local_rank()
        self.device = _device(self.local_rank)
        self.node_id, self.market = _node_identity()
        self._cadence = CheckpointCadence(spec.checkpoint)
        self.restored_step: int | None = None
        self.log(f"worker rank {self.rank}/{self.world_size} on node {self.node_id} market={self.market} "
                 f"device={self.device}", all_ranks=True)

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    def wrap(self, model: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel:
        """Move to this worker's device and wrap in DDP, also at world size 1, so `model.module` always works."""
        model = model.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)

    def restore(self) -> dict | None:
        """The state saved by the latest checkpoint of this run, or None on a fresh start."""
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return None
        with checkpoint.as_directory() as folder:
            state = torch.load(os.path.join(folder, STATE_FILE), map_location="cpu", weights_only=False)
        self.restored_step = int(state.get("step", 0))
        self.log(f"resumed from checkpoint at step {self.restored_step} ({checkpoint.path})")
        return state

    def checkpoint_due(self, step: int) -> bool:
        due = self._cadence.due(step)
        if self._cadence.time_based and dist.is_initialized():
            # Clocks differ by rank; every rank must agree or the collective save would hang.
            flag = torch.tensor([1 if due else 0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            due = bool(flag.item())
        return due

    def save(self, step: int, state: dict, metrics: dict | None = None) -> None:
        """Checkpoint `state` (rank 0's copy: DDP replicas are identical) and report metrics. Call on all ranks."""
        import ray.train

        metrics = {"step": step, **(metrics or {})}
        with tempfile.TemporaryDirectory(prefix="elastic-ckpt-") as folder:
            checkpoint = None
            if self.is_chief:
                torch.save({**state, "step": step}, os.path.join(folder, STATE_FILE))
                checkpoint = ray.train.Checkpoint.from_directory(folder)
            ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=f"step-{step:09d}")
        self._cadence.saved()
        self.log(f"checkpoint at step {step}: {_format(metrics)}")

    def report(self, metrics: dict) -> None:
        """Report metrics without a checkpoint (all ranks)."""
        import ray.train

        ray.train.report(metrics)

    def all_reduce_sum(self, *values: float) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(tensor)
        return tensor.tolist()

    def log(self, message: str, all_ranks: bool = False) -> None:
        if all_ranks or self.is_chief:
            print(f"[elastic] {message}", flush=True)


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _node_identity() -> tuple[str, str]:
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    labels = {}
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            labels = node.get("Labels") or {}
    return node_id, labels.get(MARKET_LABEL, "unknown")


def _format(metrics: dict) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
