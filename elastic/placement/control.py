"""The control objects in a run folder, through which the driver and the sessions of a placement talk.

The driver asks the current placement to end (`PlacementControl.request_end`), the session's rank 0
acknowledges with the step of the checkpoint it ended at; `Placement` is what the driver tells the sessions of
one fit() (through Ray Train's `train_loop_config`), and `PlacementEnded` is how a session leaves at the end.
No Ray and no torch here: both sides import it.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from elastic.storage import fsspec_filesystem

REQUEST_FILE = "elastic-placement-request.json"
ENDED_FILE = "elastic-placement-ended.json"
RUNNING_FILE = "elastic-placement-running.json"
STATUS_FILE = "elastic-driver-status.json"  # what the driver is doing now, for `elastic status RUN`
ENDING_FILE = "elastic-placement-ending.json"  # a reclaim notice: the placement will end at a JIT checkpoint
CANCEL_FILE = "elastic-placement-cancelled.json"  # a placement started ahead that must not run after all


@dataclass(frozen=True)
class Placement:
    """One fit() of a spot-first run: the market its workers select, and whether the driver may end it at a
    checkpoint to move to spot (read by the sessions through `train_loop_config`)."""

    id: str
    market: str
    swappable: bool
    reason: str
    workers: int | None = None  # started with (the driver's count of free slots, capped at max)
    resizable: bool = False  # elastic and below max: the driver may end it at a checkpoint to grow
    avoid_nodes: tuple[str, ...] = ()  # nodes draining when it started (being reclaimed)
    follows: str | None = None  # started ahead: its sessions wait until this placement has ended


def new_placement_id() -> str:
    return uuid.uuid4().hex[:12]


class PlacementControl:
    """Two small JSON objects in the run folder: the driver's request that placement P end at its next
    checkpoint, and the session's acknowledgement that P ended at step S. Ids make stale objects harmless."""

    def __init__(self, run_uri: str):
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

