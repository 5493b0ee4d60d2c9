"""The driver of a run: one Ray Train fit() per placement until one finishes the run (spot-first, swap to spot
and grow at a checkpoint, start the next placement ahead of a reclaim), and the run's summary.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import ray

# torch loaded before ray.init(): job drivers that first imported torch after connecting (with pyarrow's S3
# client loaded) were seen dying with "Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so".
import torch  # noqa: F401  (imported for its side effect on library load order)
from ray.exceptions import ActorDiedError
from ray.train import ControllerError

from elastic.config.spec import JobSpec
from elastic.driver import capacity
from elastic.driver.ray_config import build_trainer
from elastic.driver.runs import RunSummary, checkpoint_uri, run_directory, write_summary
from elastic.errors import ClusterError, JobFailed
from elastic.placement import policy
from elastic.placement.control import Placement, PlacementControl, new_placement_id
from elastic.placement.messages import Acknowledgement
from elastic.worker.sharing import TrialSharing


def run_job(spec: JobSpec, run_name: str) -> RunSummary:
    """Run the job to completion on the connected Ray cluster and write its summary next to its checkpoints."""
    try:
        ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=True)
    except ConnectionError:
        raise ClusterError("no Ray cluster to run on; start one with `elastic local up` or set RAY_ADDRESS") from None
    run_uri = run_directory(spec, run_name)
    workers = spec.workers
    # Ray Train looks for drains of the run's nodes every 5 s by default: a 30 s GCP/Azure notice would lose a
    # sixth of its window before the just-in-time checkpoint is even planned. Ray propagates it to its actors.
    os.environ.setdefault("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "1")
    # And the controller polls its workers every 2 s: a placement that ends at a just-in-time checkpoint a few
    # seconds before the deadline must be seen finished before the deadline passes, and every fraction of a
    # second until it is seen is a second the next placement waits for the workers' slots.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
    print(f"[elastic] run {run_name}: {workers.min}"
          + (f"..{workers.max_workers}" if workers.elastic else "")
          + f" workers on {workers.market} nodes, checkpoints in {run_uri}", flush=True)
    started = time.monotonic()
    error: str | None = None
    metrics: dict = {}
    checkpoint: str | None = None
    placements: list[dict] = []
    try:
        result = fit_run(spec, run_name, run_uri, placements)
        metrics = dict(result.metrics or {})
        checkpoint = checkpoint_uri(spec, result.checkpoint)
    except Exception as err:  # the run's own failure: reported in the summary and the job status
        error = f"{type(err).__name__}: {err}"
    summary = RunSummary(
        run_name=run_name,
        run_uri=run_uri,
        status="FAILED" if error else "SUCCEEDED",
        metrics=metrics,
        checkpoint=checkpoint,
        error=error,
        seconds=round(time.monotonic() - started, 1),
        placements=placements,
    )
    write_summary(spec, run_name, summary)
    print(f"[elastic] summary {json.dumps(asdict(summary), default=str)}", flush=True)
    if error:
        raise JobFailed(run_name, "FAILED", error)
    return summary


def fit_run(spec: JobSpec, run_name: str, run_uri: str, placements: list[dict],
            sharing: TrialSharing | None = None):
    """Run to the end: the driver's sequence of placements (_run_placements). A sweep trial (`sharing`) is one
    fit() unless spot-first: Tune already schedules trials by capacity, and a trial's just-in-time checkpoint
    then waits for Ray Train's restart."""
    if sharing is not None and spec.workers.market != "spot-first":
        return build_trainer(spec, run_name, sharing=sharing).fit()
    return _run_placements(spec, run_name, run_uri, placements, sharing)


