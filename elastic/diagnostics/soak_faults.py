"""The faulted run of a chaos soak (elastic.diagnostics.soak): one submission of the audited job with its in-worker
faults planned, and a loop that fires the other faults from outside as the run's committed checkpoints reach
their steps, one at a time: the next fault waits until the run has recovered from the previous one (a new
attempt reached a checkpoint, or a newer checkpoint committed), so every fault meets a running job.

How each fault is carried out on the local stack:
- node faults through elastic.local.preempt (the metadata endpoint, the watcher and the drain for noticed
  reclaims; a kill without notice for a hard loss), with a like node started after `replace_after` seconds;
- S3 faults through the stack's fault proxy (elastic.local.s3_faults): a burst of 503 SlowDown on checkpoint
  uploads, a burst of 500s on checkpoint reads opened just before a training worker is SIGKILLed (so the
  restore meets it), latency on every request until the next checkpoint commits;
- a driver kill through the job API (stop), then the same run resubmitted (at the next worker count when the
  soak moves through several): it resumes from its checkpoints.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from elastic.checkpoint.store import MARKER
from elastic.diagnostics.records import RunRecords, audited_spec
from elastic.diagnostics.soak_plan import (
    CORRELATED_RECLAIMS,
    DRIVER_KILLED,
    HARD_NODE_LOSS,
    NODE_FAULTS,
    NOTICED_RECLAIM,
    RESTARTS,
    S3_DATA_READ_ERRORS,
    S3_RESTORE_ERRORS,
    S3_SAVE_ERRORS,
    SAVE_KILL,
    SLOW_S3,
    Fault,
)
from elastic.driver import submit
from elastic.errors import ClusterError
from elastic.local import preempt
from elastic.local import stack as local
from elastic.local.fault_plan import ERROR_500, LATENCY, RESET, SLOW_DOWN
from elastic.local.s3_faults import FaultControl
from elastic.worker.audit import AUDIT_FOLDER
from elastic.worker.chaos import Kill

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0
S3_BURST = 2  # failed requests per burst: fewer than the bounded retries of one request (storage.S3_ATTEMPTS)
SLOW_SECONDS = 0.05  # added to every S3 request while the slow window lasts
STOP_TIMEOUT = 180.0
REPLACE_TIMEOUT = 400.0  # for a replacement node to join


@dataclass
class FaultRecord:
    """One planned fault and what became of it."""

    index: int
    kind: str
    step: int
    fired: bool = False
    fired_at: float | None = None  # unix time
    detail: str = ""


@dataclass
class FaultedRunResult:
    status: str
    faults: list[FaultRecord]
    seconds: float
    job_ids: list[str]


class FaultedRun:
    """Runs the job once under `faults` on the local stack; the records of the run stay in its run folder."""

    def __init__(
        self,
        spec,
        target: submit.Target,
        working_dir,
        suffix: str,
        control: FaultControl,
        progress: Callable[[str], None],
        notice_seconds: float,
        replace_after: float,
        step_seconds: float = 0.0,
        data_path: str | None = None,
    ):
        self.spec = spec
        self.data_path = data_path  # the training data's key prefix in the bucket, for its read faults
        self.target = target
        self.working_dir = working_dir
        self.suffix = suffix
        self.run_name = spec.run_name(suffix)
        self.control = control
        self.progress = progress
        self.notice_seconds = notice_seconds
        self.replace_after = replace_after
        self.step_seconds = step_seconds
        self.records = RunRecords(spec)
        self.store = self.records.store(self.run_name)
        self.jobs = submit.client(target)
        self.job_ids: list[str] = []
        self.plan: list[Kill] = []
        self.max_failures = 0
        self.counts: list[int] = []

    def run(self, faults: list[Fault], workers: list[int]) -> FaultedRunResult:
        records = [FaultRecord(f.index, f.kind, f.step) for f in faults]
        self.plan = [Kill(f.step, f.rank, during_save=f.kind == SAVE_KILL) for f in faults if f.in_worker]
        # Every fault may cost a failure (kills, hard losses, a restore after a kill); reclaims with notice
        # are preemptions, counted apart. Two spare: a fault may land while the run restarts from another.
        self.max_failures = len(faults) + 2
        self.counts = list(workers)
        outside = [r for r, f in zip(records, faults) if not f.in_worker]
        started = time.monotonic()
        self._submit()
        try:
            status = self._loop(outside)
        finally:  # whatever went wrong, no job of the soak and no fault outlives it
            self._quiet_proxy()
            self._stop_if_running()
        for record in outside:
            record.detail = "not fired: the run ended before it reached this step"
        for record, fault in zip(records, faults):
            if fault.in_worker:
                self._check_marker(record, fault)
        seconds = round(time.monotonic() - started, 1)
        return FaultedRunResult(status, records, seconds, list(self.job_ids))

    def _loop(self, outside: list[FaultRecord]) -> str:
        """Fire `outside` (taken off the list as they fire) until the job ends; returns its final status."""
        waiting: tuple[FaultRecord, Callable[[], bool], Callable[[], bool]] | None = None
        status = "PENDING"
        while True:
            status = str(self.jobs.get_job_status(self.job_ids[-1]).value)
            if status in submit.TERMINAL:
                break
            if waiting is not None and waiting[1]():
                self._settle(*waiting)
                waiting = None
            if waiting is None and outside:
                latest = self._latest_committed()
                if latest >= outside[0].step:
                    record = outside.pop(0)
                    waiting = self._fire(record, latest)
                    status = str(self.jobs.get_job_status(self.job_ids[-1]).value)
            time.sleep(POLL_SECONDS)
        if waiting is not None:  # the run ended first: the fault counts if it fired and the run recovered
            self._settle(*waiting)
        return status

    def _stop_if_running(self) -> None:
        if self.job_ids and str(self.jobs.get_job_status(self.job_ids[-1]).value) not in submit.TERMINAL:
            log.warning("stopping job %s: the soak ended before it", self.job_ids[-1])
            self.jobs.stop_job(self.job_ids[-1])

    # -- the job
    def _submit(self) -> None:
        workers = self.counts.pop(0) if len(self.counts) > 1 else self.counts[0]
        spec = audited_spec(self.spec, workers, self.plan, self.max_failures, self.step_seconds)
        submitted = submit.submit(
            spec, self.target, suffix=self.suffix, working_dir=self.working_dir, check_bucket=False
        )
        self.job_ids.append(submitted.job_id)
        self.progress(f"run {self.run_name}: job {submitted.job_id} at {workers} workers")

    def _latest_committed(self) -> int:
        # A listing, never a read of a checkpoint file: the soak's own polling must not meet its S3 windows.
        committed = [step for step, names in self.store.live_folders().items() if MARKER in names]
        return max(committed, default=0)

    def _attempts_since(self, moment: float) -> int:
        """Attempts of the run that started after `moment` (unix time) and reached a checkpoint."""
        folder = f"{self.store.root}/{AUDIT_FOLDER}"
        self.store.fs.invalidate_cache(folder)
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.store.fs.ls(folder, detail=False)]
        except FileNotFoundError:
            return 0
        return sum(1 for n in names if n.isdigit() and int(n) / 1e9 > moment)

    # -- firing
    def _fire(self, record: FaultRecord, latest: int):
        """Carry out one fault; returns (record, recovered, fired) checks for the loop."""
        self.progress(f"fault {record.index + 1}: {record.kind} (checkpoint at step {latest} committed)")
        record.fired_at = time.time()
        before = self.control.stats()["injected"]
        fired: Callable[[], bool]
        if record.kind in NODE_FAULTS:
            fired = self._reclaim(record)
        elif record.kind == S3_SAVE_ERRORS:
            self.control.open_window(
                SLOW_DOWN, requests=S3_BURST, match={"methods": ["PUT"], "path_contains": "/step-"}
            )
            fired = self._injected_since(before, SLOW_DOWN)
        elif record.kind == S3_RESTORE_ERRORS:
            self.control.open_window(
                ERROR_500, requests=S3_BURST, match={"methods": ["GET"], "path_contains": "/step-"}
            )
            killed = self._kill_a_training_worker(record, "checkpoint reads")
            fired = self._injected_since(before, ERROR_500) if killed else (lambda: False)
        elif record.kind == S3_DATA_READ_ERRORS:
            match = {"methods": ["GET"], "path_contains": self.data_path}
            self.control.open_window(SLOW_DOWN, requests=S3_BURST, match=match)
            self.control.open_window(RESET, requests=S3_BURST, match=match)
            # the restarted ranks read their data window again
            killed = self._kill_a_training_worker(record, "data reads")
            throttled, reset = self._injected_since(before, SLOW_DOWN), self._injected_since(before, RESET)
            fired = (lambda: throttled() and reset()) if killed else (lambda: False)
        elif record.kind == SLOW_S3:
            self.control.set_rates(latency=1.0, latency_seconds=SLOW_SECONDS)
            fired = self._injected_since(before, LATENCY)
        elif record.kind == DRIVER_KILLED:
            fired = self._kill_driver(record)
        else:
            raise ValueError(f"the soak does not fire {record.kind} from outside")
        if record.kind in RESTARTS:
            moment = record.fired_at
            return record, lambda: self._attempts_since(moment) > 0, fired
        return record, lambda: self._latest_committed() > latest, fired

    def _settle(self, record: FaultRecord, recovered: Callable[[], bool], fired: Callable[[], bool]) -> None:
        self._quiet_proxy()
        record.fired = bool(fired()) and bool(recovered())
        if not record.fired and not record.detail:
            record.detail = "no sign that it fired or that the run recovered from it"
        self.progress(f"fault {record.index + 1}: {record.kind} {'fired' if record.fired else 'did NOT fire'}")

    def _quiet_proxy(self) -> None:
        self.control.close_windows()
        self.control.set_rates()

    def _injected_since(self, before: dict, kind: str) -> Callable[[], bool]:
        return lambda: self.control.stats()["injected"][kind] > before[kind]

    def _reclaim(self, record: FaultRecord) -> Callable[[], bool]:
        count = 2 if record.kind == CORRELATED_RECLAIMS else 1
        state = local.running_state()
        nodes = preempt.select_nodes(state, market="spot", count=count)
        hard = record.kind == HARD_NODE_LOSS
        report = preempt.preempt(
            nodes, notice=None if hard else self.notice_seconds, hard=hard, log=lambda line: self.progress(f"  {line}")
        )
        if record.kind == NOTICED_RECLAIM or record.kind == CORRELATED_RECLAIMS:
            record.fired_at = min(r.announced_at or r.killed_at for r in report.reclaims)
        record.detail = ", ".join(f"{r.name} ({r.path})" for r in report.reclaims)
        time.sleep(self.replace_after)
        for reclaim in report.reclaims:
            # As an autoscaler would; on a saturated machine a node may take minutes to join: the run waits.
            try:
                node = local.add_node(reclaim.market, timeout=REPLACE_TIMEOUT)
                self.progress(f"  {reclaim.name}: replaced by {node['name']}")
            except ClusterError as err:
                log.warning("no replacement for %s: %s", reclaim.name, err)
                record.detail += f"; no replacement for {reclaim.name} ({err})"
        return lambda: all(r.processes_killed > 0 for r in report.reclaims)

    def _kill_a_training_worker(self, record: FaultRecord, failing: str) -> bool:
        from ray.util.state import list_actors  # ray's state API only when a soak runs: the CLI starts fast

        actors = list_actors(
            address=self.target.address, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False
        )
        pids = sorted(a.pid for a in actors if a.pid and "RayTrainWorker" in (a.class_name or ""))
        if not pids:
            record.detail = "no training worker alive to kill"
            return False
        os.kill(pids[0], signal.SIGKILL)
        record.detail = f"SIGKILL to training worker pid {pids[0]} with {failing} failing"
        return True

    def _kill_driver(self, record: FaultRecord) -> Callable[[], bool]:
        job_id = self.job_ids[-1]
        self.jobs.stop_job(job_id)
        deadline = time.monotonic() + STOP_TIMEOUT
        status = str(self.jobs.get_job_status(job_id).value)
        while status not in submit.TERMINAL and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
            status = str(self.jobs.get_job_status(job_id).value)
        record.detail = f"job {job_id} stopped ({status.lower()}), resubmitted"
        if status != "STOPPED":
            record.detail = f"job {job_id} ended {status} instead of STOPPED"
            return lambda: False
        self._submit()
        return lambda: True

    def _check_marker(self, record: FaultRecord, fault: Fault) -> None:
        name = f"kill-{'save' if fault.kind == SAVE_KILL else 'step'}-{fault.step}-rank-{fault.rank}"
        record.fired = name in self.records.fired(self.run_name, "kill")
        record.detail = f"rank {fault.rank} at step {fault.step}" + ("" if record.fired else ": no marker")
