"""`api: transformers`: a function `fn(config)` that builds a Hugging Face `transformers.Trainer` and returns it
(elastic calls `train()`) or calls `train()` itself, run unchanged on elastic's placement.

The Trainer runs inside a Ray Train worker: the process group and the RANK / LOCAL_RANK / WORLD_SIZE variables
are Ray's, so its own `torch.distributed` use (DDP; FSDP where its `fsdp` options allow) just works. While the
function runs, `Trainer.train` is wrapped to add one callback and a resume point:

- every optimizer step (`on_step_end`) is a step of the run: the Trainer's last logs go to the ledger, goodput,
  Prometheus and tracking like a session job's; when a reclaim notice, the driver or the spec's cadence wants a
  checkpoint, the callback sets `control.should_save`, so the Trainer saves at this very step;
- every Trainer checkpoint (`on_save`: model, optimizer, scheduler, RNG, trainer state in
  `output_dir/checkpoint-N`) is uploaded into the run folder (`step-N/files/`), committed by the run's marker,
  kept by retention, listed by `elastic checkpoints ls`; after a notice it ends the placement there, so no step is
  lost;
- a restarted or resubmitted run downloads the newest committed checkpoint and passes it as
  `resume_from_checkpoint` (the Trainer restores everything in it and skips the batches already trained).
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from elastic.adapters.ray_train import Session, logical_gpus_on_cpu, takes_config
from elastic.checkpoint.store import ATTACHED

_log = logging.getLogger(__name__)

_current: Session | None = None
_resume_dir: str | None = None


def install() -> None:
    """Wrap transformers.Trainer.train (before the entrypoint's module is imported; once per process)."""
    from transformers import Trainer

    if getattr(Trainer.train, "elastic_original", None) is not None:
        return
    original = Trainer.train

    def train(self, resume_from_checkpoint=None, *args: Any, **kwargs: Any):
        if _current is not None:
            callback = elastic_callback()
            if not any(isinstance(c, callback) for c in self.callback_handler.callbacks):
                self.add_callback(callback(_current))
            if resume_from_checkpoint is None and _resume_dir is not None:
                resume_from_checkpoint = _resume_dir
            self._elastic_trained = True
        return original(self, resume_from_checkpoint, *args, **kwargs)

    train.elastic_original = original
    Trainer.train = train


def run_transformers_function(session: Session, function: Callable[..., Any]) -> None:
    """Restore the run's newest checkpoint, call the function, and train the Trainer it returns."""
    from transformers import Trainer

    global _current, _resume_dir
    logical_gpus_on_cpu(session)
    session.restore()
    with tempfile.TemporaryDirectory(prefix="elastic-hf-resume-") as scratch:
        _resume_dir = _download_restored(session, scratch)
        _current = session
        try:
            result = function(dict(session.config)) if takes_config(function) else function()
            if isinstance(result, Trainer) and not getattr(result, "_elastic_trained", False):
                result.train()
        finally:
            _current = _resume_dir = None
    session.ended_by_function()


def _download_restored(session: Session, scratch: str) -> str | None:
    """The restored checkpoint's Trainer folder, downloaded for resume_from_checkpoint (None on a fresh run)."""
    step = session.restored_step
    if step is None:
        return None
    local = os.path.join(scratch, f"checkpoint-{step}")
    session.store.fs.get(f"{session.store.path(step)}/{ATTACHED}/", local + "/", recursive=True)
    session.log(f"the Trainer resumes from the checkpoint of step {step} (resume_from_checkpoint)")
    return local


@functools.cache
def elastic_callback():
    """The callback class, built on transformers.TrainerCallback (transformers is imported only for this api)."""
    from transformers import TrainerCallback

    class Callback(TrainerCallback):
        """Steps, save requests and commits of a Trainer, through the session."""

        def __init__(self, session: Session):
            self.session = session
            self.logs: dict[str, float] = {}

        def on_log(self, args, state, control, logs=None, **kwargs):
            # The Trainer logs after on_step_end: these are the logs of the step the session just counted.
            self.logs = {k: float(v) for k, v in (logs or {}).items() if isinstance(v, (int, float))}
            if state.global_step == self.session.step_count:
                self.session.log_metrics(self.logs)

        def on_step_end(self, args, state, control, **kwargs):
            self.session.step()
            if self.session.checkpoint_requested:
                control.should_save = True  # the Trainer saves at this very step; on_save commits it

        def on_save(self, args, state, control, **kwargs):
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            self.session.save_reported(_uploader_folder(self.session, folder), {"step": state.global_step, **self.logs})

    return Callback


def _uploader_folder(session: Session, folder: str) -> str:
    """Ranks that share a node write into one folder (the model and optimizer from rank 0, each rank its RNG
    state): once every rank has written (a barrier), the lowest rank of each (node, folder) uploads it."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return folder
    dist.barrier()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (session.node_id, os.path.realpath(folder)))
    first = everyone.index((session.node_id, os.path.realpath(folder)))
    return folder if first == session.rank else ""