def _run_placements(spec: JobSpec, run_name: str, run_uri: str, placements: list[dict],
                    sharing: TrialSharing | None = None):
    """The driver loop: one fit() per placement, until one finishes the run.

    A placement ends early, always at a committed checkpoint and with no step lost, when
    - a node of the run is being reclaimed (the sessions' just-in-time checkpoint): the run continues on what
      remains, shrunk if elastic, or waits for a replacement node if its worker count is fixed; counted
      against failure.max_preemptions;
    - spot-first runs on on-demand and spot capacity is back (SwapWatcher): it moves to spot;
    - an elastic run is below max and capacity for more workers has held steady (GrowWatcher): it grows.
    Each decision is logged with its reason.

    The next placement starts as soon as the sessions acknowledge the end (after their checkpoint committed),
    not when fit() returns: Ray's controller of the ending placement takes a second or two to notice and shut
    its workers down, and a new controller takes seconds to start; they overlap. The ending placement's slots
    count as free when sizing the next one."""
    workers = spec.workers
    poll = float(os.environ.get(policy.POLL_SECONDS_VARIABLE) or policy.DEFAULT_POLL_SECONDS)
    control = PlacementControl(run_uri)
    control.clear()  # leftovers of an earlier job of this run name
    spot_first = workers.market == "spot-first"
    market, why = (None, "") if spot_first else (workers.market, f"workers.market is {workers.market}")
    preemptions = failures = 0
    released: dict[str, int] | None = None  # slots the previous placement's workers are freeing, per node
    ending: _Fitting | None = None  # the previous placement's fit(), still shutting down
    ahead: _Started | None = None  # the next placement, started before the current one ended

    def start(sized: policy.Decision, reason: str, follows: str | None = None) -> _Started:
        swappable = spot_first and market == policy.ON_DEMAND and workers.swap_to_spot
        placement = Placement(id=new_placement_id(), market=market, swappable=swappable, reason=reason,
                              workers=sized.spot_slots,
                              resizable=workers.elastic and sized.spot_slots < workers.max_workers,
                              avoid_nodes=capacity.draining_nodes(), follows=follows)
        if spot_first and not swappable:
            capacity.hint_spot_demand(workers, on=False)  # on spot now, or staying on on-demand
        record = {"market": placement.market, "workers": placement.workers, "reason": placement.reason,
                  "started": time.time()}
        placements.append(record)
        print(f"[elastic] placement {placement.id}: {placement.workers} worker(s) on {placement.market} nodes"
              + (f", started ahead of the end of placement {follows}" if follows else ""), flush=True)
        watcher = None
        if placement.swappable:
            watcher = capacity.SwapWatcher(workers, control, placement.id, poll_seconds=poll).start()
        elif placement.resizable:
            watcher = capacity.GrowWatcher(workers, control, placement.id, market, poll_seconds=poll).start()
        return _Started(placement, record, watcher, _Fitting(build_trainer(spec, run_name, placement, sharing)))

    def start_ahead(current: Placement) -> _Started | None:
        """At a reclaim notice, once its just-in-time checkpoint is due within START_AHEAD_SECONDS and the notice
        has settled (NOTICE_SETTLE_SECONDS): start the next placement now, sized with the ending placement's
        slots and avoiding the nodes draining by then, so the new controller is up by the time the old workers
        are gone. Its sessions wait for the old placement's acknowledgement."""
        notice = control.ending_soon(current.id)
        now = time.time()
        if notice is None or notice.eta - now > START_AHEAD_SECONDS \
                or now - notice.time < NOTICE_SETTLE_SECONDS:
            return None
        sized = policy.decide_workers(workers, capacity.observe_nodes(), market,
                                      dict(Counter(notice.nodes)))
        if sized.action != "start":
            return None  # too few slots even with the ending ones: sized after the end, as usual
        return start(sized, "resumed after a reclaim", follows=current.id)

    try:
        while True:
            if ahead is not None:
                started, ahead = ahead, None
            else:
                if market is None:  # spot-first: at start and after a reclaim, spot if it comes within the wait
                    capacity.hint_spot_demand(workers)
                    decision = capacity.wait_for_spot(workers, poll_seconds=poll)
                    market, why = decision.action, decision.reason
                sized = capacity.wait_for_workers(workers, market, released=released,
                                                on_wait=lambda d: control.set_status("waiting", d.reason))
                started = start(sized, why)
            current, record, fitting = started.placement, started.record, started.fitting
            control.set_status("running", f"{current.workers} worker(s) on {current.market} nodes ({current.reason})")
            if ending is not None:
                ending.finish_quietly()
                ending = None

            looked = 0.0

            def watch() -> None:
                nonlocal ahead, looked
                if ahead is None and not spot_first and time.monotonic() - looked >= 1.0:
                    looked = time.monotonic()
                    ahead = start_ahead(current)  # noqa: B023 (called within this iteration only)

            try:
                ended = fitting.wait_for_end(lambda: control.ended(current.id), watch)  # noqa: B023 (same)
            finally:
                started.stop_watcher()
            if ended is None:
                ended = control.ended(current.id)  # acknowledged just as fit() returned
            if ended is None and ahead is not None:
                # The placement went on (its just-in-time save failed) or the run finished first: the one
                # started ahead must not train.
                ahead.call_off(control)
                placements.remove(ahead.record)
                ahead = None
            if ended is None:
                if fitting.error is not None:
                    if not _retry_controller_error(fitting.error, spec, record, failures := failures + 1):
                        raise fitting.error
                    why = f"restarted after a controller error ({type(fitting.error).__name__})"
                    released = None
                    continue
                control.clear()
                return fitting.result  # the run finished (or an end was asked for too late to matter)
            control.clear(keep_ended=ahead is not None)
            ending, released = fitting, dict(Counter(ended.nodes))
            kind = ended.kind.value
            record.update(ended_at_step=ended.step, ended_by=kind)
            if kind == "preemption":
                preemptions += 1
                print(f"[elastic] placement {current.id}: a node is being reclaimed; ended at the just-in-time "
                      f"checkpoint of step {ended['step']} (preemption {preemptions}"
                      + (f" of {spec.failure.max_preemptions}" if spec.failure.max_preemptions >= 0 else "")
                      + "); resuming from it", flush=True)
                if 0 <= spec.failure.max_preemptions < preemptions:
                    raise RuntimeError(f"preempted {preemptions} times, over failure.max_preemptions "
                                       f"({spec.failure.max_preemptions}); raise it to keep going")
                why = f"resumed after a reclaim at step {ended['step']}"
                if ahead is not None:
                    ahead.record["reason"] = why
                if spot_first:
                    market = None
            elif kind == "swap":
                print(f"[elastic] placement {current.id}: on-demand workers ended at the checkpoint of step "
                      f"{ended['step']}; resuming from it on spot", flush=True)
                market, why = policy.SPOT, f"swapped from on-demand at step {ended['step']}"
            else:
                print(f"[elastic] placement {current.id}: ended at the checkpoint of step {ended['step']} to grow",
                      flush=True)
                why = f"grown at step {ended['step']}"
    finally:
        if ahead is not None:  # leaving on an error: the placement started ahead must not train
            ahead.call_off(control)
        if ending is not None:
            ending.finish_quietly()
        if spot_first:
            capacity.hint_spot_demand(workers, on=False)


