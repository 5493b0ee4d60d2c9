"""Sharded, asynchronous checkpoints of a state dict from every rank straight to the checkpoint URI (DCP over
elastic.checkpoint.dcp_io's object-store I/O), committed through elastic.checkpoint.store's marker."""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from elastic.checkpoint.dcp_io import storage_reader, storage_writer
from elastic.checkpoint.store import ATTACHED, CheckpointStore

log = logging.getLogger(__name__)

LOAD_ATTEMPTS = 2  # reads of one checkpoint before a restore falls back to the one before it
LOAD_RETRY_SECONDS = 2.0


@dataclass
class SaveResult:
    step: int
    committed: bool
    blocked_seconds: float  # the training loop's stall: staging to host memory
    total_seconds: float
    attempts: int
    error: str | None = None
    files: dict[str, int] = field(default_factory=dict)  # rank 0: the committed files and sizes (the manifest's)


def _describe_failure(err: BaseException) -> str:
    """One line naming the cause. DCP's CheckpointException prints only "ranks:dict_keys([1])" on its first
    line; the failing ranks' own exceptions are in `failures`."""

    def one_line(error: BaseException) -> str:
        text = str(error).strip()
        return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"[:300]

    if isinstance(err, CheckpointException) and err.failures:
        return "; ".join(f"rank {rank}: {one_line(cause)}" for rank, (cause, _trace) in sorted(err.failures.items()))
    return one_line(err)


