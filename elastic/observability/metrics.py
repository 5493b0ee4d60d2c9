"""A run's metrics through `ray.util.metrics`: they leave by Ray's own Prometheus export (every node's metrics
agent; Prometheus finds the agents through Ray's service-discovery file), next to Ray Train's own series, which
are not repeated here. Ray prefixes every name with `ray_`; counters end in `_total`.

Every series carries the run name (`run`); GPU series also the worker's rank, placement series the market.
`RunMetrics` emits; `NoMetrics` is the null object used where metrics are off (unit tests, bare checkpointers).
The names are listed in METRIC_NAMES, and the Grafana dashboard and alert rules under deploy/ use them."""

from __future__ import annotations

import os

from ray.util.metrics import Counter, Gauge, Histogram

STEP_SECONDS_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
CHECKPOINT_SECONDS_BOUNDARIES = [0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0]

# As Prometheus sees them (Ray's prefix; counters with _total, histograms with _bucket/_sum/_count).
METRIC_NAMES = {
    "steps": "ray_elastic_steps_total",
    "step": "ray_elastic_step",
    "samples_per_second": "ray_elastic_samples_per_second",
    "step_seconds": "ray_elastic_step_seconds",
    "checkpoint_save_seconds": "ray_elastic_checkpoint_save_seconds",
    "checkpoint_stall_seconds": "ray_elastic_checkpoint_stall_seconds",
    "last_checkpoint_save": "ray_elastic_last_checkpoint_save_seconds",
    "last_checkpoint_stall": "ray_elastic_last_checkpoint_stall_seconds",
    "last_checkpoint": "ray_elastic_last_checkpoint_timestamp_seconds",
    "checkpoint_interval": "ray_elastic_checkpoint_interval_seconds",
    "lost_steps": "ray_elastic_lost_steps_total",
    "preemptions": "ray_elastic_preemptions_total",
    "placement_workers": "ray_elastic_placement_workers",
    "goodput": "ray_elastic_goodput",
    "gpu_utilization": "ray_elastic_gpu_utilization",
    "gpu_memory": "ray_elastic_gpu_memory_bytes",
}


class NoMetrics:
    """Metrics off: every call does nothing."""

    enabled = False

    def steps(self, count: int, step: int, seconds: list[float], samples_per_second: float | None) -> None: ...

    def goodput(self, value: float) -> None: ...

    def data_wait(self, seconds: float) -> None: ...

    def checkpoint_committed(self, save_seconds: float, stall_seconds: float, committed_at: float) -> None: ...

    def checkpoint_interval(self, seconds: float) -> None: ...

    def lost_steps(self, count: int) -> None: ...

    def preemption(self) -> None: ...

    def placement(self, market: str, workers: int) -> None: ...

    def gpu(self, rank: int, utilization: float, memory_bytes: float) -> None: ...


