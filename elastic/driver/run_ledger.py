"""The driver's part of the run ledger (elastic.ledger): the run's start and end, its placements, waits for
capacity, and, at the end, the deaths of nodes it trained on (Ray's own record of each node)."""

from __future__ import annotations

import logging
import time

from ray.util.state import list_nodes

from elastic.config.spec import JobSpec
from elastic.ledger import LedgerWriter, NoLedger, read_ledger
from elastic.ledger.events import NodeDied, RunEnded, RunStarted, WorkersStarted

logger = logging.getLogger(__name__)


def start_run_ledger(run_uri: str, run_name: str, spec: JobSpec, kind_of_run: str = "run") -> LedgerWriter | NoLedger:
    if not run_uri:
        return NoLedger()  # a sweep's probe: no run folder to account for
    writer = LedgerWriter(run_uri, "driver")
    workers = spec.workers
    writer.record(
        RunStarted(
            time.time(),
            run=run_name,
            kind_of_run=kind_of_run,
            market=workers.market,
            workers_min=workers.min,
            workers_max=workers.max_workers,
        )
    )
    writer.flush()
    return writer


def end_run_ledger(writer: LedgerWriter | NoLedger, run_uri: str, started: float, status: str, error: str | None):
    """Record the deaths of the run's nodes since `started` (unix s), then the end; write it all now."""
    if isinstance(writer, LedgerWriter):
        for death in node_deaths(run_uri, started):
            writer.record(death)
    writer.record(RunEnded(time.time(), status=status, error=error))
    writer.close()


def node_deaths(run_uri: str, since: float) -> list[NodeDied]:
    """Nodes that ran this run's workers and died after `since`, with Ray's time and message of each death.
    Best effort: without Ray's state API (no dashboard) the report has no node deaths, nothing else."""
    used = {
        node["node_id"]
        for event in read_ledger(run_uri)
        if isinstance(event, WorkersStarted) and event.time >= since
        for node in event.nodes
    }
    if not used:
        return []
    try:
        nodes = list_nodes(detail=True, limit=10_000, raise_on_missing_output=False)
    except Exception as err:  # the state API is an HTTP call to the dashboard: any failure only loses these events
        logger.info("run ledger: no node deaths recorded (%s: %s)", type(err).__name__, err)
        return []
    deaths = []
    for node in nodes:
        if node.node_id in used and node.state == "DEAD" and node.end_time_ms and node.end_time_ms / 1000 >= since:
            deaths.append(NodeDied(node.end_time_ms / 1000, node_id=node.node_id, message=node.state_message or ""))
    return deaths
