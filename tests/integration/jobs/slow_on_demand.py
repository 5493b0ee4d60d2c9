"""The digits job, slowed down while its workers run on on-demand nodes (`config.on_demand_step_delay` seconds
per step), so a test has time to return spot capacity before the run ends. The delay changes no numbers: the
run trains exactly what jobs/digits_ddp.py trains."""

from __future__ import annotations

import time

from elastic.worker.entrypoint import resolve_entrypoint


def train(session) -> None:
    delay = float(session.config.get("on_demand_step_delay", 0.0))
    if delay and session.market == "on-demand":
        step = session.step

        def slow_step(metrics=None):
            time.sleep(delay)
            step(metrics)

        session.step = slow_step  # session.optimize calls self.step
    resolve_entrypoint("jobs/digits_ddp.py:train")(session)
