"""Spot-first placement: run on spot nodes when they can be had, on on-demand nodes when they cannot, and move
back to spot at a checkpoint boundary once spot capacity returns.

Three layers, kept apart:

- pure policy (`worker_slots`, `decide_start`, `decide_swap`): cluster nodes + the workers spec in, a
  `Decision` with its reason out; the driver logs every decision;
- the control objects in the run folder (`PlacementControl`): the driver asks the current placement to end,
  the session's rank 0 acknowledges with the step of the checkpoint it ended at;
- the thin Ray edge (`observe_nodes`, `hint_spot_demand`, `wait_for_spot`, `SwapWatcher`): polls capacity and
  carries decisions out.

Why a placement ends by the training function *returning*: when every worker's function returns, Ray Train's
controller moves to FINISHED and `fit()` returns a Result. No error is raised, so neither `max_failures` nor
`max_preemption_failures` is spent, and nothing is killed mid-save. (Aborting the controller instead exits the
controller actor, so `fit()` raises; raising in the workers is a worker-group error that FailureConfig retries on
the *same* placement.) The driver then calls `fit()` again with the spot selector under the same run name: Ray
resumes the run, and `session.restore()` loads the checkpoint the placement ended at, so no step is lost.
"""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from elastic.labels import MARKET_LABEL, ROLE_LABEL, WORKER_ROLE, worker_selector
from elastic.spec import WorkersSpec

SPOT, ON_DEMAND, ANY = "spot", "on-demand", "any"
REQUEST_FILE = "elastic-placement-request.json"
ENDED_FILE = "elastic-placement-ended.json"
RUNNING_FILE = "elastic-placement-running.json"
STATUS_FILE = "elastic-driver-status.json"  # what the driver is doing now, for `elastic status RUN`
ENDING_FILE = "elastic-placement-ending.json"  # a reclaim notice: the placement will end at a JIT checkpoint
CANCEL_FILE = "elastic-placement-cancelled.json"  # a placement started ahead that must not run after all
POLL_SECONDS_VARIABLE = "ELASTIC_PLACEMENT_POLL_SECONDS"
DEFAULT_POLL_SECONDS = 5.0


# ---------------------------------------------------------------------------------------------------------
# Pure policy


@dataclass(frozen=True)
class NodeView:
    """What the policy needs to know of one live node."""

    node_id: str
    labels: dict[str, str]
    available: dict[str, float]  # free resources now
    draining: bool = False  # a drained node (e.g. a spot notice) is leaving: its capacity does not count
    total: dict[str, float] = field(default_factory=dict)  # the node's resources, free or not (if known)

    @property
    def market(self) -> str | None:
        return self.labels.get(MARKET_LABEL)

    @property
    def is_worker(self) -> bool:
        return self.labels.get(ROLE_LABEL) == WORKER_ROLE


@dataclass(frozen=True)
class Decision:
    """A placement decision and why. action: spot | on-demand | wait (start); swap | stay (while on on-demand)."""

    action: str
    reason: str
    spot_slots: int = 0


def worker_resources(workers: WorkersSpec) -> dict[str, float]:
    resources = {"CPU": workers.cpus}
    if workers.gpus:
        resources["GPU"] = workers.gpus
    return resources


def worker_slots(nodes: list[NodeView], workers: WorkersSpec, market: str,
                 released: dict[str, int] | None = None) -> int:
    """How many more workers of this shape fit on the live worker nodes of `market`: right now, plus the
    slots that `released` workers (node id -> workers of a placement that is ending) are about to free.
    Capped at the node's total, so a slot already freed is not counted twice."""
    need = worker_resources(workers)
    released = released or {}
    total = 0
    for node in nodes:
        if node.draining or not node.is_worker or (market != ANY and node.market != market):
            continue
        fits = []
        for name, amount in need.items():
            free = node.available.get(name, 0.0) + released.get(node.node_id, 0) * amount
            if name in node.total:
                free = min(free, node.total[name])
            # A little slack: Ray reports fractional resources as floats (0.1 * 10 is not 1.0).
            fits.append(math.floor(free / amount + 1e-9))
        total += min(fits)
    return total


def decide_start(workers: WorkersSpec, nodes: list[NodeView], waited_seconds: float) -> Decision:
    """spot-first at start: spot once it can hold workers.min; on-demand once spot_wait_seconds have passed."""
    slots = worker_slots(nodes, workers, SPOT)
    if slots >= workers.min:
        return Decision(SPOT, f"spot capacity for {workers.min} worker(s) is free ({slots} slot(s))", slots)
    if waited_seconds >= workers.spot_wait_seconds:
        return Decision(ON_DEMAND, f"spot capacity was not granted within {workers.spot_wait_seconds:g} s "
                                   f"({slots} of {workers.min} spot worker slot(s) free); falling back to on-demand",
                        slots)
    return Decision("wait", f"waiting for spot capacity: {slots} of {workers.min} spot worker slot(s) free "
                            f"after {waited_seconds:.0f} of {workers.spot_wait_seconds:g} s", slots)


