"""The thin Ray edge of spot-first placement, on the driver: observe capacity, hint the autoscaler, wait for
capacity, and the watcher threads that ask a running placement to end (swap to spot, grow). The decisions are
elastic.placement.policy's; this module only carries them out."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
from ray.autoscaler.sdk import request_resources

from elastic.config.spec import WorkersSpec
from elastic.placement.control import PlacementControl
from elastic.placement.labels import worker_selector
from elastic.placement.policy import (
    DEFAULT_POLL_SECONDS,
    SPOT,
    Decision,
    NodeView,
    decide_grow,
    decide_start,
    decide_swap,
    decide_workers,
    worker_resources,
)

logger = logging.getLogger(__name__)


def observe_nodes() -> list[NodeView]:
    """Live nodes with their labels and free resources (from the connected driver)."""
    # ray._private.state is what Ray Train itself uses for drains (train/v2/_internal/execution/preemption.py);
    # no public per-node "available resources" API exists in 2.60.
    available = ray._private.state.available_resources_per_node()
    try:
        draining = set(ray._private.state.state.get_draining_nodes() or {})
    except Exception:  # an older GCS without the drain API: treat no node as draining
        draining = set()
    views = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        node_id = node["NodeID"]
        views.append(
            NodeView(
                node_id=node_id,
                labels=dict(node.get("Labels") or {}),
                available=dict(available.get(node_id, {})),
                draining=node_id in draining,
                total=dict(node.get("Resources") or {}),
            )
        )
    return views


def draining_nodes(observe: Callable[[], list[NodeView]] = observe_nodes) -> tuple[str, ...]:
    """Ids of live nodes being drained (reclaimed): a new placement must not land there."""
    try:
        return tuple(sorted(n.node_id for n in observe() if n.draining))
    except Exception:  # a failed poll: no node to avoid (Ray's restart covers a worker lost with one)
        return ()


def hint_spot_demand(workers: WorkersSpec, on: bool = True) -> None:
    """Ask the autoscaler for spot nodes for workers.min workers (or withdraw the ask). On an autoscaling cloud
    cluster spot nodes exist only when something asks for them; with no autoscaler (the local stack) this is
    a no-op. request_resources is one standing, cluster-wide hint, replaced by the next call."""
    bundles = [worker_resources(workers)] * workers.min if on else []
    selectors = [worker_selector(SPOT)] * workers.min if on else None
    try:
        request_resources(bundles=bundles, bundle_label_selectors=selectors)
    except Exception as err:  # a hint only: a cluster that cannot take it still runs the job
        logger.warning("placement: could not ask the autoscaler for spot nodes (%s)", err)


def log_decision(decision: Decision) -> None:
    logger.info("placement: %s: %s", decision.action, decision.reason)


def wait_for_spot(
    workers: WorkersSpec,
    observe: Callable[[], list[NodeView]] = observe_nodes,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    poll_seconds: float = DEFAULT_POLL_SECONDS,
) -> Decision:
    """Poll until decide_start says spot or on-demand; log the first wait and the outcome."""
    started = clock()
    announced = False
    while True:
        try:
            nodes = observe()
        except Exception as err:  # loop boundary: a failed poll (GCS hiccup) counts as no capacity seen
            logger.warning("placement: capacity poll failed (%s: %s)", type(err).__name__, err)
            nodes = []
        decision = decide_start(workers, nodes, clock() - started)
        if decision.action != "wait":
            log_decision(decision)
            return decision
        if not announced:
            log_decision(decision)
            announced = True
        remaining = workers.spot_wait_seconds - (clock() - started)
        sleep(max(0.05, min(poll_seconds, remaining)))


class _PollingThread:
    """What the driver's watchers share: `poll_once()` every `poll_seconds` in a daemon thread until stop()."""

    def start(self):
        self._thread = threading.Thread(target=self._run, name=f"elastic-{type(self).__name__}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception as err:  # loop boundary: a failed poll (GCS hiccup, S3 error) retries next time
                logger.warning("placement: capacity poll failed (%s: %s)", type(err).__name__, err)
            self._stop.wait(self.poll_seconds)


@dataclass
class SwapWatcher(_PollingThread):
    """Background thread of the driver while a placement runs on on-demand: when decide_swap says so, write the
    request; if spot capacity goes away before the session acknowledged, withdraw it."""

    workers: WorkersSpec
    control: PlacementControl
    placement_id: str
    observe: Callable[[], list[NodeView]] = observe_nodes
    poll_seconds: float = DEFAULT_POLL_SECONDS
    requested: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def poll_once(self) -> Decision:
        decision = decide_swap(self.workers, self.observe())
        if decision.action == "swap" and not self.requested:
            self.control.request_end(self.placement_id, "swap", decision.reason)
            self.requested = True
            log_decision(decision)
        elif decision.action == "stay" and self.requested and self.control.ended(self.placement_id) is None:
            self.control.cancel_request()
            self.requested = False
            log_decision(
                Decision(
                    "stay",
                    f"spot capacity went away before the checkpoint ({decision.reason}); request withdrawn",
                    decision.spot_slots,
                )
            )
        return decision


def wait_for_workers(
    workers: WorkersSpec,
    market: str,
    observe: Callable[[], list[NodeView]] = observe_nodes,
    sleep: Callable[[float], None] = time.sleep,
    poll_seconds: float = 0.5,
    announce_every: int = 60,
    on_wait: Callable[[Decision], None] = lambda d: None,
    released: dict[str, int] | None = None,
) -> Decision:
    """Poll until decide_workers says start. Polls briefly: right after a placement ends its workers' resources
    are being released, and every second spent here is a second not training. Logs the wait now and then.
    `released`: the workers of the placement that just ended, per node (their slots count as free)."""
    polls = 0
    while True:
        try:
            nodes = observe()
        except Exception as err:  # loop boundary: a failed poll (GCS hiccup) counts as no capacity seen
            logger.warning("placement: capacity poll failed (%s: %s)", type(err).__name__, err)
            nodes = []
        decision = decide_workers(workers, nodes, market, released)
        # Logged from the fourth poll on: a released group's slots normally show up within a few polls.
        if decision.action == "start" or polls % announce_every == 3:
            log_decision(decision)
            if decision.action == "wait":
                on_wait(decision)
        if decision.action == "start":
            return decision
        polls += 1
        sleep(poll_seconds)


@dataclass
class GrowWatcher(_PollingThread):
    """Background thread of the driver while an elastic placement runs below max: once free capacity for more
    workers has been seen steadily for `steady_seconds`, ask the placement to end at its next checkpoint (the
    driver restarts it larger). A reading that flips back resets the clock, so nothing flaps."""

    workers: WorkersSpec
    control: PlacementControl
    placement_id: str
    market: str
    observe: Callable[[], list[NodeView]] = observe_nodes
    poll_seconds: float = DEFAULT_POLL_SECONDS
    clock: Callable[[], float] = time.monotonic
    requested: bool = False
    _since: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def poll_once(self) -> Decision:
        decision = decide_grow(self.workers, self.observe(), self.market, self.control.world_size(self.placement_id))
        now = self.clock()
        if decision.action == "grow":
            self._since = now if self._since is None else self._since
            if not self.requested and now - self._since >= self.workers.regrow_after_seconds:
                self.control.request_end(self.placement_id, "grow", decision.reason)
                self.requested = True
                log_decision(decision)
        else:
            self._since = None
            if self.requested and self.control.ended(self.placement_id) is None:
                self.control.cancel_request()
                self.requested = False
                log_decision(
                    Decision(
                        "stay",
                        f"capacity went away before the checkpoint ({decision.reason}); request withdrawn",
                        decision.spot_slots,
                    )
                )
        return decision