# The next placement is started this long before the ending one's just-in-time checkpoint is due, so that its
# new Ray Train controller is up and asking for workers when the old ones are released. A controller took 5-7 s
# to come up on a busy 2-core machine; at 6 s it was late in half the reclaims measured, and those restarts
# took 4-7 s longer. Starting earlier costs only the controller's start-up CPU during a few more steps.
START_AHEAD_SECONDS = 12.0
# ...but not before the reclaim notice is this old: correlated reclaims reach their nodes' watchers a poll apart
# (AWS asks for one poll every 5 s), and a placement sized before the second drain is known could land on it.
NOTICE_SETTLE_SECONDS = 5.0


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

    def call_off(self, control) -> None:
        """A placement started ahead whose predecessor went on: its sessions exit without training."""
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

    def wait_for_end(self, acknowledged: Callable[[], Acknowledgement | None],
                     on_poll: Callable[[], None] = lambda: None) -> Acknowledgement | None:
        """Until fit() returns (None) or the sessions acknowledge the placement's end (the acknowledgement).
        `on_poll` runs between polls (the driver starts the next placement ahead from there)."""
        while self._thread.is_alive():
            ended = acknowledged()
            if ended is not None:
                return ended
            try:
                on_poll()
            except Exception as err:  # loop boundary: a failed look-ahead only loses the head start
                print(f"[elastic] could not start the next placement ahead ({type(err).__name__}: {err})",
                      flush=True)
            self._thread.join(self.ACK_POLL_SECONDS)
        return None

    def finish_quietly(self) -> None:
        """Wait for an ended placement's fit() to return. Its checkpoint is committed and the next placement
        resumes from it, so a failure in its shutdown is only logged."""
        self._thread.join()
        if self.error is not None:
            print(f"[elastic] the ended placement's shutdown failed ({type(self.error).__name__}: "
                  f"{str(self.error).strip()[:200]}); the run goes on from its checkpoint", flush=True)


def _retry_controller_error(err: Exception, spec: JobSpec, record: dict, failures: int) -> bool:
    """A placement whose Ray Train controller failed (not the user's code: Ray retries that itself) is started
    again from the last committed checkpoint, within failure.max_failures. Seen: a worker of a placement
    started right after the previous one ended died importing torch because its working directory had just
    been garbage-collected by Ray's runtime env agent."""
    if not _controller_failed(err):
        return False
    limit = spec.failure.max_failures
    record["ended_by"] = "controller error"
    if 0 <= limit < failures:
        return False
    print(f"[elastic] placement failed in Ray Train's controller ({str(err).strip().splitlines()[-1][:200]}); "
          f"starting a new one from the last checkpoint (failure {failures}"
          + (f" of {limit}" if limit >= 0 else "") + ")", flush=True)
    return True


def _controller_failed(err: BaseException) -> bool:
    """Did fit() fail in Ray Train's controller rather than in the user's code?"""
    if isinstance(err, ControllerError):
        return True
    # Seen: the controller of a placement started ahead died in its constructor reading Ray Train's run snapshot
    # while the ending placement's controller rewrote it (pyarrow reads an S3 object with a HEAD and then ranged
    # GETs, so a concurrent rewrite tears the read: "Unterminated string"). Started again, it reads the settled
    # snapshot. Ray keeps only the message of a constructor's error, hence the name test.
    return isinstance(err, ActorDiedError) and err.actor_init_failed \
        and "CheckpointManagerInitializationError" in str(err)


