"""The driver loop's thin executor: observe (acknowledgement files, the fit() thread's end or error, reclaim
notices), feed what it saw to the pure elastic.placement.loop.PlacementLoop as events, and carry out each
decision (start fit() in a thread, call off a placement started ahead, wait for capacity), logging every one
with its reason.

A placement ends early, always at a committed checkpoint and with no step lost, when
- a node of the run is being reclaimed (the sessions' just-in-time checkpoint): the run continues on what
  remains, shrunk if elastic, or waits for a replacement node if its worker count is fixed; counted against
  failure.max_preemptions;
- spot-first runs on on-demand and spot capacity is back (capacity.SwapWatcher): it moves to spot;
- an elastic run is below max and capacity for more workers has held steady (capacity.GrowWatcher): it grows.

The next placement starts as soon as the sessions acknowledge the end (after their checkpoint committed), not
when fit() returns: Ray's controller of the ending placement takes a second or two to notice and shut its
workers down, and a new controller takes seconds to start; they overlap. The ending placement's slots count as
free when sizing the next one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ray.exceptions import ActorDiedError
from ray.train import ControllerError

from elastic.config.spec import JobSpec
from elastic.driver import capacity
from elastic.driver.ray_config import build_trainer
from elastic.ledger import LedgerWriter, NoLedger
from elastic.ledger.events import CapacityWaited, PlacementEnded, PlacementStarted
from elastic.observability.metrics import run_metrics
from elastic.placement import loop as decisions
from elastic.placement import policy
from elastic.placement.control import Placement, PlacementControl, new_placement_id
from elastic.placement.messages import Acknowledgement, EndKind
from elastic.worker.sharing import TrialSharing

logger = logging.getLogger(__name__)


class PlacementExecutor:
    """One run's placements: `run()` until one finishes the run; returns its fit() result."""

    def __init__(
        self,
        spec: JobSpec,
        run_name: str,
        run_uri: str,
        placements: list[dict],
        sharing: TrialSharing | None = None,
        ledger: LedgerWriter | NoLedger | None = None,
    ):
        self.spec, self.run_name, self.placements, self.sharing = spec, run_name, placements, sharing
        self.ledger = ledger if ledger is not None else NoLedger()
        self.workers = spec.workers
        self.loop = decisions.PlacementLoop(spec)
        self.poll = float(os.environ.get(policy.POLL_SECONDS_VARIABLE) or policy.DEFAULT_POLL_SECONDS)
        self.control = PlacementControl(run_uri)
        self.released: dict[str, int] | None = None  # slots the previous placement's workers are freeing
        self.ending: _Fitting | None = None  # the previous placement's fit(), still shutting down
        self.ahead: _Started | None = None  # the next placement, started before the current one ended
        self.metrics = run_metrics(run_name)  # preemptions and placement size by market, from the driver

    def run(self):
        self.control.clear()  # leftovers of an earlier job of this run name
        decision = self._decide(decisions.RunStarting())
        try:
            while True:
                started = self._start_next(decision)
                current, record, fitting = started.placement, started.record, started.fitting
                self.control.set_status(
                    "running", f"{current.workers} worker(s) on {current.market} nodes ({current.reason})"
                )
                if self.ending is not None:
                    self.ending.finish_quietly()
                    self.ending = None
                ended = self._watch(started)
                if ended is None and self.ahead is not None:
                    # The placement went on (its just-in-time save failed) or the run finished first: the one
                    # started ahead must not train.
                    self.ahead.call_off(self.control)
                    self._ended(self.ahead.placement, "called off")
                    self.placements.remove(self.ahead.record)
                    self.ahead = None
                if ended is None:
                    if fitting.error is None:
                        self._ended(current, "finished")
                        self.control.clear()
                        self._decide(decisions.RunFinished(), prefix="")
                        return fitting.result  # the run finished (or an end was asked for too late to matter)
                    retryable = controller_failed(fitting.error)
                    if retryable:
                        record["ended_by"] = "controller error"
                    self._ended(current, "controller error" if retryable else "failed")
                    decision = self._decide(
                        decisions.ControllerFailed(type(fitting.error).__name__, _last_line(fitting.error), retryable),
                        prefix="",
                    )
                    if isinstance(decision, decisions.Fail):
                        raise fitting.error
                    self.released = None
                    continue
                self.control.clear(keep_ended=self.ahead is not None)
                self.ending, self.released = fitting, dict(Counter(ended.nodes))
                record.update(ended_at_step=ended.step, ended_by=ended.kind.value)
                self._ended(current, ended.kind.value, ended.step)
                if ended.kind == EndKind.PREEMPTION:
                    self.metrics.preemption()
                decision = self._decide(
                    decisions.PlacementEnded(ended.step, ended.kind, ended.nodes), prefix=f"placement {current.id}: "
                )
                if isinstance(decision, decisions.Fail):
                    raise RuntimeError(decision.reason)
                if isinstance(decision, decisions.Start) and self.ahead is not None:
                    self.ahead.record["reason"] = decision.placement_reason
        finally:
            if self.ahead is not None:  # leaving on an error: the placement started ahead must not train
                self.ahead.call_off(self.control)
                self._ended(self.ahead.placement, "called off")
            if self.ending is not None:
                self.ending.finish_quietly()
            if self.loop.spot_first:
                capacity.hint_spot_demand(self.workers, on=False)

    def _decide(self, event: decisions.Event, prefix: str = "placement: ") -> decisions.Decision:
        """One step of the loop; every decision is logged with its reason (a quiet KeepRunning at debug)."""
        decision = self.loop.step(event)
        level = logging.DEBUG if isinstance(decision, decisions.KeepRunning) else logging.INFO
        logger.log(level, "%s%s", prefix, decision.reason)
        return decision

    def _start_next(self, decision: decisions.Decision) -> _Started:
        """Carry out a decision that starts the next placement: take over the one started ahead, or wait for
        spot (spot-first) and for slots, then start fit()."""
        if self.ahead is not None:
            started, self.ahead = self.ahead, None
            return started
        while isinstance(decision, decisions.WaitForCapacity):  # spot-first: spot if it comes within the wait
            capacity.hint_spot_demand(self.workers)
            waited = time.time()
            chosen = capacity.wait_for_spot(self.workers, poll_seconds=self.poll)
            self._waited(waited, "spot", chosen.reason)
            decision = self.loop.step(decisions.SpotDecided(chosen.action, chosen.reason))  # wait_for_spot logged it
        assert isinstance(decision, decisions.StartsPlacement), decision
        waited, reasons = time.time(), []

        def on_wait(d) -> None:
            reasons.append(d.reason)
            self.control.set_status("waiting", d.reason)

        sized = capacity.wait_for_workers(self.workers, decision.market, released=self.released, on_wait=on_wait)
        if reasons:
            self._waited(waited, decision.market, reasons[-1])
        return self._start(decision, sized)

    def _waited(self, started: float, market: str, reason: str) -> None:
        """The run ledger: the driver waited for capacity from `started` until now (under 0.5 s: no wait)."""
        if time.time() - started >= 0.5:
            self.ledger.record(CapacityWaited(started, ended=time.time(), market=market, reason=reason))

    def _ended(self, placement: Placement, ended_by: str, step: int | None = None) -> None:
        # Written by the ledger's thread within seconds: a reclaim's critical path never waits on storage.
        self.ledger.record(PlacementEnded(time.time(), placement=placement.id, ended_by=ended_by, step=step))

    def _watch(self, started: _Started) -> Acknowledgement | None:
        """Until the placement's sessions acknowledge its end or its fit() returns. Meanwhile, once a second,
        a reclaim notice goes to the loop, which may start the next placement ahead."""
        current, looked = started.placement, 0.0

        def look_ahead() -> None:
            nonlocal looked
            if self.ahead is not None or self.loop.spot_first or time.monotonic() - looked < 1.0:
                return
            looked = time.monotonic()
            notice = self.control.ending_soon(current.id)
            if notice is None:
                return
            decision = self._decide(
                decisions.EndingSoon(notice.eta, notice.time, notice.nodes, time.time()),
                prefix=f"placement {current.id}: ",
            )
            if isinstance(decision, decisions.StartAhead):
                self.ahead = self._start_ahead(decision, current)

        try:
            ended = started.fitting.wait_for_end(lambda: self.control.ended(current.id), look_ahead)
        finally:
            started.stop_watcher()
        return ended if ended is not None else self.control.ended(current.id)  # acknowledged as fit() returned

    def _start_ahead(self, decision: decisions.StartAhead, current: Placement) -> _Started | None:
        """Sized with the ending placement's slots and avoiding the nodes draining by then, so the new controller
        is up by the time the old workers are gone. Its sessions wait for the old placement's acknowledgement."""
        sized = policy.decide_workers(self.workers, capacity.observe_nodes(), decision.market, decision.released)
        if sized.action != "start":
            return None  # too few slots even with the ending ones: sized after the end, as usual
        return self._start(decision, sized, follows=current.id)

    def _start(
        self, decision: decisions.StartsPlacement, sized: policy.Decision, follows: str | None = None
    ) -> _Started:
        workers = self.workers
        placement = Placement(
            id=new_placement_id(),
            market=decision.market,
            swappable=decision.swappable,
            reason=decision.placement_reason,
            workers=sized.spot_slots,
            resizable=workers.elastic and sized.spot_slots < workers.max_workers,
            avoid_nodes=capacity.draining_nodes(),
            follows=follows,
        )
        if self.loop.spot_first and not placement.swappable:
            capacity.hint_spot_demand(workers, on=False)  # on spot now, or staying on on-demand
        record = {
            "market": placement.market,
            "workers": placement.workers,
            "reason": placement.reason,
            "started": time.time(),
        }
        self.placements.append(record)
        self.ledger.record(
            PlacementStarted(
                record["started"],
                placement=placement.id,
                market=placement.market,
                workers=placement.workers,
                cpus_per_worker=workers.cpus,
                gpus_per_worker=self.sharing.share if self.sharing is not None else workers.gpus_at_most,
                reason=placement.reason,
                follows=follows,
            )
        )
        self.metrics.placement(placement.market, placement.workers)
        logger.info(
            "placement %s: %s worker(s) on %s nodes%s",
            placement.id,
            placement.workers,
            placement.market,
            f", started ahead of the end of placement {follows}" if follows else "",
        )
        watcher = None
        if placement.swappable:
            watcher = capacity.SwapWatcher(workers, self.control, placement.id, poll_seconds=self.poll).start()
        elif placement.resizable:
            watcher = capacity.GrowWatcher(
                workers, self.control, placement.id, placement.market, poll_seconds=self.poll
            ).start()
        trainer = build_trainer(self.spec, self.run_name, placement, self.sharing)
        return _Started(placement, record, watcher, _Fitting(trainer))


