"""The low-utilization watch (elastic.observability.utilization): once per stretch under the threshold."""

from __future__ import annotations

import pytest

from elastic.observability.utilization import LowUtilizationWatch


def feed(watch, samples):
    return [t for t, u in samples if watch.observe(t, u)]


def test_fires_once_after_a_whole_window_under_the_threshold():
    watch = LowUtilizationWatch(threshold=0.7, window_seconds=600)
    fired = feed(watch, [(t, 0.35) for t in range(0, 1300, 5)])
    assert fired == [600]
    assert watch.mean_while_low == pytest.approx(0.35)


def test_a_sample_at_the_threshold_resets_the_window_and_rearms():
    watch = LowUtilizationWatch(threshold=0.7, window_seconds=600)
    samples = [(t, 0.5) for t in range(0, 500, 5)] + [(500, 0.7)] + [(t, 0.5) for t in range(505, 1200, 5)]
    assert feed(watch, samples) == [1105]  # 600 s after the stretch that began at 505
    assert feed(watch, [(1200, 0.9), *[(t, 0.1) for t in range(1205, 1900, 5)]]) == [1805]


def test_never_fires_while_utilization_is_high():
    watch = LowUtilizationWatch()
    assert feed(watch, [(t, 0.82) for t in range(0, 3600, 5)]) == []
