"""When the function saves (api ray-train, transformers): the function reports its own checkpoints, and the
session only asks for one, through `elastic.train.checkpoint_requested()` or the Trainer's `should_save`.

Pure policy, noted at every step (report) on every rank alike: a reclaim notice's just-in-time checkpoint comes
first, then the driver ending the placement, then the spec's cadence. A request stands until the function
reports a checkpoint."""

from __future__ import annotations

from collections.abc import Callable

JUST_IN_TIME = "just-in-time"
PLACEMENT_ENDING = "placement ending"
PERIODIC = "periodic"


class SaveRequests:
    def __init__(self) -> None:
        self.reason: str | None = None  # why a checkpoint is wanted now (the commit marker's reason), or None

    def note(self, just_in_time: bool, ending: Callable[[], bool], periodic: Callable[[], bool]) -> None:
        """At a step: `just_in_time` is due; `ending()`, `periodic()` are asked only when they can change the
        answer (each may be a collective: every rank asks alike, since `reason` is the same on every rank)."""
        if just_in_time:
            self.reason = JUST_IN_TIME
        elif self.reason != JUST_IN_TIME and ending():
            self.reason = PLACEMENT_ENDING
        elif self.reason is None and periodic():
            self.reason = PERIODIC

    def take(self) -> str | None:
        """The function reported a checkpoint: the reason it was wanted (None: the function's own), cleared."""
        reason, self.reason = self.reason, None
        return reason
