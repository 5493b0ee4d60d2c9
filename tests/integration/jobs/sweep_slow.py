"""The digits job with a fixed delay per optimizer step (`config.step_delay`), so a sweep's progress is paced by
the clock rather than by how busy the machine is (the resume test interrupts the sweep mid-run)."""

from __future__ import annotations

import time

from elastic.worker.entrypoint import resolve_entrypoint


def train(session) -> None:
    delay = float(session.config.get("step_delay", 0.0))
    step = session.step

    def slow_step(metrics=None):
        time.sleep(delay)
        step(metrics)

    session.step = slow_step  # session.optimize calls self.step
    resolve_entrypoint("jobs/digits_ddp.py:train")(session)
