"""The digits job, slowed down per market (`config.on_demand_step_delay`, `config.spot_step_delay`: seconds per
step), so a test has time to return or reclaim spot capacity before the run ends. With
`config.on_demand_hold_from_step` an on-demand placement also waits, from that step on, until a live spot node
is in the cluster: however slow the machine (or `local add-node`), the returned spot capacity lands mid-run.
Neither changes a number: the run trains exactly what jobs/digits_ddp.py trains."""

from __future__ import annotations

import logging
import time

from elastic.driver.capacity import observe_nodes
from elastic.placement.labels import MARKET_LABEL
from elastic.worker.entrypoint import resolve_entrypoint

logger = logging.getLogger("elastic.test_job")


def spot_node_alive() -> bool:
    """A live spot node that is not being reclaimed (a reclaimed one stays alive until its notice runs out)."""
    return any(n.labels.get(MARKET_LABEL) == "spot" and not n.draining for n in observe_nodes())


def train(session) -> None:
    market = (session.market or "unknown").replace("-", "_")
    delay = float(session.config.get(f"{market}_step_delay", 0.0))
    hold_from = session.config.get("on_demand_hold_from_step") if market == "on_demand" else None

    def slow_step(step, metrics) -> None:
        if delay:
            time.sleep(delay)
        if hold_from is not None and step >= int(hold_from) and not spot_node_alive():
            logger.info("test job: on-demand at step %d, holding until a spot node is alive", step)
            while not spot_node_alive():
                time.sleep(0.5)

    session.add_step_hook(slow_step)
    resolve_entrypoint("jobs/digits_ddp.py:train")(session)