def decide_swap(workers: WorkersSpec, nodes: list[NodeView]) -> Decision:
    """While on on-demand: swap to spot once spot can hold workers.min (the same bar as at start)."""
    slots = worker_slots(nodes, workers, SPOT)
    if not workers.swap_to_spot:
        return Decision("stay", "swap_to_spot is off", slots)
    if slots >= workers.min:
        return Decision("swap", f"spot capacity for {workers.min} worker(s) is back ({slots} slot(s) free); "
                                "swapping at the next checkpoint", slots)
    return Decision("stay", f"{slots} of {workers.min} spot worker slot(s) free", slots)


def decide_workers(workers: WorkersSpec, nodes: list[NodeView], market: str,
                   released: dict[str, int] | None = None) -> Decision:
    """How many workers a new placement on `market` starts with: as many as fit, up to max (action start), or
    wait while fewer than min fit (a reclaimed node not yet replaced). `released`: see worker_slots."""
    slots = worker_slots(nodes, workers, market, released)
    if slots >= workers.min:
        count = min(slots, workers.max_workers)
        return Decision("start", f"{count} worker(s) on {market} nodes ({slots} slot(s) free)", count)
    return Decision("wait", f"waiting for capacity: {slots} of {workers.min} worker slot(s) free on {market} nodes "
                            "(a reclaimed node not yet replaced?)", slots)


def decide_grow(workers: WorkersSpec, nodes: list[NodeView], market: str, running: int | None) -> Decision:
    """While an elastic placement runs below max: grow once free slots for more workers exist."""
    slots = worker_slots(nodes, workers, market)
    if running is None:
        return Decision("stay", "worker group not running yet", slots)
    if running >= workers.max_workers:
        return Decision("stay", f"at max ({running} workers)", slots)
    if slots >= 1:
        target = min(workers.max_workers, running + slots)
        return Decision("grow", f"capacity for {target - running} more worker(s) on {market} nodes; growing "
                                f"{running} -> {target} at the next checkpoint", slots)
    return Decision("stay", f"{running} of {workers.max_workers} workers, no free slot on {market} nodes", slots)


# ---------------------------------------------------------------------------------------------------------
# Control objects in the run folder


def new_placement_id() -> str:
    return uuid.uuid4().hex[:12]


