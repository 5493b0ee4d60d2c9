"""The session's metrics (elastic.observability): rank 0's step, checkpoint and goodput series from the
session's step hook and commit callback, every rank's GPU utilization and memory (NVML, GPU nodes only), the
low-utilization log line, and the steps a restart lost.

The step hook only does arithmetic; a background thread hands the steps to Ray's metrics once a second
(recording a metric costs tens of microseconds: off the training loop's thread).

Lost steps: rank 0 keeps a progress mark in the run folder (`elastic-progress.json`, the step reached, written
by a background thread at most every PROGRESS_SECONDS), and the next session that restores the run counts the
steps between the checkpoint it resumed from and that mark. A mark can be up to PROGRESS_SECONDS behind the
step a killed worker reached, so the count is a lower bound."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from elastic.checkpoint.checkpointer import SaveResult
from elastic.checkpoint.store import CheckpointStore
from elastic.config.spec import CheckpointSpec
from elastic.observability.goodput import GoodputClock
from elastic.observability.gpu import NvmlSampler
from elastic.observability.metrics import NoMetrics
from elastic.observability.utilization import LowUtilizationWatch

_log = logging.getLogger(__name__)

PROGRESS_FILE = "elastic-progress.json"
PROGRESS_SECONDS = 1.0  # one small PUT a second from rank 0 while steps advance
GPU_SAMPLE_SECONDS = 5.0


class Telemetry:
    """Created by the Session; `on_step` is a step hook, `on_commit` is called for each committed checkpoint,
    `resumed` once the session restored (or found nothing to restore)."""

    def __init__(
        self,
        metrics: NoMetrics,
        rank: int,
        checkpoint: CheckpointSpec,
        store: CheckpointStore | None,
        samples_per_step: Callable[[], int | None],
        gpu: NvmlSampler | None = None,
        low_utilization: LowUtilizationWatch | None = None,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.metrics = metrics
        self.rank = rank
        self.goodput = GoodputClock()  # tracked by the session: kept in the checkpoint
        self.goodput.start(wall_clock())
        self._every_steps, self._every_seconds = checkpoint.every_steps, checkpoint.every_seconds
        self._store = store
        self._samples_per_step = samples_per_step
        self._gpu = gpu
        self._low = low_utilization or LowUtilizationWatch()
        self._wall_clock, self._clock = wall_clock, clock
        self._last_step_at: float | None = None
        self._step_seconds: deque[float] = deque()  # measured by the loop, published by the thread
        self._steps_taken = 0
        self._published_steps = 0
        self._data_wait = 0.0  # seconds the loop waited for batches, not yet published
        self._samples_per_second: float | None = None
        self._mean_step_seconds: float | None = None
        self.step = 0
        self._marked = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def chief(self) -> bool:
        return self.rank == 0

    def start(self) -> None:
        """The background thread: rank 0's progress mark, and GPU samples where there is a GPU."""
        if (self.chief and self.metrics.enabled) or self._gpu is not None:
            self._thread = threading.Thread(target=self._background, name="elastic-telemetry", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def publish(self) -> None:
        """Rank 0: the steps since the last call and goodput so far, to Ray's metrics (the thread's work)."""
        seconds = [self._step_seconds.popleft() for _ in range(len(self._step_seconds))]
        taken = self._steps_taken
        count, self._published_steps = taken - self._published_steps, taken
        if count == 0:
            return
        self.metrics.steps(count, self.step, seconds, self._samples_per_second)
        waited, self._data_wait = self._data_wait, 0.0
        if waited > 0:
            self.metrics.data_wait(waited)
        goodput = self.goodput.goodput(self._wall_clock())
        if goodput is not None:
            self.metrics.goodput(goodput)

    def on_step(self, step: int, metrics: dict | None = None) -> None:
        self.step = step
        if not self.chief:
            return
        now = self._clock()
        seconds = None if self._last_step_at is None else now - self._last_step_at
        self._last_step_at = now
        self._steps_taken += 1
        if seconds is not None and seconds > 0:
            self.goodput.add_step(seconds)
            self._step_seconds.append(seconds)
            mean = self._mean_step_seconds
            self._mean_step_seconds = seconds if mean is None else 0.9 * mean + 0.1 * seconds
            samples = self._samples_per_step()
            if samples:
                self._samples_per_second = samples / seconds

    def waited_for_data(self, seconds: float) -> None:
        """Rank 0: the loop waited `seconds` for its batches this step (handed to Ray's metrics in the background)."""
        if self.chief and seconds > 0:
            self._data_wait += seconds

    def on_commit(self, result: SaveResult) -> None:
        if not self.chief:
            return
        self.goodput.add_stall(result.blocked_seconds)
        self.metrics.checkpoint_committed(result.total_seconds, result.blocked_seconds, self._wall_clock())
        interval = self._every_seconds
        if self._every_steps is not None and self._mean_step_seconds is not None:
            by_steps = self._every_steps * self._mean_step_seconds
            interval = by_steps if interval is None else min(interval, by_steps)
        if interval is not None:
            self.metrics.checkpoint_interval(interval)

    def resumed(self, restored_step: int) -> int:
        """Rank 0: count the steps the previous attempt reached beyond `restored_step` (0 elsewhere)."""
        self.step = self._marked = restored_step
        if not self.chief or self._store is None or not self.metrics.enabled:
            return 0
        reached = read_progress(self._store)
        lost = max(0, reached - restored_step) if reached is not None else 0
        if lost:
            _log.info("%d step(s) since the checkpoint of step %d were lost and will be re-done", lost, restored_step)
            self.metrics.lost_steps(lost)
        return lost

    def _background(self) -> None:
        next_gpu = next_mark = self._clock()
        while not self._stop.wait(1.0):
            now = self._clock()
            if self.chief and self.metrics.enabled:
                self.publish()
            if self._gpu is not None and now >= next_gpu:
                next_gpu = now + GPU_SAMPLE_SECONDS
                self._sample_gpu(now)
            if self.chief and self._store is not None and now >= next_mark and self.step != self._marked:
                next_mark = now + PROGRESS_SECONDS
                self._write_mark(self.step)

    def _sample_gpu(self, now: float) -> None:
        sample = self._gpu.sample()
        self.metrics.gpu(self.rank, sample.utilization, sample.memory_bytes)
        if self.chief and self._low.observe(now, sample.utilization):
            _log.warning(
                "low GPU utilization: under %.0f%% for %.0f minutes (mean %.0f%%); the run may be waiting on data, "
                "checkpoints or its neighbours",
                self._low.threshold * 100,
                self._low.window_seconds / 60,
                self._low.mean_while_low * 100,
            )

    def _write_mark(self, step: int) -> None:
        try:
            if not self._marked:
                self._store.fs.makedirs(self._store.root, exist_ok=True)  # local paths: before the first save
            self._store.fs.pipe_file(f"{self._store.root}/{PROGRESS_FILE}", json.dumps({"step": step}).encode())
            self._marked = step
        except OSError as err:  # a lost mark only makes the lost-step count a looser lower bound
            _log.debug("progress mark not written: %s", err)


def read_progress(store: CheckpointStore) -> int | None:
    path = f"{store.root}/{PROGRESS_FILE}"
    try:
        return int(json.loads(store.fs.cat_file(path))["step"])
    except (FileNotFoundError, KeyError, ValueError):
        return None
