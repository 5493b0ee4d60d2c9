"""The driver loop's decisions, pure: typed events in, a typed decision with its human reason out.

In the style of Ray Train V2's controller (a failure policy's make_decision returns a decision, the controller's
step carries it out and logs why): `PlacementLoop.step(event)` only decides; elastic.driver.placements observes
Ray and the run folder, turns what it sees into events and carries the decisions out. No Ray, no I/O, no clock
of its own (EndingSoon carries `now`), so tests drive it one event at a time.

State: the market of the next placement (None: spot-first, still to choose between spot and on-demand), the
preemptions and controller failures counted against failure.max_preemptions / failure.max_failures.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from elastic.config.spec import JobSpec
from elastic.placement.messages import EndKind
from elastic.placement.policy import ON_DEMAND, SPOT

# The next placement is started this long before the ending one's just-in-time checkpoint is due, so that its
# new Ray Train controller is up and asking for workers when the old ones are released. A controller took 5-7 s
# to come up on a busy 2-core machine; at 6 s it was late in half the reclaims measured, and those restarts
# took 4-7 s longer. Starting earlier costs only the controller's start-up CPU during a few more steps.
START_AHEAD_SECONDS = 12.0
# ...but not before the reclaim notice is this old: correlated reclaims reach their nodes' watchers a poll apart
# (AWS asks for one poll every 5 s), and a placement sized before the second drain is known could land on it.
NOTICE_SETTLE_SECONDS = 5.0


# ---------------------------------------------------------------------------------------------------------
# Events: what the driver saw


@dataclass(frozen=True)
class RunStarting:
    """The job's driver is about to start the run's first placement."""


@dataclass(frozen=True)
class SpotDecided:
    """Spot-first's wait for spot capacity is over (elastic.placement.policy.decide_start): spot or on-demand."""

    market: str
    reason: str


@dataclass(frozen=True)
class PlacementEnded:
    """The sessions acknowledged that the current placement ended at the checkpoint of `step`."""

    step: int
    kind: EndKind
    nodes: tuple[str, ...] = ()  # the node of each of its ranks: their slots are about to be free


@dataclass(frozen=True)
class EndingSoon:
    """A reclaim notice: the current placement will end at a just-in-time checkpoint around `eta` (unix seconds);
    the notice was written at `noticed_at`, the driver read it at `now`."""

    eta: float
    noticed_at: float
    nodes: tuple[str, ...]
    now: float


@dataclass(frozen=True)
class ControllerFailed:
    """fit() raised with no acknowledged end. `retryable`: Ray Train's controller failed, not the user's code
    (which Ray Train's own FailureConfig already retried)."""

    error: str  # the error's type name
    message: str  # the last line of its message
    retryable: bool


@dataclass(frozen=True)
class RunFinished:
    """fit() returned with no acknowledged end: the run is done."""


Event = RunStarting | SpotDecided | PlacementEnded | EndingSoon | ControllerFailed | RunFinished


# ---------------------------------------------------------------------------------------------------------
# Decisions: what the driver does next, each with the reason it logs


@dataclass(frozen=True, kw_only=True)
class StartsPlacement:
    """A decision that starts the next placement on `market` (sized by the free slots when carried out).
    `placement_reason`: the reason recorded with the placement in the run summary."""

    reason: str
    market: str
    placement_reason: str
    swappable: bool = False  # spot-first on on-demand: the driver may end it to move to spot


@dataclass(frozen=True, kw_only=True)
class Start(StartsPlacement):
    """Start the next placement: the first one, or the one after a reclaim (unless one was started ahead: it
    takes over, with `placement_reason`)."""


@dataclass(frozen=True, kw_only=True)
class StartAhead(StartsPlacement):
    """Start the next placement now, ahead of the current one's just-in-time end, counting the slots of its
    ranks (`released`: node -> workers) as free; its sessions wait for the current placement's end."""

    released: dict[str, int]


@dataclass(frozen=True, kw_only=True)
class SwapToSpot(StartsPlacement):
    """The on-demand placement ended to move to spot: start the next one on spot."""


@dataclass(frozen=True, kw_only=True)
class Grow(StartsPlacement):
    """The placement ended to grow: start the next one, sized by the free slots."""


@dataclass(frozen=True, kw_only=True)
class Retry(StartsPlacement):
    """Ray Train's controller failed: start a new placement from the last committed checkpoint."""


@dataclass(frozen=True)
class WaitForCapacity:
    """Spot-first: wait for spot capacity for workers.min, up to spot_wait_seconds, then on-demand; the driver
    answers with SpotDecided."""

    reason: str


@dataclass(frozen=True)
class KeepRunning:
    """Nothing to do: the current placement goes on."""

    reason: str


@dataclass(frozen=True)
class Fail:
    """The run fails with `reason`."""

    reason: str


@dataclass(frozen=True)
class Finish:
    """The run finished."""

    reason: str


Decision = Start | StartAhead | SwapToSpot | Grow | Retry | WaitForCapacity | KeepRunning | Fail | Finish


# ---------------------------------------------------------------------------------------------------------
# The pure rules


def budget_text(count: int, limit: int) -> str:
    """`3 of 20`, or just `3` when the limit is -1 (unlimited)."""
    return f"{count} of {limit}" if limit >= 0 else f"{count}"