class RunMetrics(NoMetrics):
    """One run's series. Built once per process (Ray registers each metric name once per process)."""

    enabled = True

    def __init__(self, run_name: str):
        self.run_name = run_name
        self._tags = {"run": run_name}
        run = ("run",)
        self._steps = Counter("elastic_steps", "Optimizer steps taken (rank 0), re-done ones included.", run)
        self._step = Gauge("elastic_step", "The run's current optimizer step (rank 0).", run)
        self._samples = Gauge("elastic_samples_per_second", "Samples per second over all workers (rank 0).", run)
        self._step_seconds = Histogram(
            "elastic_step_seconds",
            "Seconds from one optimizer step to the next (rank 0).",
            STEP_SECONDS_BOUNDARIES,
            run,
        )
        self._save = Histogram(
            "elastic_checkpoint_save_seconds",
            "Seconds from a checkpoint's start to its commit (rank 0).",
            CHECKPOINT_SECONDS_BOUNDARIES,
            run,
        )
        self._stall = Histogram(
            "elastic_checkpoint_stall_seconds",
            "Seconds the training loop was blocked by a checkpoint (rank 0).",
            CHECKPOINT_SECONDS_BOUNDARIES,
            run,
        )
        # The last commit's save and stall as gauges too: checkpoints are minutes apart, so a histogram's rate
        # over a dashboard window is mostly empty, while a gauge steps at each commit and holds between them.
        self._last_save = Gauge(
            "elastic_last_checkpoint_save_seconds", "The last committed checkpoint's save time (rank 0).", run
        )
        self._last_stall = Gauge(
            "elastic_last_checkpoint_stall_seconds", "How long the last checkpoint blocked the loop (rank 0).", run
        )
        self._last_checkpoint = Gauge(
            "elastic_last_checkpoint_timestamp_seconds", "Unix time of the last committed checkpoint.", run
        )
        self._interval = Gauge(
            "elastic_checkpoint_interval_seconds",
            "Expected seconds between checkpoints (checkpoint.every_seconds, or every_steps at the measured step time).",
            run,
        )
        self._lost = Counter("elastic_lost_steps", "Steps taken, then lost to a restart and re-done.", run)
        self._preemptions = Counter("elastic_preemptions", "Placements ended by a spot reclaim notice.", run)
        self._placement = Gauge(
            "elastic_placement_workers", "Workers of the run's current placement, by market.", ("run", "market")
        )
        self._goodput = Gauge("elastic_goodput", "Productive step time over wall time since the run's start.", run)
        self._data_wait = Counter(
            "elastic_data_wait_seconds", "Seconds the training loop waited for its batches (rank 0).", run
        )
        self._gpu_utilization: Gauge | None = None  # made on the first GPU sample: absent on CPU nodes
        self._gpu_memory: Gauge | None = None
        self._markets: set[str] = set()

    def steps(self, count: int, step: int, seconds: list[float], samples_per_second: float | None) -> None:
        """`count` steps taken since the last call, the current step, their step times."""
        if count > 0:
            self._steps.inc(float(count), self._tags)
        self._step.set(step, self._tags)
        for value in seconds:
            self._step_seconds.observe(value, self._tags)
        if samples_per_second is not None:
            self._samples.set(samples_per_second, self._tags)

    def goodput(self, value: float) -> None:
        self._goodput.set(value, self._tags)

    def data_wait(self, seconds: float) -> None:
        self._data_wait.inc(seconds, self._tags)

    def checkpoint_committed(self, save_seconds: float, stall_seconds: float, committed_at: float) -> None:
        self._save.observe(save_seconds, self._tags)
        self._stall.observe(stall_seconds, self._tags)
        self._last_save.set(save_seconds, self._tags)
        self._last_stall.set(stall_seconds, self._tags)
        self._last_checkpoint.set(committed_at, self._tags)

    def checkpoint_interval(self, seconds: float) -> None:
        self._interval.set(seconds, self._tags)

    def lost_steps(self, count: int) -> None:
        if count > 0:
            self._lost.inc(float(count), self._tags)

    def preemption(self) -> None:
        self._preemptions.inc(1.0, self._tags)

    def placement(self, market: str, workers: int) -> None:
        """The current placement's size; other markets this run was placed on drop to 0."""
        self._markets.add(market)
        for other in self._markets:
            self._placement.set(workers if other == market else 0, {"run": self.run_name, "market": other})

    def gpu(self, rank: int, utilization: float, memory_bytes: float) -> None:
        if self._gpu_utilization is None:
            self._gpu_utilization = Gauge(
                "elastic_gpu_utilization", "GPU utilization (0-1) of a worker's device, from NVML.", ("run", "rank")
            )
            self._gpu_memory = Gauge(
                "elastic_gpu_memory_bytes", "GPU memory used by a worker's process, from NVML.", ("run", "rank")
            )
        tags = {"run": self.run_name, "rank": str(rank)}
        self._gpu_utilization.set(utilization, tags)
        self._gpu_memory.set(memory_bytes, tags)


def run_metrics(run_name: str) -> NoMetrics:
    """The run's metrics in a Ray process; off (NoMetrics) where `ELASTIC_METRICS=0` is set."""
    if os.environ.get("ELASTIC_METRICS", "1") == "0":
        return NoMetrics()
    return RunMetrics(run_name)