class PlacementControl:
    """Two small JSON objects in the run folder: the driver's request that placement P end at its next
    checkpoint, and the session's acknowledgement that P ended at step S. Ids make stale objects harmless."""

    def __init__(self, run_uri: str):
        from elastic.storage import fsspec_filesystem

        self.fs, self.root = fsspec_filesystem(run_uri.rstrip("/"))

    def request_end(self, placement_id: str, kind: str, reason: str) -> None:
        """Ask placement `placement_id` to end at its next checkpoint; kind: swap (to spot) or grow."""
        self._write(REQUEST_FILE, {"placement": placement_id, "kind": kind, "reason": reason, "time": time.time()})

    def cancel_request(self) -> None:
        self._remove(REQUEST_FILE)

    def end_request(self, placement_id: str) -> dict | None:
        request = self._read(REQUEST_FILE)
        return request if request is not None and request.get("placement") == placement_id else None

    def end_requested(self, placement_id: str) -> bool:
        return self.end_request(placement_id) is not None

    def will_end(self, placement_id: str, eta: float, nodes: list[str]) -> None:
        """A reclaim notice reached the placement: it will end at a just-in-time checkpoint committed around
        `eta` (unix seconds); its ranks run on `nodes`."""
        self._write(ENDING_FILE, {"placement": placement_id, "eta": eta, "nodes": list(nodes), "time": time.time()})

    def ending_soon(self, placement_id: str) -> dict | None:
        ending = self._read(ENDING_FILE)
        return ending if ending is not None and ending.get("placement") == placement_id else None

    def cancel(self, placement_id: str) -> None:
        """The placement started ahead of its predecessor's end must exit without training (the predecessor
        went on instead: its just-in-time checkpoint failed, or the run finished first)."""
        self._write(CANCEL_FILE, {"placement": placement_id, "time": time.time()})

    def cancelled(self, placement_id: str) -> bool:
        cancel = self._read(CANCEL_FILE)
        return cancel is not None and cancel.get("placement") == placement_id

    def acknowledge(self, placement_id: str, step: int, kind: str, nodes: list[str] | None = None) -> None:
        """The placement ended at the checkpoint of `step`; kind: swap | grow | preemption. `nodes`: the node
        of each of its ranks, whose slots are about to be free for the next placement."""
        self._write(ENDED_FILE, {"placement": placement_id, "step": step, "kind": kind, "time": time.time(),
                                 "nodes": list(nodes or [])})

    def ended(self, placement_id: str) -> dict | None:
        """The acknowledgement of placement `placement_id`, if it ended on request or at a reclaim notice."""
        ended = self._read(ENDED_FILE)
        return ended if ended is not None and ended.get("placement") == placement_id else None

    def running(self, placement_id: str, world_size: int) -> None:
        """Rank 0 of a placement's (re)started worker group: how many workers it got."""
        self._write(RUNNING_FILE, {"placement": placement_id, "world_size": world_size, "time": time.time()})

    def world_size(self, placement_id: str) -> int | None:
        running = self._read(RUNNING_FILE)
        return int(running["world_size"]) if running is not None and running.get("placement") == placement_id else None

    def set_status(self, state: str, detail: str) -> None:
        self._write(STATUS_FILE, {"state": state, "detail": detail, "time": time.time()})

    def status(self) -> dict | None:
        return self._read(STATUS_FILE)

    def clear(self, keep_ended: bool = False) -> None:
        """Forget the ended placement's objects. `keep_ended`: a placement started ahead is waiting to read
        that acknowledgement (it names the old placement, so it can never be mistaken for the new one's)."""
        for name in (REQUEST_FILE, RUNNING_FILE, ENDING_FILE, CANCEL_FILE) + (() if keep_ended else (ENDED_FILE,)):
            self._remove(name)

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _write(self, name: str, data: dict) -> None:
        self.fs.makedirs(self.root, exist_ok=True)
        with self.fs.open(self._path(name), "w") as handle:
            json.dump(data, handle)

    def _read(self, name: str) -> dict | None:
        # Written by another process since this one last looked: never trust s3fs's listing cache.
        self.fs.invalidate_cache(self._path(name))
        try:
            with self.fs.open(self._path(name), "r") as handle:
                return json.load(handle)
        except FileNotFoundError:
            return None
        except ValueError:  # caught mid-write (a local folder; an object store PUT is atomic): read it next poll
            return None

    def _remove(self, name: str) -> None:
        self.fs.invalidate_cache(self._path(name))
        try:
            self.fs.rm(self._path(name))
        except FileNotFoundError:
            pass


class PlacementEnded(BaseException):
    """Raised on every rank at the checkpoint a placement ends at; the worker entry returns on it, so Ray Train
    sees the run finish cleanly. A BaseException, like SystemExit: `except Exception` in user code must not
    swallow it."""

    def __init__(self, step: int):
        super().__init__(f"placement ended at checkpoint step {step}")
        self.step = step


class NoPlacementWatch:
    """Null object: no driver placement around this session (Ray Train used directly). Nothing asks it to end,
    and it cannot end itself: after a just-in-time checkpoint Ray's own restart takes over."""

    can_end = False

    def end_requested(self) -> bool:
        return False

    def acknowledge(self, step: int, reason: str | None = None) -> str:
        return reason or "ended"

    def running(self, world_size: int) -> None:
        pass

    def wait_for_predecessor(self) -> bool:
        return True

    def will_end(self, eta: float) -> None:
        pass