def over_budget(count: int, limit: int) -> bool:
    """failure.max_preemptions / max_failures: -1 is unlimited, else at most `limit` restarts."""
    return 0 <= limit < count


def start_ahead_due(eta: float, noticed_at: float, now: float) -> bool:
    """Start the next placement once the just-in-time checkpoint is due within START_AHEAD_SECONDS and the
    reclaim notice has settled for NOTICE_SETTLE_SECONDS."""
    return eta - now <= START_AHEAD_SECONDS and now - noticed_at >= NOTICE_SETTLE_SECONDS


def market_after_reclaim(spot_first: bool, market: str | None) -> str | None:
    """Spot-first chooses again after a reclaim (spot if it comes back within the wait); a fixed market stays."""
    return None if spot_first else market


class PlacementLoop:
    """The run's placements as a state machine: `step(event)` updates the counts and returns the decision."""

    def __init__(self, spec: JobSpec):
        workers = spec.workers
        self.spot_first = workers.market == "spot-first"
        self.swap_to_spot = workers.swap_to_spot
        self.max_preemptions = spec.failure.max_preemptions
        self.max_failures = spec.failure.max_failures
        self.market: str | None = None if self.spot_first else workers.market
        self.preemptions = 0
        self.failures = 0
        self.finished = False

    def step(self, event: Event) -> Decision:
        if isinstance(event, RunStarting):
            return self._start(f"workers.market is {self.market}")
        if isinstance(event, SpotDecided):
            self.market = event.market
            return self._start(event.reason)
        if isinstance(event, PlacementEnded):
            return self._placement_ended(event)
        if isinstance(event, EndingSoon):
            return self._ending_soon(event)
        if isinstance(event, ControllerFailed):
            return self._controller_failed(event)
        if isinstance(event, RunFinished):
            self.finished = True
            return Finish(reason="the run finished")
        raise TypeError(f"not a placement loop event: {event!r}")

    def swappable(self, market: str | None) -> bool:
        return self.spot_first and market == ON_DEMAND and self.swap_to_spot

    def _start(self, reason: str) -> Start | WaitForCapacity:
        if self.market is None:
            return WaitForCapacity(
                reason="spot-first: spot if capacity for workers.min comes within spot_wait_seconds, else on-demand"
            )
        return Start(reason=reason, market=self.market, placement_reason=reason, swappable=self.swappable(self.market))

    def _placement_ended(self, ended: PlacementEnded) -> Decision:
        if ended.kind is EndKind.PREEMPTION:
            self.preemptions += 1
            if over_budget(self.preemptions, self.max_preemptions):
                return Fail(
                    reason=f"preempted {self.preemptions} times, over failure.max_preemptions "
                    f"({self.max_preemptions}); raise it to keep going"
                )
            self.market = market_after_reclaim(self.spot_first, self.market)
            why = f"resumed after a reclaim at step {ended.step}"
            reason = (
                f"a node is being reclaimed; ended at the just-in-time checkpoint of step {ended.step} "
                f"(preemption {budget_text(self.preemptions, self.max_preemptions)}); resuming from it"
            )
            if self.market is None:
                return WaitForCapacity(reason=reason)
            return Start(reason=reason, market=self.market, placement_reason=why, swappable=self.swappable(self.market))
        if ended.kind is EndKind.SWAP:
            self.market = SPOT
            return SwapToSpot(
                reason=f"on-demand workers ended at the checkpoint of step {ended.step}; resuming from it on spot",
                market=SPOT,
                placement_reason=f"swapped from on-demand at step {ended.step}",
            )
        assert self.market is not None  # a grow ends a placement that was started on a market
        return Grow(
            reason=f"ended at the checkpoint of step {ended.step} to grow",
            market=self.market,
            placement_reason=f"grown at step {ended.step}",
            swappable=self.swappable(self.market),
        )

    def _ending_soon(self, notice: EndingSoon) -> StartAhead | KeepRunning:
        # Spot-first chooses its market again after a reclaim: nothing to start ahead on.
        if self.spot_first or self.market is None:
            return KeepRunning(reason="spot-first chooses the market after the reclaim")
        if not start_ahead_due(notice.eta, notice.noticed_at, notice.now):
            return KeepRunning(reason=f"just-in-time checkpoint due in {notice.eta - notice.now:.0f} s")
        return StartAhead(
            reason="a reclaim's just-in-time checkpoint is due: starting the next placement ahead",
            market=self.market,
            placement_reason="resumed after a reclaim",
            swappable=self.swappable(self.market),
            released=dict(Counter(notice.nodes)),
        )

    def _controller_failed(self, failed: ControllerFailed) -> Retry | Fail:
        self.failures += 1
        if not failed.retryable:
            return Fail(
                reason=f"the placement failed ({failed.error}: {failed.message}); not a controller error, not retried"
            )
        if over_budget(self.failures, self.max_failures):
            return Fail(
                reason=f"placement failed in Ray Train's controller ({failed.message}); "
                f"{self.failures} failures, over failure.max_failures ({self.max_failures})"
            )
        assert self.market is not None  # a placement ran, so its market was chosen
        return Retry(
            reason=f"placement failed in Ray Train's controller ({failed.message}); starting a new one "
            f"from the last checkpoint (failure {budget_text(self.failures, self.max_failures)})",
            market=self.market,
            placement_reason=f"restarted after a controller error ({failed.error})",
            swappable=self.swappable(self.market),
        )