@dataclass
class _Started:
    """A placement the driver started: its fit() in a thread, the record in the run summary, its watcher."""

    placement: Placement
    record: dict
    watcher: Any
    fitting: _Fitting

    def stop_watcher(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None

    def call_off(self, control: PlacementControl) -> None:
        """A placement started ahead whose predecessor went on: its sessions exit without training."""
        logger.info("placement %s: called off (its predecessor went on)", self.placement.id)
        control.cancel(self.placement.id)
        self.stop_watcher()
        self.fitting.finish_quietly()


class _Fitting:
    """One placement's fit(), run in a thread of its own so the driver can watch for the placement's end."""

    ACK_POLL_SECONDS = 0.25

    def __init__(self, trainer):
        self.result = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(trainer,), name="elastic-fit", daemon=True)
        self._thread.start()

    def _run(self, trainer) -> None:
        try:
            self.result = trainer.fit()
        except BaseException as err:  # handed to the driver loop, which retries or re-raises it
            self.error = err

    def wait_for_end(
        self, acknowledged: Callable[[], Acknowledgement | None], on_poll: Callable[[], None] = lambda: None
    ) -> Acknowledgement | None:
        """Until fit() returns (None) or the sessions acknowledge the placement's end (the acknowledgement).
        `on_poll` runs between polls (the driver starts the next placement ahead from there)."""
        while self._thread.is_alive():
            ended = acknowledged()
            if ended is not None:
                return ended
            try:
                on_poll()
            except Exception as err:  # loop boundary: a failed look-ahead only loses the head start
                logger.info("could not start the next placement ahead (%s: %s)", type(err).__name__, err)
            self._thread.join(self.ACK_POLL_SECONDS)
        return None

    def finish_quietly(self) -> None:
        """Wait for an ended placement's fit() to return. Its checkpoint is committed and the next placement
        resumes from it, so a failure in its shutdown is only logged."""
        self._thread.join()
        if self.error is not None:
            logger.info(
                "the ended placement's shutdown failed (%s: %s); the run goes on from its checkpoint",
                type(self.error).__name__,
                str(self.error).strip()[:200],
            )


def _last_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[-1][:200] if lines else ""


def controller_failed(err: BaseException) -> bool:
    """Did fit() fail in Ray Train's controller rather than in the user's code? Seen: a worker of a placement
    started right after the previous one ended died importing torch because its working directory had just
    been garbage-collected by Ray's runtime env agent."""
    if isinstance(err, ControllerError):
        return True
    # Seen: the controller of a placement started ahead died in its constructor reading Ray Train's run snapshot
    # while the ending placement's controller rewrote it (pyarrow reads an S3 object with a HEAD and then ranged
    # GETs, so a concurrent rewrite tears the read: "Unterminated string"). Started again, it reads the settled
    # snapshot. Ray keeps only the message of a constructor's error, hence the name test.
    return (
        isinstance(err, ActorDiedError) and err.actor_init_failed and "CheckpointManagerInitializationError" in str(err)
    )