class PlacementWatch:
    """Session side of a placement the driver started. Rank 0 reads the request object, every rank gets the
    same answer (a broadcast on the default process group, from the training thread, so it never races the
    checkpoint group's collectives). Only an endable placement (swappable or resizable) polls for requests."""

    can_end = True

    def __init__(self, control: PlacementControl, placement_id: str, rank: int, endable: bool,
                 follows: str | None = None, poll_seconds: float = 0.25):
        self.control, self.placement_id, self.rank, self.endable = control, placement_id, rank, endable
        self.follows, self.poll_seconds = follows, poll_seconds
        self._kind = "ended"
        self.rank_nodes: list[str] = []  # the node of every rank (the session gathers them at start)

    def wait_for_predecessor(self) -> bool:
        """A placement the driver started ahead (`follows`: the placement ending at a just-in-time checkpoint)
        must not read a checkpoint before its predecessor has committed its last one and ended: rank 0 waits
        for that acknowledgement (True) or the driver's cancel (False); every rank gets the same answer."""
        import torch.distributed as dist

        if not self.follows:
            return True
        answer = [True]
        if self.rank == 0:
            while self.control.ended(self.follows) is None:
                if self.control.cancelled(self.placement_id):
                    answer = [False]
                    break
                time.sleep(self.poll_seconds)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(answer, src=0)
        return bool(answer[0])

    def will_end(self, eta: float) -> None:
        """Rank 0, at a reclaim notice: tell the driver, which starts the next placement ahead."""
        if self.rank == 0:
            self.control.will_end(self.placement_id, eta, self.rank_nodes)

    def end_requested(self) -> bool:
        import torch.distributed as dist

        if not self.endable:
            return False
        request = self.control.end_request(self.placement_id) if self.rank == 0 else None
        answer = [request.get("kind", "ended") if request else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(answer, src=0)
        if answer[0]:
            self._kind = answer[0]
        return bool(answer[0])

    def acknowledge(self, step: int, reason: str | None = None) -> str:
        kind = reason or self._kind
        if self.rank == 0:
            self.control.acknowledge(self.placement_id, step, kind, self.rank_nodes)
        return {"swap": "moving to spot", "grow": "growing the worker group",
                "preemption": "a node is being reclaimed"}.get(kind, kind)

    def running(self, world_size: int) -> None:
        if self.rank == 0:
            self.control.running(self.placement_id, world_size)


def placement_watch(payload: dict | None, run_uri: str, rank: int):
    """The session's watch for the placement the driver described in the train loop config (or a null one)."""
    if not payload:
        return NoPlacementWatch()
    endable = bool(payload.get("swappable") or payload.get("resizable"))
    return PlacementWatch(PlacementControl(run_uri), payload["id"], rank, endable, payload.get("follows"))


# ---------------------------------------------------------------------------------------------------------
# The Ray edge: observe capacity, hint the autoscaler, wait, watch


def observe_nodes() -> list[NodeView]:
    """Live nodes with their labels and free resources (from the connected driver)."""
    import ray

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
        views.append(NodeView(node_id=node_id, labels=dict(node.get("Labels") or {}),
                              available=dict(available.get(node_id, {})), draining=node_id in draining,
                              total=dict(node.get("Resources") or {})))
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
    from ray.autoscaler.sdk import request_resources

    bundles = [worker_resources(workers)] * workers.min if on else []
    selectors = [worker_selector(SPOT)] * workers.min if on else None
    try:
        request_resources(bundles=bundles, bundle_label_selectors=selectors)
    except Exception as err:  # a hint only: a cluster that cannot take it still runs the job
        print(f"[elastic] placement: could not ask the autoscaler for spot nodes ({err})", flush=True)


def log_decision(decision: Decision) -> None:
    print(f"[elastic] placement: {decision.action}: {decision.reason}", flush=True)


def wait_for_spot(workers: WorkersSpec, observe: Callable[[], list[NodeView]] = observe_nodes,
                  clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                  poll_seconds: float = DEFAULT_POLL_SECONDS) -> Decision:
    """Poll until decide_start says spot or on-demand; log the first wait and the outcome."""
    started = clock()
    announced = False
    while True:
        try:
            nodes = observe()
        except Exception as err:  # loop boundary: a failed poll (GCS hiccup) counts as no capacity seen
            print(f"[elastic] placement: capacity poll failed ({type(err).__name__}: {err})", flush=True)
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
                print(f"[elastic] placement: capacity poll failed ({type(err).__name__}: {err})", flush=True)
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
            log_decision(Decision("stay", f"spot capacity went away before the checkpoint ({decision.reason}); "
                                          "request withdrawn", decision.spot_slots))
        return decision


def wait_for_workers(workers: WorkersSpec, market: str, observe: Callable[[], list[NodeView]] = observe_nodes,
                     sleep: Callable[[float], None] = time.sleep, poll_seconds: float = 0.5,
                     announce_every: int = 60, on_wait: Callable[[Decision], None] = lambda d: None,
                     released: dict[str, int] | None = None) -> Decision:
    """Poll until decide_workers says start. Polls briefly: right after a placement ends its workers' resources
    are being released, and every second spent here is a second not training. Logs the wait now and then.
    `released`: the workers of the placement that just ended, per node (their slots count as free)."""
    polls = 0
    while True:
        try:
            nodes = observe()
        except Exception as err:  # loop boundary: a failed poll (GCS hiccup) counts as no capacity seen
            print(f"[elastic] placement: capacity poll failed ({type(err).__name__}: {err})", flush=True)
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
        decision = decide_grow(self.workers, self.observe(), self.market,
                               self.control.world_size(self.placement_id))
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
                log_decision(Decision("stay", f"capacity went away before the checkpoint ({decision.reason}); "
                                              "request withdrawn", decision.spot_slots))
        return decision
