"""Session side of a placement the driver started: is this placement asked to end, and the acknowledgement
once it ended at a checkpoint (through elastic.placement.control's objects in the run folder)."""

from __future__ import annotations

import time

import torch.distributed as dist

from elastic.placement.control import PlacementControl
from elastic.placement.messages import EndKind, Placement


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

    def __init__(
        self,
        control: PlacementControl,
        placement_id: str,
        rank: int,
        endable: bool,
        follows: str | None = None,
        poll_seconds: float = 0.25,
    ):
        self.control, self.placement_id, self.rank, self.endable = control, placement_id, rank, endable
        self.follows, self.poll_seconds = follows, poll_seconds
        self._kind = "ended"
        self.rank_nodes: list[str] = []  # the node of every rank (the session gathers them at start)

    def wait_for_predecessor(self) -> bool:
        """A placement the driver started ahead (`follows`: the placement ending at a just-in-time checkpoint)
        must not read a checkpoint before its predecessor has committed its last one and ended: rank 0 waits
        for that acknowledgement (True) or the driver's cancel (False); every rank gets the same answer."""
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
        if not self.endable:
            return False
        request = self.control.end_request(self.placement_id) if self.rank == 0 else None
        answer = [request.kind.value if request else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(answer, src=0)
        if answer[0]:
            self._kind = answer[0]
        return bool(answer[0])

    def acknowledge(self, step: int, reason: str | None = None) -> str:
        kind = reason or self._kind
        if self.rank == 0:
            self.control.acknowledge(self.placement_id, step, kind, self.rank_nodes)
        return {
            EndKind.SWAP: "moving to spot",
            EndKind.GROW: "growing the worker group",
            EndKind.PREEMPTION: "a node is being reclaimed",
        }.get(EndKind.parse(kind), kind)

    def running(self, world_size: int) -> None:
        if self.rank == 0:
            self.control.running(self.placement_id, world_size)


def placement_watch(payload: dict | None, run_uri: str, rank: int):
    """The session's watch for the placement the driver described in the train loop config (or a null one)."""
    placement = Placement.from_dict(payload) if payload else None
    if placement is None:
        return NoPlacementWatch()
    return PlacementWatch(PlacementControl(run_uri), placement.id, rank, placement.endable, placement.follows)
