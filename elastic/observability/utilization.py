"""The low-utilization watch: GPU utilization under a threshold for a whole window (the Prometheus alert
`ElasticLowGpuUtilization` says the same from the exported series). Pure: fed (time, utilization) samples."""

from __future__ import annotations

LOW_UTILIZATION_THRESHOLD = 0.70  # the seeds' threshold, also in the alert rules
LOW_UTILIZATION_WINDOW_SECONDS = 600.0


class LowUtilizationWatch:
    """`observe(now, utilization)` returns True once per low stretch: when every sample for `window_seconds`
    has been under `threshold`. A sample at or above it ends the stretch (and re-arms the watch)."""

    def __init__(
        self, threshold: float = LOW_UTILIZATION_THRESHOLD, window_seconds: float = LOW_UTILIZATION_WINDOW_SECONDS
    ):
        self.threshold = threshold
        self.window_seconds = window_seconds
        self._low_since: float | None = None
        self._fired = False
        self.mean_while_low = 0.0
        self._samples: list[float] = []

    def observe(self, now: float, utilization: float) -> bool:
        if utilization >= self.threshold:
            self._low_since, self._fired, self._samples = None, False, []
            return False
        if self._low_since is None:
            self._low_since = now
        self._samples.append(utilization)
        if self._fired or now - self._low_since < self.window_seconds:
            return False
        self._fired = True
        self.mean_while_low = sum(self._samples) / len(self._samples)
        return True
