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

import pickle
import queue
import random
import sys
import threading
import time
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from elastic.checkpoint.checkpointer import SaveResult, ShardedCheckpointer
from elastic.checkpoint.store import CheckpointStore, Retention
from elastic.config.spec import CheckpointSpec, JobSpec
from elastic.data import ResumableLoader, ResumableSampler
from elastic.placement.control import PlacementEnded
from elastic.placement.labels import MARKET_LABEL
from elastic.storage import parse_uri
from elastic.worker.audit import NoLedger, SampleLedger, audit_enabled, new_attempt_id
from elastic.worker.chaos import Chaos
from elastic.worker.jit import JustInTime, NoJustInTime, read_ray_notice
from elastic.worker.optimizer_step import (
    NonFiniteGuard,
    OptimizerStep,
    apply_activation_checkpointing,
    autocast,
    autocast_forward,
    grad_scaler,
)
from elastic.worker.placement_watch import placement_watch


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> Any: ...


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


class Session:
    """Per-worker view of the run. Created by the trainer on every worker; never by user code."""

    def __init__(self, spec: JobSpec, run_name: str, placement: dict | None = None):
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
        self._storage = context.get_storage()
        self.store = CheckpointStore(_run_uri(spec, self._storage))
        # Background saves run their collectives on a group of their own, apart from DDP's all-reduces.
        self._checkpoint_group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.checkpointer = ShardedCheckpointer(self.store, self.rank, self.world_size, self._checkpoint_group,
                                                on_commit=self._on_commit, on_failure=self._on_failed_save)
        self._retention = Retention(self.store, spec.checkpoint.keep, spec.checkpoint.keep_every)
        self._cadence = CheckpointCadence(spec.checkpoint)
        self._chaos = Chaos(self.store, self.rank)
        self.checkpointer.fault_hook = self._chaos.maybe_kill_in_save
        # The driver may ask this placement to end at a checkpoint (spot-first moving to spot, an elastic run
        # growing); a reclaim notice ends it at a just-in-time checkpoint.
        self._placement = placement_watch(placement, self.store.run_uri, self.rank)
        if self._placement.can_end:
            # Where every rank runs: the acknowledgement of an ended placement names them, so the driver can
            # start the next placement while this one's workers are still shutting down.
            nodes = [self.node_id]
            if self._checkpoint_group is not None:
                nodes = [None] * self.world_size
                dist.all_gather_object(nodes, self.node_id, group=self._checkpoint_group)
            self._placement.rank_nodes = nodes
        # Started ahead of a placement that is ending at a just-in-time checkpoint: nothing is read before
        # that checkpoint has committed (or the driver calls this placement off).
        if not self._placement.wait_for_predecessor():
            self.log("placement called off: the placement it was to follow went on")
            raise PlacementEnded(-1)
        self._jit = self._just_in_time(spec)
        self._ledger = SampleLedger(self.store.fs, self.store.root, self.rank, self.world_size, 0, attempt="") \
            if audit_enabled() else NoLedger()
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._tracked: dict[str, Stateful] = {}
        self._guard = NonFiniteGuard(spec.train.max_nonfinite_steps)
        self._optimizer_step: OptimizerStep | None = None
        # Metrics of saves not yet reported to Ray; a reporter thread tells Ray of each save once it commits.
        self._unreported: dict[int, dict] = {}
        self._skipped: SaveResult | None = None  # the newest commit not reported (the reporter was busy)
        # Sweep trials: every commit is a Tune iteration (ASHA's rungs count them), so none is passed over.
        self.report_every_commit = False
        self._report_lock = threading.Lock()
        self._reports: queue.Queue = queue.Queue()
        self._report_error: BaseException | None = None
        threading.Thread(target=self._report_loop, name="elastic-report", daemon=True).start()
        self._last_saved_step: int | None = None
        self.extras: dict[str, Any] = {}
        self.step_count = 0
        self.restored_step: int | None = None
        self.log(f"worker rank {self.rank}/{self.world_size} on node {self.node_id} market={self.market} "
                 f"device={self.device}", all_ranks=True)

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    # -- setup
    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, scheduler=None,
                checkpoint_layers=None):
        """Move to this worker's device, wrap in DDP (also at world size 1, so `model.module` always works)
        and register model, optimizer and LR scheduler for checkpointing. Build the optimizer over
        `model.parameters()` before calling.

        The spec's `train` section applies here: the forward runs under bf16/fp16 autocast (outputs come back
        as float32), and with `activation_checkpointing` the `checkpoint_layers` (a tuple of module types or a
        predicate; default: the model's direct children) recompute their activations in backward."""
        train = self.spec.train
        if train.activation_checkpointing:
            count = apply_activation_checkpointing(model, checkpoint_layers)
            self.log(f"activation checkpointing on {count} modules")
        model = model.to(self.device)
        autocast_forward(model, train.precision, self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
        self._model, self._optimizer = wrapped, optimizer
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
        self._tracked[name] = obj

    def loader(self, dataset, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
               **dataloader_kwargs):
        """An exactly-once, resumable loader over a map-style dataset for this rank (elastic.data), tracked
        so its position is checkpointed: after a restore at any worker count it continues where it was."""
        sampler = ResumableSampler(len(dataset), batch_size, self.rank, self.world_size, seed=seed,
                                   shuffle=shuffle, drop_last=drop_last)
        loader = ResumableLoader(dataset, sampler, observer=self._ledger.on_batch, **dataloader_kwargs)
        if isinstance(self._ledger, SampleLedger):
            self._ledger.num_samples = len(dataset)
        self.track("data", loader)
        return loader

    # -- restore
    def restore(self) -> int:
        """Load the latest committed checkpoint of this run, if any. Returns the step to continue from."""
        latest = self.store.latest_committed()
        if self.is_chief:
            # Torn saves newer than the latest commit (a crash mid-upload) would otherwise be reused by the
            # next save of the same step with stale shards in them.
            for info in self.store.list():
                if not info.committed and (latest is None or info.step > latest.step):
                    self.store.delete(info.step)
        if self._checkpoint_group is not None:
            dist.barrier(group=self._checkpoint_group)
        self._start_ledger(latest.step if latest is not None else 0)
        self._placement.running(self.world_size)
        if latest is None:
            return 0
        state = self._template()
        self.checkpointer.load(latest.step, state)
        self._apply(state)
        self.restored_step = self._last_saved_step = self.step_count
        self.log(f"resumed from checkpoint at step {self.step_count} ({latest.uri}, written by "
                 f"{latest.world_size} workers, now {self.world_size})")
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
                self.log(f"step {self.step_count + 1}: non-finite loss, step skipped "
                         f"({self._guard.in_a_row} in a row, {self._guard.skipped} in all)")
            self.step(metrics)
        return done

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because the loss was NaN/inf (restored with the checkpoint)."""
        return self._guard.skipped

    def step(self, metrics: dict | None = None) -> None:
        """Call once per optimizer step, on every rank. Checkpoints (asynchronously) when due."""
        self.step_count += 1
        self._ledger.on_step(self.step_count, metrics)
        self._chaos.maybe_kill(self.step_count)
        if self._jit.due(self.step_count):
            self._end_just_in_time(metrics)
        elif self._checkpoint_due():
            self.checkpoint(metrics)
            if self._placement.end_requested():
                self._end_placement()

    def checkpoint(self, metrics: dict | None = None, asynchronous: bool = True, reason: str = "periodic") -> None:
        """Save now (all ranks). Blocks only while state is copied to host memory. `reason` is recorded in the
        commit marker (`elastic checkpoints ls` shows it)."""
        self._log_failure(self.checkpointer.wait())  # at most one in flight
        self._ledger.flush(self.step_count)  # records cover every step a commit of this save includes
        with self._report_lock:
            self._unreported[self.step_count] = {"step": self.step_count, **(metrics or {})}
        self.checkpointer.save(self.step_count, self._state(), asynchronous=asynchronous,
                               deferrable=self._changed_only_by_optimizer(), reason=reason)
        self._last_saved_step = self.step_count
        self._cadence.saved()

    def finish(self, metrics: dict | None = None) -> None:
        """Final checkpoint, waited for and reported with `metrics`: call at the end of training on every rank."""
        final = {"step": self.step_count, **(metrics or {})}
        if self._last_saved_step != self.step_count:
            self.checkpoint(metrics, asynchronous=False, reason="final")
            self._raise_if_failed(self.checkpointer.wait())
            self._report_ending(final)
            return
        with self._report_lock:  # the last save is of this very step: let it carry the final metrics
            carried = self.step_count in self._unreported
            if carried:
                self._unreported[self.step_count] = final
        self._raise_if_failed(self.checkpointer.wait())
        if self._report_ending(final) or carried:
            return
        # Already reported (or resumed at the end of a finished run: nothing new to save, and Ray knows that
        # checkpoint). Report the metrics alone; never rewrite a committed folder in place.
        import ray.train

        ray.train.report(final)

    def all_reduce_sum(self, *values: float) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(tensor)
        return tensor.tolist()

    def log(self, message: str, all_ranks: bool = False) -> None:
        if all_ranks or self.is_chief:
            # Not print(): Ray Train patches it to log *and* tee to a wrapped stdout, so each line showed twice.
            sys.stdout.write(f"[elastic] {message}\n")
            sys.stdout.flush()

    # -- internals
    def _checkpoint_due(self) -> bool:
        due = self._cadence.due(self.step_count)
        if self._cadence.time_based and dist.is_initialized():
            # Clocks differ by rank; every rank must agree or the collective save would hang.
            flag = torch.tensor([1 if due else 0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            due = bool(flag.item())
        return due

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        state: dict[str, Any] = {}
        if self._model is not None:
            optimizers = [self._optimizer] if self._optimizer is not None else []
            model_state, optim_state = get_state_dict(self._model, optimizers)
            state["model"] = model_state
            if optimizers:
                state["optim"] = optim_state
        rng = [None] * self.world_size
        if dist.is_initialized():
            dist.all_gather_object(rng, capture_rng())
        else:
            rng = [capture_rng()]
        # One replicated blob for everything that is not a tensor: DCP writes it once.
        state["elastic"] = pickle.dumps({
            "step": self.step_count,
            "world_size": self.world_size,
            "rng": rng,
            "tracked": {name: obj.state_dict() for name, obj in self._tracked.items()},
            "extras": self.extras,
        })
        return state

    def _changed_only_by_optimizer(self):
        """Predicate for tensors an async save may copy after it returns: parameters and optimizer state,
        which change only in optimizer.step() (guarded by the pre-hook). Buffers (e.g. BatchNorm statistics,
        updated by forward) are staged before the save returns."""
        if self._model is None or self._optimizer is None:
            return None
        storages = {p.untyped_storage().data_ptr() for p in self._model.parameters()}
        for state in self._optimizer.state.values():
            storages |= {t.untyped_storage().data_ptr() for t in state.values() if isinstance(t, torch.Tensor)}
        return lambda tensor: tensor.untyped_storage().data_ptr() in storages

    def _template(self) -> dict:
        state = self._state()
        state["elastic"] = b""
        return state

    def _apply(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if self._model is not None:
            optimizers = [self._optimizer] if self._optimizer is not None else []
            set_state_dict(self._model, optimizers, model_state_dict=state["model"],
                           optim_state_dict=state.get("optim", {}))
        blob = pickle.loads(state["elastic"])
        self.step_count = int(blob["step"])
        for name, obj in self._tracked.items():
            if name in blob["tracked"]:
                obj.load_state_dict(blob["tracked"][name])
        self.extras = dict(blob["extras"])
        rng = blob["rng"]
        # Same world size: each rank continues its own random stream. Otherwise streams cannot map 1:1;
        # rank r takes saved stream r mod W so every rank is still deterministic.
        restore_rng(rng[self.rank % len(rng)])

    def _start_ledger(self, resumed_from: int) -> None:
        """Auditing only: every rank of this attempt files its records under one id, made by rank 0."""
        if not isinstance(self._ledger, SampleLedger):
            return
        attempt = [new_attempt_id()]
        if dist.is_initialized():
            dist.broadcast_object_list(attempt, src=0, group=self._checkpoint_group)
        self._ledger.attempt, self._ledger.resumed_from = attempt[0], resumed_from

    def _end_placement(self) -> None:
        """Wait for the checkpoint just started (reported once committed), and end this placement on every
        rank (the driver resumes the run from it elsewhere). A failed save keeps the placement: the next
        checkpoint tries again."""
        result = self.checkpointer.wait()
        self._log_failure(result)
        if result is None or not result.committed:
            return
        self._report_ending({"step": result.step})  # Ray knows this checkpoint before the placement ends
        reason = self._placement.acknowledge(result.step)
        self.log(f"placement ends at the checkpoint of step {result.step} ({reason})")
        raise PlacementEnded(result.step)

    def _just_in_time(self, spec: JobSpec):
        if not spec.checkpoint.just_in_time:
            return NoJustInTime()
        group = dist.new_group(backend="gloo") if dist.is_initialized() else None  # its own: never races saves
        return JustInTime(self.rank, group, spec.checkpoint.jit_margin_seconds, self.log,
                          in_flight=lambda: self.checkpointer.in_flight, on_notice=self._announce_end,
                          read_notice=self._chaos.notice_source(read_ray_notice))

    def _announce_end(self, notice, eta: float | None) -> None:
        """Rank 0, at a reclaim notice: tell the driver when this placement should end (in the background: a
        write to the run folder must not hold up a step). Without a deadline it ends at once anyway."""
        if eta is not None and self._placement.can_end:
            threading.Thread(target=self._placement.will_end, args=(eta,), name="elastic-ending",
                             daemon=True).start()

    def _end_just_in_time(self, metrics: dict | None) -> None:
        """A node of this run is being reclaimed and the deadline is near: save now (every rank), wait for the
        commit and Ray's report, and end the placement. The driver resumes the run from this checkpoint on the
        nodes that remain (or a replacement); no step taken is lost. If the save fails, training goes on and
        Ray's own restart from the last checkpoint remains."""
        started = time.monotonic()
        self._log_failure(self.checkpointer.wait())
        self.checkpoint(metrics, asynchronous=False, reason="just-in-time")
        result = self.checkpointer.wait()
        self._log_failure(result)
        if result is None or not result.committed:
            return
        self._report_ending({"step": result.step, **(metrics or {})})
        left = self._jit.seconds_to_deadline()
        self.log(f"just-in-time checkpoint at step {result.step} committed in {time.monotonic() - started:.2f} s"
                 + (f", {left:.1f} s before the deadline" if left is not None else "")
                 + "; ending this placement (no step lost)")
        if not self._placement.can_end:
            # No driver around this run to resume it: wait (no further steps, they would be lost) until Ray
            # Train tears the group down at the deadline and restarts it from this checkpoint.
            self.log("no elastic driver: waiting for Ray Train's restart from this checkpoint")
            while True:
                time.sleep(1.0)
        self._placement.acknowledge(result.step, reason="preemption")
        raise PlacementEnded(result.step)

    def _on_commit(self, result: SaveResult) -> None:
        """After a commit, on every rank, in the save's thread: log it, queue its report to Ray, prune (rank 0).

        Reports go through a thread of their own: Ray Train's report is a barrier across workers through an
        actor and waits for the controller to take the previous one; it was seen taking 1.8 s on a busy
        machine, longer than the time between saves. Neither the loop nor the next save waits for it. When the
        reporter is still busy with an earlier report, this commit is not reported (a newer one will be; the
        ending checkpoint always is): a queue that only grows would delay the final and just-in-time reports by
        minutes. Whether to report is rank 0's call, broadcast on the checkpoint group, because the report is a
        collective every rank must make for the same checkpoint."""
        self._jit.saved(result.total_seconds)
        with self._report_lock:
            metrics = self._unreported.get(result.step, {"step": result.step})
        self.log(f"checkpoint at step {result.step} committed (stall {result.blocked_seconds * 1000:.1f} ms, "
                 f"write {result.total_seconds:.2f} s): {_format(metrics)}")
        if self.report_every_commit or self._reporter_free():
            self._skipped = None
            self._reports.put(result)
        else:
            with self._report_lock:
                self._unreported.pop(result.step, None)
            self._skipped = result
        if self.is_chief:
            pruned = self._retention.committed(result.step, result.files)
            if pruned:
                self.log(f"retention: pruned checkpoints at steps {', '.join(map(str, pruned))}")

    def _on_failed_save(self, result: SaveResult) -> None:
        if self.is_chief:
            self._retention.failed(result.step)  # its torn folder goes once a newer save commits

    def _reporter_free(self) -> bool:
        free = torch.tensor([0 if self._reports.unfinished_tasks else 1])
        if self._checkpoint_group is not None:
            dist.broadcast(free, src=0, group=self._checkpoint_group)
        return bool(free.item())

    def _report_ending(self, metrics: dict) -> bool:
        """Before a run or placement ends at the checkpoint just committed: make sure Ray is told of it (also
        if it was passed over while the reporter was busy) and wait until it has been. Returns True if that
        checkpoint had been passed over and was reported here with `metrics`."""
        skipped = self._skipped
        requeue = skipped is not None and skipped.step == self.step_count
        if requeue:
            with self._report_lock:
                self._unreported[skipped.step] = metrics
            self._skipped = None
            self._reports.put(skipped)
        self._drain_reports()
        return requeue

    def _report_loop(self) -> None:
        while True:
            result = self._reports.get()
            try:
                self._report(result)
            except BaseException as err:  # kept for the next drain: the training thread raises it
                self._report_error = err
            finally:
                self._reports.task_done()

    def _drain_reports(self) -> None:
        """Wait until Ray has been told of every committed checkpoint."""
        self._reports.join()
        if self._report_error is not None:
            error, self._report_error = self._report_error, None
            raise error

    def _report(self, result: SaveResult) -> None:
        """Tell Ray Train of a committed checkpoint (already written: no upload). All ranks call this."""
        import ray.train
        from ray.train import Checkpoint, CheckpointUploadMode

        with self._report_lock:
            metrics = self._unreported.pop(result.step, None)
        if metrics is None:
            return
        name = CheckpointStore.folder_name(result.step)
        checkpoint = None
        if self.is_chief:
            checkpoint = Checkpoint(self._storage.build_checkpoint_path_from_name(name),
                                    filesystem=self._storage.storage_filesystem)
        started = time.monotonic()
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name,
                         checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
        self._jit.reported(time.monotonic() - started)

    def _log_failure(self, result: SaveResult | None) -> None:
        if result is not None and not result.committed:
            with self._report_lock:
                self._unreported.pop(result.step, None)
            self.log(f"checkpoint at step {result.step} FAILED after {result.attempts} attempts: {result.error}")

    def _raise_if_failed(self, result: SaveResult | None) -> None:
        if result is not None and not result.committed:
            self._log_failure(result)
            raise RuntimeError(f"final checkpoint at step {result.step} failed: {result.error}")


def _run_uri(spec: JobSpec, storage) -> str:
    """The run folder as a URI (same place Ray Train keeps the run), e.g. s3://bucket/runs/<run name>."""
    location = parse_uri(spec.checkpoint.uri)
    path = storage.experiment_fs_path
    return f"{location.scheme}://{path}" if location.is_object_store else path


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
