"""The digits job, slowed down per market (`config.on_demand_step_delay`, `config.spot_step_delay`: seconds per
step), so a test has time to return or reclaim spot capacity before the run ends. The delay changes no numbers:
the run trains exactly what jobs/digits_ddp.py trains."""

from __future__ import annotations

import time

from elastic.worker.entrypoint import resolve_entrypoint


def train(session) -> None:
    delay = float(session.config.get(f"{(session.market or 'unknown').replace('-', '_')}_step_delay", 0.0))
    if delay:
        session.add_step_hook(lambda step, metrics: time.sleep(delay))
    resolve_entrypoint("jobs/digits_ddp.py:train")(session)