class ShardedCheckpointer:
    """DCP saves of a state dict from every rank straight to the store, async with at most one in flight.

    Collectives of the background save run on a process group of their own, so they never interleave with
    the training loop's DDP all-reduces on the default group.
    """

    def __init__(
        self,
        store: CheckpointStore,
        rank: int,
        world_size: int,
        process_group=None,
        retries: int = 3,
        backoff_seconds: float = 1.0,
        on_commit: Callable[[SaveResult], None] | None = None,
        io_threads: int = 8,
        on_failure: Callable[[SaveResult], None] | None = None,
    ):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.group = process_group
        self.retries = retries
        self.backoff_seconds = backoff_seconds
        self.on_commit = on_commit
        self.on_failure = on_failure  # after a save has failed for good (every retry spent), in its thread
        # Parallel uploads per rank: DCP splits the rank's share into this many files, written concurrently
        # (one multipart stream each); a single stream left object stores at a quarter of their bandwidth.
        self.io_threads = io_threads
        # Fault injection (elastic.worker.chaos): called with (step, "write") before this rank writes its shard and
        # (step, "commit") on rank 0 before the marker.
        self.fault_hook: Callable[[int, str], None] = lambda step, phase: None
        self._in_flight: Future | None = None
        self._buffers: dict | None = None  # staging memory, reused between saves
        self._staged: threading.Event | None = None  # set once the save in flight has copied all its tensors
        self._waited = 0.0  # seconds the loop waited in wait_staged() for the save in flight
        self._reason = "periodic"  # why the save in flight (at most one) was asked for: goes in its marker
        self._attach: str | None = None  # the save in flight's attached folder (see save)
        self.results: list[SaveResult] = []

    # -- save
    def save(
        self,
        step: int,
        state: dict[str, Any],
        asynchronous: bool = True,
        deferrable: Callable[[Any], bool] | None = None,
        reason: str = "periodic",
        attach: str | None = None,
    ) -> Future:
        """Stage `state` to host memory, then write and commit it in the background.

        With `attach` (synchronous saves; every rank passes it alike: a local folder, or "" when this rank has
        none), each rank also uploads that folder's files under `ATTACHED/` in the checkpoint, listed in the
        marker like the shards: a Ray Train function's reported checkpoint folder rides with the run's state.

        With `deferrable` (async only), tensors it accepts (parameters and optimizer state: changed only by
        optimizer.step) are copied by the background thread instead, overlapping the next step's forward and
        backward; the caller must call `wait_staged()` before the next optimizer step (the session does so
        from an optimizer step pre-hook). Everything else is staged before this returns."""
        previous = self.wait()  # at most one in flight: a second save waits for the first
        del previous
        if attach is not None and asynchronous:
            raise ValueError("an attached folder is saved synchronously: its owner may delete it once save returns")
        self._reason = reason
        self._attach = attach
        started = time.perf_counter()
        copies: list[tuple[Any, Any]] = []
        if asynchronous:
            self._buffers = _stage_into(state, self._buffers, deferrable, copies)
            staged = self._buffers
        else:
            staged = state  # the caller waits for the write: nothing can change under it, so no copy
        blocked = time.perf_counter() - started
        self._staged = threading.Event()
        self._waited = 0.0
        event = self._staged
        future: Future = Future()

        def work() -> None:
            try:
                for buffer, source in copies:
                    buffer.copy_(source)
            finally:
                event.set()
            try:
                future.set_result(self._write_and_commit(step, staged, blocked, started))
            except BaseException as err:  # surfaced through the future to the caller
                future.set_exception(err)

        self._in_flight = future  # synchronous saves too: wait() hands back their result
        if asynchronous:
            threading.Thread(target=work, name=f"elastic-ckpt-{step}", daemon=True).start()
        else:
            work()
        return future

    def wait_staged(self) -> None:
        """Block until the save in flight has copied every deferred tensor (no-op when nothing is pending)."""
        if self._staged is not None and not self._staged.is_set():
            started = time.perf_counter()
            self._staged.wait()
            self._waited += time.perf_counter() - started

    def wait(self) -> SaveResult | None:
        """Block until the save in flight (if any) has committed or failed."""
        if self._in_flight is None:
            return None
        future, self._in_flight = self._in_flight, None
        return future.result()

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None and not self._in_flight.done()

    def _write_and_commit(self, step: int, staged: dict, blocked: float, started: float) -> SaveResult:
        error = None
        for attempt in range(1, self.retries + 2):
            ok, error, files = self._attempt(step, staged)
            # Every rank must agree on the outcome, or one rank would retry a collective save alone.
            if self._all_ranks_agree(ok):
                result = SaveResult(
                    step, True, blocked + self._waited, time.perf_counter() - started, attempt, files=files
                )
                self.results.append(result)
                if self.on_commit:
                    self.on_commit(result)
                return result
            error = error or "another rank's save or the commit failed"
            log.warning("checkpoint step %d attempt %d failed: %s", step, attempt, error)
            if attempt <= self.retries:
                time.sleep(self.backoff_seconds * 2 ** (attempt - 1))
        result = SaveResult(step, False, blocked + self._waited, time.perf_counter() - started, self.retries + 1, error)
        self.results.append(result)
        if self.on_failure:
            self.on_failure(result)
        return result

    def _attempt(self, step: int, staged: dict) -> tuple[bool, str | None, dict[str, int]]:
        try:
            writer = storage_writer(
                self.store.uri(step),
                self.store.location.is_object_store,
                self.threads_for(staged),
                **self.store.writer_options(),
            )
            self.fault_hook(step, "write")
            attached = self._upload_attached(step) if self._attach is not None else None
            dcp.save(staged, storage_writer=writer, process_group=self.group)
            # dcp.save returns on rank 0 only after gathering every rank's write results and writing
            # .metadata, so every shard is durable here: commit.
            written = getattr(writer, "file_sizes", None)
            if attached is not None:
                everyone: list[dict[str, int]] = [attached]
                if self.group is not None and dist.is_initialized():
                    everyone = [{} for _ in range(self.world_size)]
                    dist.all_gather_object(everyone, attached, group=self.group)
                if written is not None:
                    written = {**written, **{name: size for part in everyone for name, size in part.items()}}
            files: dict[str, int] = {}
            if self.rank == 0:
                self.fault_hook(step, "commit")
                files = self.store.commit(step, self.world_size, extra={"reason": self._reason}, files=written).files
            return True, None, files
        # DCP raises CheckpointException (a BaseException) alike on every rank; storage errors vary by backend.
        except (Exception, CheckpointException) as err:
            return False, _describe_failure(err), {}

    def _upload_attached(self, step: int) -> dict[str, int]:
        """This rank's attached folder, uploaded under ATTACHED/ in the checkpoint: name -> size."""
        if not self._attach:
            return {}
        root = Path(self._attach)
        local = sorted(p for p in root.rglob("*") if p.is_file())
        names = [f"{ATTACHED}/{p.relative_to(root).as_posix()}" for p in local]
        if local:
            base = self.store.path(step)
            self.store.fs.put([str(p) for p in local], [f"{base}/{name}" for name in names])
        return {name: p.stat().st_size for name, p in zip(names, local)}

    def threads_for(self, state: dict) -> int:
        """Files (and parallel uploads) for this rank: one per ~16 MB of its share, up to io_threads. Small
        states stay one file per rank; each extra object costs a request."""
        share = _tensor_bytes(state) / max(1, self.world_size)
        return max(1, min(self.io_threads, int(share // (16 * 1024 * 1024))))

    def _all_ranks_agree(self, ok: bool) -> bool:
        if self.group is None or not dist.is_initialized():
            return ok
        flag = torch.tensor([1 if ok else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    # -- load
    def load_newest(self, steps: list[int], template: Callable[[], dict[str, Any]]) -> tuple[int, dict[str, Any]]:
        """Load the newest of `steps` (committed checkpoints, any order) that can be read, into a fresh
        `template()` each try: when one cannot be read (its objects unreachable, or damaged), fall back to the
        one before it, with a log line. Every rank must pass the same steps: each load is collective, and DCP
        fails it on every rank alike. Raises the last error when none can be read."""
        newest_first = sorted(steps, reverse=True)
        for index, step in enumerate(newest_first):
            for attempt in range(1, LOAD_ATTEMPTS + 1):
                try:
                    return step, self.load(step, template())
                except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
                    failure = _describe_failure(err)
                    if attempt < LOAD_ATTEMPTS:
                        # A fall back retires this checkpoint for good: a passing fault (a slow or restarting
                        # store) must not cost the run its newest progress, so read it once more first.
                        log.warning("restore: checkpoint at step %d: %s; reading it once more", step, failure)
                        time.sleep(LOAD_RETRY_SECONDS)
                        continue
                    if index + 1 == len(newest_first):
                        raise
                    log.warning(
                        "restore: checkpoint at step %d cannot be read (%s); falling back to the one before it, "
                        "step %d",
                        step,
                        failure,
                        newest_first[index + 1],
                    )
        raise ValueError("load_newest needs at least one step")

    def load(self, step: int, state: dict[str, Any]) -> dict[str, Any]:
        """Fill `state` (a template with the tensors to load) from checkpoint `step`; reshards as needed."""
        reader = storage_reader(
            self.store.uri(step),
            self.store.location.is_object_store,
            process_group=self.group,
            **self.store.writer_options(),
        )
        dcp.load(state, storage_reader=reader, process_group=self.group)
        return state


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, DTensor):  # this rank's shard
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _stage_into(
    value: Any, buffer: Any, deferrable: Callable[[Any], bool] | None = None, copies: list | None = None
) -> Any:
    """Copy tensors into host buffers the loop will not touch (training keeps updating the originals).

    Buffers are reused between saves, so after the first save staging is a memcpy per tensor. Tensors that
    `deferrable` accepts get their buffer now and their copy queued in `copies` for the background thread.
    A DTensor (FSDP2) stages its local shard only, and stays a DTensor of the same layout, so each rank writes
    its own shards."""
    if isinstance(value, DTensor):
        shard = _stage_into(
            value.to_local(),
            buffer.to_local() if isinstance(buffer, DTensor) else None,
            (lambda _: deferrable(value)) if deferrable is not None else None,
            copies,
        )
        return DTensor.from_local(
            shard, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
        )
    if isinstance(value, torch.Tensor):
        source = value.detach()
        if (
            isinstance(buffer, torch.Tensor)
            and buffer.shape == source.shape
            and buffer.dtype == source.dtype
            and buffer.device.type == "cpu"
        ):
            staged = buffer
        else:
            staged = torch.empty(
                source.shape, dtype=source.dtype, device="cpu", pin_memory=source.is_cuda and torch.cuda.is_available()
            )
        if deferrable is not None and copies is not None and deferrable(value):
            copies.append((staged, source))
            return staged
        return staged.copy_(source)
    if isinstance(value, dict):
        previous = buffer if isinstance(buffer, dict) else {}
        return {key: _stage_into(item, previous.get(key), deferrable, copies) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        previous = buffer if isinstance(buffer, (list, tuple)) and len(buffer) == len(value) else [None] * len(value)
        return type(value)(_stage_into(item, old, deferrable, copies) for item, old in zip(value, previous))
    return copy.deepcopy(value)
