"""`api: ray-train`: a Ray Train worker function `fn(config)`, run unchanged on elastic's placement.

The function already runs inside a Ray Train worker (TorchTrainer), so `ray.train.get_context()`,
`ray.train.torch.prepare_model` / `prepare_data_loader` / `get_device` are Ray's own. Two calls are routed
through the session while the function runs:

- `ray.train.report(metrics, checkpoint=...)` is a step: metrics go to the ledger, goodput, Prometheus and
  tracking like a session job's; a reported checkpoint folder is saved with the run's state into the run
  folder (`step-N/files/`), committed by the marker, kept by retention, listed by `elastic checkpoints ls`, and
  then reported to Ray as an already-written checkpoint. A checkpoint asked for by a reclaim notice ends the
  placement at it: no step is lost.
- `ray.train.get_checkpoint()` returns the newest committed checkpoint's folder (a `ray.train.Checkpoint` in
  the bucket: `as_directory()` downloads it), so a restarted or resubmitted run resumes.

`elastic.train.checkpoint_requested()` tells the function when to report a checkpoint (a reclaim notice, the
driver ending the placement, or the spec's cadence); it answers alike on every rank, as it changes only at
`report`, which every rank calls the same number of times.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from elastic.checkpoint.store import ATTACHED, CheckpointStore
from elastic.storage import pyarrow_filesystem


class Session(Protocol):
    """What this adapter uses of elastic.worker.session.Session (which hands itself in: the worker entry
    dispatches on the job's api, so this layer never imports the worker's)."""

    config: dict[str, Any]
    rank: int
    node_id: str
    store: CheckpointStore
    restored_step: int | None
    checkpoint_requested: bool

    def restore(self) -> int: ...
    def step(self, metrics: dict | None = None) -> None: ...
    def save_reported(self, folder: str, metrics: dict | None = None) -> None: ...
    def ended_by_function(self) -> None: ...
    def log(self, message: str, all_ranks: bool = False) -> None: ...


_log = logging.getLogger(__name__)

_current: Session | None = None


def current_session() -> Session | None:
    """The session of the Ray Train function running in this worker (None outside one)."""
    return _current


def install() -> None:
    """Route ray.train.report and get_checkpoint through the current session: call before the entrypoint's
    module is imported, so a module-level `from ray.train import report` gets the routed one too. Outside a
    running function (no current session) they are Ray's own."""
    import ray.train

    if getattr(ray.train.report, "elastic_original", None) is not None:
        return
    original_report, original_get_checkpoint = ray.train.report, ray.train.get_checkpoint

    def report(metrics: dict, checkpoint=None, checkpoint_dir_name: str | None = None, **kwargs: Any) -> None:
        """ray.train.report, as a step of the run; a reported checkpoint is committed to the run folder."""
        if _current is None:
            return original_report(metrics, checkpoint=checkpoint, checkpoint_dir_name=checkpoint_dir_name, **kwargs)
        _current_report(_current, dict(metrics), checkpoint)

    def get_checkpoint():
        """The newest committed checkpoint of the run when the function started (None on a fresh run)."""
        if _current is None:
            return original_get_checkpoint()
        return _resumed

    report.elastic_original = original_report  # the session's own reports to Ray go through the original
    get_checkpoint.elastic_original = original_get_checkpoint
    ray.train.report, ray.train.get_checkpoint = report, get_checkpoint


_resumed = None  # the current function's get_checkpoint() answer


def run_ray_train_function(session: Session, function: Callable[..., Any]) -> None:
    """Restore the run's newest checkpoint, then call `function(config)` (or `function()`) with Ray Train's
    report and get_checkpoint routed through `session` (install() must have run)."""
    global _current, _resumed
    logical_gpus_on_cpu(session)
    session.restore()
    _resumed = _restored_checkpoint(session)
    if _resumed is not None:
        session.log(f"ray.train.get_checkpoint() returns the checkpoint of step {session.restored_step}")
    _current = session
    try:
        function(dict(session.config)) if takes_config(function) else function()
    finally:
        _current = _resumed = None
    session.ended_by_function()


def logical_gpus_on_cpu(session: Session) -> None:
    """The local stack's GPUs are logical (a CPU machine stands in for GPU nodes): Ray Train's torch helpers pick
    CUDA from the worker's GPU resource alone and fail without it (torch.cuda.Stream in prepare_data_loader), and
    Ray Train told Accelerate the same (ACCELERATE_TORCH_DEVICE=cuda:N, which the Trainer's state takes as is).
    There, point both at the CPU, as the session does for its own jobs. Ray has no public switch for this; on a
    real GPU nothing changes."""
    import ray

    if torch.cuda.is_available() or not ray.get_runtime_context().get_accelerator_ids().get("GPU"):
        return
    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"
    try:
        from ray.air._internal import device_manager
    except ImportError:  # another Ray: its helpers stay as they are
        return
    with device_manager._torch_device_manager_lock:
        device_manager._torch_device_manager = device_manager.CPUTorchDeviceManager()
    session.log("logical GPUs without CUDA: Ray Train's torch helpers run on the CPU")


def _current_report(session: Session, metrics: dict, checkpoint) -> None:
    session.step(metrics)
    if not any_rank(checkpoint is not None):
        return
    if checkpoint is None:  # another rank passed one: the save is collective, this rank adds no files
        session.save_reported("", metrics)
        return
    with checkpoint.as_directory() as folder:
        session.save_reported(folder, metrics)


def takes_config(function: Callable[..., Any]) -> bool:
    """Ray Train calls train_loop_per_worker with the config when it takes a parameter, else with nothing."""
    parameters = inspect.signature(function).parameters.values()
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in parameters)


def _restored_checkpoint(session: Session):
    """The restored checkpoint's attached folder as a ray.train.Checkpoint (None on a fresh run)."""
    from ray.train import Checkpoint

    step = session.restored_step
    if step is None:
        return None
    filesystem, path = pyarrow_filesystem(f"{session.store.uri(step)}/{ATTACHED}")
    return Checkpoint(path, filesystem=filesystem)


def any_rank(flag: bool) -> bool:
    """Did any rank pass a checkpoint? (Ray lets rank 0 alone pass one; the save is collective.)"""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    tensor = torch.tensor([1 if flag else 0])
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())
