"""The per-worker harness a training function receives: DDP, restore, the optimizer step, periodic async
checkpoints, metrics.

User code stays plain PyTorch::

    def train(session):
        model, optimizer = session.prepare(Net(), torch.optim.SGD(...), scheduler)  # DDP-wrapped; checkpointed
        loader = session.loader(dataset, batch_size=32)                             # its position resumes too
        session.restore()                                                           # latest committed, if any
        for epoch, (x, y) in loader.epochs(10):
            loss = F.cross_entropy(model(x), y)
            session.optimize(loss, {"loss": loss.item()})   # backward, step (spec's `train:`), checkpoints
        session.finish({"accuracy": acc})

Checkpoints are sharded DCP saves written by every rank straight to the run folder at the checkpoint URI
(elastic.checkpoint), committed by a marker, reported to Ray Train as already-written checkpoints so Ray's
bookkeeping agrees, and pruned to `checkpoint.keep`. A restore loads model and optimizer (resharded to the
current world size), the step, every tracked object, each rank's python/numpy/torch RNG state, and `extras`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elastic.checkpoint.checkpointer import SaveResult
from elastic.checkpoint.store import CheckpointStore, run_directory
from elastic.config.spec import JobSpec
from elastic.data import ResumableLoader, ResumableSampler
from elastic.observability.gpu import gpu_sampler
from elastic.observability.metrics import run_metrics
from elastic.worker.adoption import Adoption
from elastic.worker.audit import NoLedger, SampleLedger, audit_enabled
from elastic.worker.cadence import CheckpointCadence
from elastic.worker.chaos import Chaos
from elastic.worker.ending import PlacementEnding
from elastic.worker.in_process import DrainNotices, in_process, train_context
from elastic.worker.jit import read_ray_notice
from elastic.worker.node import node_identity, worker_device
from elastic.worker.optimizer_step import NonFiniteGuard, OptimizerStep, autocast, grad_scaler
from elastic.worker.placement_watch import placement_watch
from elastic.worker.preparation import wrap_model
from elastic.worker.restore import retire_unreadable, shared_restorable_steps
from elastic.worker.run_ledger import attempt_ledger
from elastic.worker.save_requests import JUST_IN_TIME, PLACEMENT_ENDING, SaveRequests
from elastic.worker.saving import Saves
from elastic.worker.telemetry import Telemetry
from elastic.worker.tracking import SessionTracking
from elastic.worker.training_state import Stateful, TrainingState
from elastic.worker.watchdog import session_watchdog

_log = logging.getLogger(__name__)

StepHook = Callable[[int, "dict | None"], None]
"""Called as hook(step, metrics) on every rank at the end of each `Session.step` (see add_step_hook)."""


class Session:
    """Per-worker view of the run. Created by the worker entry (elastic.worker.entrypoint) on every worker;
    never by user code.

    Extension point: `add_step_hook(hook)` registers `hook(step, metrics)`, called on every rank at the end of
    each `step()` (so also from `optimize()`), after a checkpoint that was due has started. Sweep trials use
    it (elastic.worker.sharing) to time steps, end a probe run and inject out-of-memory errors; an exception a
    hook raises leaves the training function like one raised by the step itself. Set `report_every_commit`
    to report each committed checkpoint to Ray (Tune counts reports as iterations) instead of passing over
    those that commit while the previous report is still under way.

    The work is done by collaborators, one per module: TrainingState (what a checkpoint holds),
    CheckpointCadence (when one is due), Saves (a save from start to commit: the checkpointer, reports to
    Ray Train, retention), SaveRequests (api ray-train/transformers: asking the function for one), Chaos
    (fault injection), PlacementEnding (the placement watch and JustInTime: ending a placement at a
    checkpoint), SampleLedger (auditing), wrap_model (DDP/FSDP) and OptimizerStep (backward, clipping, the
    step).
    """

    def __init__(self, spec: JobSpec, run_name: str, placement: dict | None = None):

        self.spec = spec
        self.config: dict[str, Any] = dict(spec.config)
        self.run_name = run_name
        context = train_context()
        self.rank = context.get_world_rank()
        self.world_size = context.get_world_size()
        self.local_rank = context.get_local_rank()
        self.device = worker_device(self.local_rank)
        self.node_id, self.market = node_identity()
        self._storage = context.get_storage()
        # A light trial trains in its Tune trainable's process: no worker group watches drains, this node's is read.
        self.in_process = in_process()
        self.store = CheckpointStore(run_directory(spec, self._storage.experiment_dir_name))
        # Background saves run their collectives on a group of their own, apart from DDP's all-reduces.
        self._checkpoint_group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._saves = Saves(
            self.store, self.rank, self.world_size, self._checkpoint_group, self._storage, spec.checkpoint
        )
        self.checkpointer = self._saves.checkpointer
        self._state = TrainingState(self.rank, self.world_size)
        # Run metrics out through Ray's Prometheus export; goodput's clock rides in the checkpoint.
        self._telemetry = Telemetry(
            run_metrics(run_name),
            self.rank,
            spec.checkpoint,
            self.store,
            self._samples_per_step,
            gpu_sampler(self.device),
        )
        self._state.tracked["elastic.goodput"] = self._telemetry.goodput
        # The spec's `tracking:` (MLflow, TensorBoard); the MLflow run id rides in the checkpoint.
        self._tracking = SessionTracking(spec, run_name, self.rank)
        self._state.tracked["elastic.tracking"] = self._tracking.state
        self._watchdog = session_watchdog(
            self.rank, spec.failure.hang_timeout_seconds, self.store, (placement or {}).get("id"), lambda: self._attempt
        )
        self._step_hooks: list[StepHook] = [
            self._telemetry.on_step,
            self._tracking.on_step,
            lambda step, metrics: self._watchdog.progress(step),
        ]
        self._telemetry.start()
        self._cadence = CheckpointCadence(spec.checkpoint)
        self._chaos = Chaos(self.store, self.rank)
        self.checkpointer.fault_hook = self._chaos.maybe_kill_in_save
        # The driver may ask this placement to end at a checkpoint (spot-first moving to spot, an elastic run
        # growing); a reclaim notice ends it at a just-in-time checkpoint.
        self._ending = PlacementEnding(
            placement_watch(placement, self.store.run_uri, self.rank),
            self._saves.reports,
            self.rank,
            wait_for_save=self._saves.wait,
        )
        self._saves.report_listeners.append(lambda seconds: self._ending.jit.reported(seconds))
        self._ending.join(self.node_id, self.world_size, self._checkpoint_group)
        self._attempt = attempt_ledger(
            self.store.run_uri,
            (placement or {}).get("id"),
            self.rank,
            self.world_size,
            self.node_id,
            self._checkpoint_group,
        )
        self._ending.on_notice = self._attempt.notice
        self._saves.commit_listeners += [
            lambda result: self._ending.jit.saved(result.total_seconds),
            lambda result: self._watchdog.saved(result.total_seconds),
            self._attempt.committed,
            self._telemetry.on_commit,
        ]
        self._ending.pause_watchdog = self._watchdog.pause
        self._ending.watch_notices(
            spec.checkpoint,
            in_flight=lambda: self._saves.checkpointer.in_flight,
            read_notice=self._chaos.notice_source(DrainNotices(self.node_id) if self.in_process else read_ray_notice),
        )
        self._ledger = (
            SampleLedger(self.store.fs, self.store.root, self.rank, self.world_size, 0, attempt="")
            if audit_enabled()
            else NoLedger()
        )
        # api ray-train/transformers: the function decides when to checkpoint (it reports a folder); the
        # session only asks it to (checkpoint_requested) when a notice, the driver or the cadence wants one.
        self._user_saves = spec.api != "session"
        self._save_requests = SaveRequests()
        self._guard = NonFiniteGuard(spec.train.max_nonfinite_steps)
        self._optimizer_step: OptimizerStep | None = None
        self.restored_step: int | None = None
        # A PBT trial that adopted another trial's checkpoint of this step (elastic.worker.adoption): restoring
        # it keeps this trial's own hyperparameters. Set by the sweep's worker setup before the job runs.
        self.adopted_step: int | None = None
        self.log(
            f"worker rank {self.rank}/{self.world_size} on node {self.node_id} market={self.market} "
            f"device={self.device}",
            all_ranks=True,
        )

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def step_count(self) -> int:
        """Optimizer steps taken in this run (restored with the checkpoint)."""
        return self._state.step

    @step_count.setter
    def step_count(self, step: int) -> None:
        self._state.step = step

    @property
    def extras(self) -> dict[str, Any]:
        """Anything picklable to checkpoint along (restored with the checkpoint)."""
        return self._state.extras

    @extras.setter
    def extras(self, extras: dict[str, Any]) -> None:
        self._state.extras = extras

    @property
    def report_every_commit(self) -> bool:
        return self._saves.reports.report_every_commit

    @report_every_commit.setter
    def report_every_commit(self, every: bool) -> None:
        self._saves.reports.report_every_commit = every

    def add_step_hook(self, hook: StepHook) -> None:
        """Call `hook(step, metrics)` on this rank at the end of every step (see the class docstring)."""
        self._step_hooks.append(hook)

    # -- setup
    def prepare(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler=None,
        checkpoint_layers=None,
        shard=None,
    ):
        """Move to this worker's device, wrap for `train.parallelism` and register model, optimizer and LR
        scheduler for checkpointing. Build the optimizer over `model.parameters()` before calling.

        ddp (default): DistributedDataParallel, also at world size 1 (`model.module` is the model). fsdp: FSDP2's
        fully_shard on each module `shard` picks (a tuple of module types or a predicate; default: the entries of
        the model's ModuleLists, e.g. a transformer's blocks) and on the root; the optimizer is rebound to the
        sharded parameters (the same object: a scheduler bound to it stays valid). The loop is the same.

        The spec's `train` section applies here: the forward runs in bf16/fp16 (autocast under ddp, FSDP's
        MixedPrecisionPolicy under fsdp; outputs come back as float32), and with `activation_checkpointing` the
        `checkpoint_layers` (a tuple of module types or a predicate; default: the model's direct children)
        recompute their activations in backward."""
        train = self.spec.train
        wrapped = wrap_model(
            model, optimizer, train, self.device, self.world_size, checkpoint_layers, shard, chief=self.is_chief
        )
        self._state.model, self._state.optimizer = wrapped, optimizer
        if scheduler is not None:
            self.track("lr_scheduler", scheduler)
        if optimizer is not None:
            scaler = grad_scaler(train.precision, self.device)
            if train.precision == "fp16":
                self.track("grad_scaler", scaler)
            self.track("nonfinite_guard", self._guard)
            # An async save copies parameters and optimizer state while the next step computes; they may
            # change only once that copy is done (also when user code calls optimizer.step() itself).
            optimizer.register_step_pre_hook(lambda *_: self.checkpointer.wait_staged())
            self._optimizer_step = OptimizerStep(train, wrapped, optimizer, scaler, self._guard, scheduler)
        return (wrapped, optimizer) if optimizer is not None else wrapped

    def autocast(self):
        """The autocast context of `train.precision` (prepare() already applies it to the model's forward)."""
        return autocast(self.spec.train.precision, self.device)

    def track(self, name: str, obj: Stateful) -> None:
        """Checkpoint and restore `obj` (LR scheduler, GradScaler, data loader...) under `name`."""
        self._state.tracked[name] = obj

    def loader(
        self,
        dataset,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        **dataloader_kwargs,
    ):
        """An exactly-once, resumable loader over a map-style dataset for this rank (elastic.data), tracked
        so its position is checkpointed: after a restore at any worker count it continues where it was."""
        sampler = ResumableSampler(
            len(dataset),
            batch_size,
            self.rank,
            self.world_size,
            seed=seed,
            shuffle=shuffle,
            drop_last=drop_last,
            # A dataset that owns its epoch order (elastic.data.StreamingDataset: row-group windows) gives it.
            order_source=dataset if hasattr(dataset, "epoch_order") else None,
        )
        loader = ResumableLoader(dataset, sampler, observer=self._ledger.on_batch, **dataloader_kwargs)
        if isinstance(self._ledger, SampleLedger):
            self._ledger.num_samples = len(dataset)
        self.track("data", loader)
        return loader

    # -- restore
    def restore(self) -> int:
        """Load the latest committed checkpoint of this run, if any; when it cannot be read, the one before it
        (a log line says so). Returns the step to continue from."""
        self._attempt.restoring()
        committed = shared_restorable_steps(self.store, self.rank, self._checkpoint_group)
        if self._checkpoint_group is not None:
            dist.barrier(group=self._checkpoint_group)
        self._ending.watch.running(self.world_size)
        if not committed:
            self._ledger.start_attempt(0, self._checkpoint_group)
            self._attempt.training()
            self._telemetry.resumed(0)
            return 0
        loading_since = time.time()
        adoption = Adoption(self._state) if self.adopted_step is not None else None
        step, state = self.checkpointer.load_newest(committed, self._state.template)
        self._state.load_state_dict(state)
        if adoption is not None and step == self.adopted_step:
            self.log(
                f"adopted checkpoint of step {step}: this trial's hyperparameters kept ({adoption.apply(self._state)})"
            )
        if self.is_chief and step != max(committed):
            retire_unreadable(self.store, step, committed, self.log)
        info = self.store.info(step)
        # The ledger keeps when the loaded checkpoint was committed and when the load began: a chaos soak
        # proves from them that no torn checkpoint was ever loaded (the marker predates the load).
        commit_time = info.time if info.committed else None
        self._ledger.start_attempt(step, self._checkpoint_group, commit_time, loading_since)
        self.restored_step = self._saves.last_saved_step = self.step_count
        self._attempt.restored(self.step_count, info.world_size or 0, self.world_size)
        self._attempt.training()
        self._telemetry.resumed(self.step_count)
        self.log(
            f"resumed from checkpoint at step {self.step_count} ({info.uri}, written by "
            f"{info.world_size} workers, now {self.world_size})"
        )
        return self.step_count

    # -- training loop
    def optimize(self, loss: torch.Tensor, metrics: dict | None = None) -> bool:
        """Backward on one micro-batch's loss; on the last of `train.grad_accumulation` micro-batches, clip,
        step the optimizer (through the GradScaler with fp16) and the LR scheduler, zero the gradients and
        call `step(metrics)`. A NaN/inf loss on any rank skips the step on all ranks. Returns True when an
        optimizer step was completed (applied or skipped)."""
        if self._optimizer_step is None:
            raise RuntimeError("session.optimize needs an optimizer: call session.prepare(model, optimizer) first")
        done, applied = self._optimizer_step.optimize(loss, self.step_count + 1)
        if done:
            if not applied:
                self.log(
                    f"step {self.step_count + 1}: non-finite loss, step skipped "
                    f"({self._guard.in_a_row} in a row, {self._guard.skipped} in all)"
                )
            self.step(metrics)
        return done

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because the loss was NaN/inf (restored with the checkpoint)."""
        return self._guard.skipped

    def step(self, metrics: dict | None = None) -> None:
        """Call once per optimizer step, on every rank. Checkpoints (asynchronously) when due."""
        self.step_count += 1
        waited = self._data_wait()
        self._attempt.stepped(self.step_count, metrics, data_wait=waited)
        self._telemetry.waited_for_data(waited)
        self._ledger.on_step(self.step_count, metrics)
        self._chaos.maybe_kill(self.step_count)
        if self._user_saves:
            self._save_requests.note(
                self._ending.jit.due(self.step_count),
                ending=lambda: self._ending.watch.can_end and self._ending.watch.end_requested(),
                periodic=lambda: self._cadence.due_on_every_rank(self.step_count),
            )
        elif self._ending.jit.due(self.step_count):
            self._ending.just_in_time(lambda: self._save_now(metrics), metrics)
        elif self._cadence.due_on_every_rank(self.step_count):
            self.checkpoint(metrics)
            if self._ending.watch.end_requested():
                self._ending.at_checkpoint()
        for hook in self._step_hooks:
            hook(self.step_count, metrics)

    def log_metrics(self, metrics: dict) -> None:
        """Metrics of the step just taken that a framework computes after its step-end hook (the Trainer logs
        after `on_step_end`): to the run ledger and to tracking at that step, as if given to step()."""
        self._attempt.noted(metrics)
        self._tracking.on_step(self.step_count, metrics)

    def checkpoint(
        self,
        metrics: dict | None = None,
        asynchronous: bool = True,
        reason: str = "periodic",
        attach: str | None = None,
    ) -> None:
        """Save now (all ranks). Blocks only while state is copied to host memory. `reason` is recorded in the
        commit marker (`elastic checkpoints ls` shows it); `attach`: see ShardedCheckpointer.save."""
        self._saves.wait()  # at most one in flight
        self._ledger.flush(self.step_count)  # records cover every step a commit of this save includes
        self._attempt.saving(self.step_count, asynchronous, reason)
        self._saves.start(
            self.step_count,
            self._state.state_dict(),
            metrics,
            asynchronous=asynchronous,
            deferrable=self._state.changed_only_by_optimizer(),
            reason=reason,
            attach=attach,
        )
        self._cadence.saved()

    @property
    def checkpoint_requested(self) -> bool:
        """api ray-train: should the function report a checkpoint now? The same answer on every rank, updated
        at each step (report): a reclaim notice, the driver ending this placement, or the spec's cadence."""
        return self._save_requests.reason is not None

    def save_reported(self, folder: str, metrics: dict | None = None) -> None:
        """api ray-train, every rank: the function reported a checkpoint folder at this step (`folder` is ""
        on a rank that passed none). Saved with the run's state and committed before this returns; a save
        asked for by a reclaim notice or the driver then ends this placement at it (PlacementEnded)."""
        reason = self._save_requests.take()
        self._saves.wait()
        self.checkpoint(metrics, asynchronous=False, reason=reason or "reported", attach=folder)
        if reason == JUST_IN_TIME:
            self._ending.just_in_time(self._saves.wait, metrics)
        elif reason == PLACEMENT_ENDING:
            self._ending.at_checkpoint()
        self._saves.wait_or_raise()

    def finish(self, metrics: dict | None = None) -> None:
        """Final checkpoint, waited for and reported with `metrics`: call at the end of training on every rank."""
        final = {"step": self.step_count, **(metrics or {})}
        self._tracking.finish(self.step_count, final)
        if self._saves.last_saved_step != self.step_count:
            self.checkpoint(metrics, asynchronous=False, reason="final")
            self._saves.wait_or_raise()
            self._saves.reports.report_ending(self.step_count, final)
            self._attempt.ended(self.step_count, "finished")
            return
        self._saves.report_final(self.step_count, final, before_report=self._chaos.before_final_report)
        self._attempt.ended(self.step_count, "finished")

    def ended_by_function(self) -> None:
        """api ray-train, when the function returned: its checkpoints are its own to report (no final save
        here, which would hold no folder of its); Ray is told of every commit before the worker leaves."""
        self._tracking.finish(self.step_count, {"step": self.step_count})
        self._saves.wait_or_raise()
        self.drain_reports()
        self._attempt.ended(self.step_count, "finished")

    def all_reduce_sum(self, *values: float) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(tensor)
        return tensor.tolist()

    def keep_pinned_checkpoints(self) -> None:
        """Retention keeps checkpoints that other runs pinned (a sweep trial's: PBT's exploit copies them)."""
        self._saves.honor_pins()

    def log(self, message: str, all_ranks: bool = False) -> None:
        """Log `message` (at INFO, as `[elastic] message` once the worker entry configured elastic.logs):
        on rank 0 only, unless `all_ranks`."""
        if all_ranks or self.is_chief:
            _log.info(message)

    def attempt_ended(self, step: int, reason: str) -> None:
        """The worker entry, as this placement ends at the checkpoint of `step`: the run ledger notes why."""
        if step >= 0:
            self._attempt.ended(step, reason)

    def close(self) -> None:
        """The worker entry, as this worker leaves (however it leaves): write what the run ledger holds."""
        self._watchdog.stop()
        self._attempt.close()

    # -- internals
    def _data_wait(self) -> float:
        """Seconds this rank waited for its batches since the last step (the session's loader measures it)."""
        take = getattr(self._state.tracked.get("data"), "take_wait_seconds", None)
        return take() if take is not None else 0.0

    def _samples_per_step(self) -> int | None:
        """Samples in one optimizer step over all ranks, from the session's loader (None without one)."""
        sampler = getattr(self._state.tracked.get("data"), "sampler", None)
        if sampler is None:
            return None
        return sampler.batch_size * self.world_size * self.spec.train.grad_accumulation

    def _save_now(self, metrics: dict | None) -> SaveResult | None:
        """A just-in-time checkpoint: after the save in flight, one of this step, waited for."""
        self._saves.wait()
        self.checkpoint(metrics, asynchronous=False, reason="just-in-time")
        return self._saves.wait()

    def drain_reports(self) -> None:
        """Wait until Ray has been told of every committed checkpoint (the worker entry, when the job's function
        returns without finish(); the benchmark harness between blocks). Every rank queues the same reports
        (rank 0 decides which), so every rank makes the same ray.train.report calls before it leaves."""
        self._saves.reports.drain()
