"""Telling Ray Train of committed checkpoints, from a thread of its own.

Ray Train's report is a barrier across workers through an actor and waits for the controller to take the
previous one; it was seen taking 1.8 s on a busy machine, longer than the time between saves. Neither the
training loop nor the next save waits for it. When the reporter is still busy with an earlier report, a commit
is not reported (a newer one will be; the ending checkpoint always is): a queue that only grows would delay
the final and just-in-time reports by minutes. Whether to report is rank 0's call, broadcast on the checkpoint
group, because the report is a collective every rank must make for the same checkpoint.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from elastic.checkpoint.checkpointer import SaveResult
from elastic.checkpoint.store import CheckpointStore
from elastic.worker import in_process


class CommitReports:
    """The metrics of saves not yet reported, and the reporter thread that reports their commits to Ray.

    `report_every_commit` (sweep trials: every commit is a Tune iteration, ASHA's rungs count them) makes it
    queue every commit instead of passing over those that arrive while the reporter is busy."""

    def __init__(self, rank: int, group, storage, on_reported: Callable[[float], None] = lambda seconds: None):
        self.rank = rank
        self._group = group  # the checkpoint group (gloo), or None without torch.distributed
        self._storage = storage  # Ray Train's StorageContext: where Ray expects the checkpoint folders
        self._on_reported = on_reported
        self.report_every_commit = False
        self._lock = threading.Lock()  # _unreported is shared by the save's, the reporter's and the loop's threads
        self._unreported: dict[int, dict] = {}
        self._skipped: SaveResult | None = None  # the newest commit not reported (the reporter was busy)
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        threading.Thread(target=self._loop, name="elastic-report", daemon=True).start()

    def expect(self, step: int, metrics: dict | None) -> None:
        """A save of `step` has started: report it with `metrics` once it commits."""
        with self._lock:
            self._unreported[step] = {"step": step, **(metrics or {})}

    def metrics(self, step: int) -> dict:
        with self._lock:
            return self._unreported.get(step, {"step": step})

    def carry(self, step: int, metrics: dict) -> bool:
        """Let the save of `step`, if not reported yet, carry `metrics` instead. Returns whether it will."""
        with self._lock:
            if step not in self._unreported:
                return False
            self._unreported[step] = metrics
            return True

    def forget(self, step: int) -> None:
        """The save of `step` failed (or was passed over): nothing to report."""
        with self._lock:
            self._unreported.pop(step, None)

    def committed(self, result: SaveResult) -> None:
        """On every rank, in the save's thread: queue the commit's report, or pass it over (reporter busy)."""
        if self.report_every_commit or self._reporter_free():
            self._skipped = None
            self._queue.put(result)
        else:
            self.forget(result.step)
            self._skipped = result

    def report_ending(self, step: int, metrics: dict) -> bool:
        """Before a run or placement ends at the checkpoint of `step`, just committed: make sure Ray is told of
        it (also if it was passed over while the reporter was busy) and wait until it has been. Returns True if
        that checkpoint had been passed over and was reported here with `metrics`."""
        skipped = self._skipped
        requeue = skipped is not None and skipped.step == step
        if requeue:
            with self._lock:
                self._unreported[skipped.step] = metrics
            self._skipped = None
            self._queue.put(skipped)
        self.drain()
        return requeue

    def agree(self, flag: bool) -> bool:
        """Rank 0's `flag` on every rank. Whatever decides how many times a rank calls ray.train.report (a
        barrier) must be this: a rank-local answer (has my reporter thread sent that report yet?) differs
        between ranks by timing, and one rank waits forever in a report the others never make."""
        value = torch.tensor([1 if flag else 0])
        if self._group is not None:
            dist.broadcast(value, src=0, group=self._group)
        return bool(value.item())

    def drain(self) -> None:
        """Wait until Ray has been told of every committed checkpoint; raise the reporter's error, if any."""
        self._queue.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _reporter_free(self) -> bool:
        free = torch.tensor([0 if self._queue.unfinished_tasks else 1])
        if self._group is not None:
            dist.broadcast(free, src=0, group=self._group)
        return bool(free.item())

    def _loop(self) -> None:
        while True:
            result = self._queue.get()
            try:
                self._report(result)
            except BaseException as err:  # kept for the next drain: the training thread raises it
                self._error = err
            finally:
                self._queue.task_done()

    def _report(self, result: SaveResult) -> None:
        """Tell Ray Train of a committed checkpoint (already written: no upload). All ranks call this."""
        from ray.train import Checkpoint, CheckpointUploadMode  # deferred: unit tests build this without Ray

        with self._lock:
            metrics = self._unreported.pop(result.step, None)
        if metrics is None:
            return
        name = CheckpointStore.folder_name(result.step)
        checkpoint = None
        if self.rank == 0:
            checkpoint = Checkpoint(
                self._storage.build_checkpoint_path_from_name(name), filesystem=self._storage.storage_filesystem
            )
        started = time.monotonic()
        ray_report(
            metrics,
            checkpoint=checkpoint,
            checkpoint_dir_name=name,
            checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
        )
        self._on_reported(time.monotonic() - started)


def ray_report(*args, **kwargs) -> None:
    """Ray Train's own report, also while an `api: ray-train` function runs with ray.train.report routed
    through the session (elastic.adapters.ray_train)."""
    import ray.train

    if in_process.report_in_process(args[0] if args else kwargs["metrics"], kwargs.get("checkpoint")):
        return  # a light trial: to Tune (Ray Train's report is refused inside a Tune trainable)
    report = getattr(ray.train.report, "elastic_original", ray.train.report)
    report(*args, **kwargs)
