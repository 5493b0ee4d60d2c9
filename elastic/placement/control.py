"""The control objects in a run folder, through which the driver and the sessions of a placement talk.

The driver asks the current placement to end (`PlacementControl.request_end`), the session's rank 0
acknowledges with the step of the checkpoint it ended at; `Placement` is what the driver tells the sessions of
one fit() (through Ray Train's `train_loop_config`), and `PlacementEnded` is how a session leaves at the end.
The messages themselves are elastic.placement.messages' types. No Ray and no torch here: both sides import it.
"""

from __future__ import annotations

import uuid

from elastic.placement.messages import (
    Acknowledgement,
    Cancel,
    DriverStatus,
    EndingSoon,
    EndKind,
    EndRequest,
    Message,
    Placement,
    Running,
    T,
)
from elastic.storage import fsspec_filesystem

__all__ = ["Placement", "PlacementControl", "new_placement_id"]

REQUEST_FILE = "elastic-placement-request.json"
ENDED_FILE = "elastic-placement-ended.json"
RUNNING_FILE = "elastic-placement-running.json"
STATUS_FILE = "elastic-driver-status.json"  # what the driver is doing now, for `elastic status RUN`
ENDING_FILE = "elastic-placement-ending.json"  # a reclaim notice: the placement will end at a JIT checkpoint
CANCEL_FILE = "elastic-placement-cancelled.json"  # a placement started ahead that must not run after all


def new_placement_id() -> str:
    return uuid.uuid4().hex[:12]


class PlacementControl:
    """Small JSON objects in the run folder: the driver's request that placement P end at its next
    checkpoint, and the session's acknowledgement that P ended at step S, and the rest of messages.py.
    Ids make stale objects harmless: each reader asks for its placement's and ignores another's."""

    def __init__(self, run_uri: str):
        self.fs, self.root = fsspec_filesystem(run_uri.rstrip("/"))

    def request_end(self, placement_id: str, kind: EndKind | str, reason: str) -> None:
        """Ask placement `placement_id` to end at its next checkpoint; kind: swap (to spot) or grow."""
        self._write(REQUEST_FILE, EndRequest(placement_id, EndKind(kind), reason))

    def cancel_request(self) -> None:
        self._remove(REQUEST_FILE)

    def end_request(self, placement_id: str) -> EndRequest | None:
        return self._read_for(REQUEST_FILE, EndRequest, placement_id)

    def end_requested(self, placement_id: str) -> bool:
        return self.end_request(placement_id) is not None

    def will_end(self, placement_id: str, eta: float, nodes: list[str]) -> None:
        """A reclaim notice reached the placement: it will end at a just-in-time checkpoint committed around
        `eta` (unix seconds); its ranks run on `nodes`."""
        self._write(ENDING_FILE, EndingSoon(placement_id, eta, tuple(nodes)))

    def ending_soon(self, placement_id: str) -> EndingSoon | None:
        return self._read_for(ENDING_FILE, EndingSoon, placement_id)

    def cancel(self, placement_id: str) -> None:
        """The placement started ahead of its predecessor's end must exit without training (the predecessor
        went on instead: its just-in-time checkpoint failed, or the run finished first)."""
        self._write(CANCEL_FILE, Cancel(placement_id))

    def cancelled(self, placement_id: str) -> bool:
        return self._read_for(CANCEL_FILE, Cancel, placement_id) is not None

    def acknowledge(self, placement_id: str, step: int, kind: EndKind | str, nodes: list[str] | None = None) -> None:
        """The placement ended at the checkpoint of `step`; kind: swap | grow | preemption. `nodes`: the node
        of each of its ranks, whose slots are about to be free for the next placement."""
        # A kind the driver does not know ends the placement all the same; the driver always restarted it as
        # after a grow (the same market, sized by the free slots).
        self._write(
            ENDED_FILE, Acknowledgement(placement_id, step, EndKind.parse(kind, EndKind.GROW), tuple(nodes or ()))
        )

    def ended(self, placement_id: str) -> Acknowledgement | None:
        """The acknowledgement of placement `placement_id`, if it ended on request or at a reclaim notice."""
        return self._read_for(ENDED_FILE, Acknowledgement, placement_id)

    def running(self, placement_id: str, world_size: int) -> None:
        """Rank 0 of a placement's (re)started worker group: how many workers it got."""
        self._write(RUNNING_FILE, Running(placement_id, world_size))

    def world_size(self, placement_id: str) -> int | None:
        running = self._read_for(RUNNING_FILE, Running, placement_id)
        return running.world_size if running is not None else None

    def set_status(self, state: str, detail: str) -> None:
        self._write(STATUS_FILE, DriverStatus(state, detail))

    def status(self) -> DriverStatus | None:
        return DriverStatus.from_json(self._read(STATUS_FILE))

    def clear(self, keep_ended: bool = False) -> None:
        """Forget the ended placement's objects. `keep_ended`: a placement started ahead is waiting to read
        that acknowledgement (it names the old placement, so it can never be mistaken for the new one's)."""
        for name in (REQUEST_FILE, RUNNING_FILE, ENDING_FILE, CANCEL_FILE) + (() if keep_ended else (ENDED_FILE,)):
            self._remove(name)

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _write(self, name: str, message: Message) -> None:
        self.fs.makedirs(self.root, exist_ok=True)
        with self.fs.open(self._path(name), "w") as handle:
            handle.write(message.to_json())

    def _read_for(self, name: str, kind: type[T], placement_id: str) -> T | None:
        message = kind.from_json(self._read(name))
        return message if message is not None and message.placement == placement_id else None

    def _read(self, name: str) -> str | None:
        # Written by another process since this one last looked: never trust s3fs's listing cache.
        self.fs.invalidate_cache(self._path(name))
        try:
            with self.fs.open(self._path(name), "r") as handle:
                return handle.read()
        except FileNotFoundError:
            return None

    def _remove(self, name: str) -> None:
        self.fs.invalidate_cache(self._path(name))
        try:
            self.fs.rm(self._path(name))
        except FileNotFoundError:
            pass
