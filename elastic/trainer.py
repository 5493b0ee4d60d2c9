"""Builds and runs Ray Train V2's TorchTrainer from a job spec.

Elastic worker counts (min < max), separate failure and preemption budgets, storage at the job's checkpoint
URI, a deterministic run name (the same job resumes the same run), and placement on nodes of the job's
market by Ray node labels.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from elastic.errors import ClusterError, JobFailed, SpecError
from elastic.labels import worker_selector
from elastic.spec import FailureSpec, JobSpec, WorkersSpec
from elastic.storage import parse_uri, pyarrow_filesystem

SUMMARY_FILE = "elastic-summary.json"


# ---------------------------------------------------------------------------------------------------------
# Pure translations from spec to Ray config


# Ray's own resize of a running elastic group restarts it from the last checkpoint, losing the steps since,
# and was seen flapping 2 -> 1 -> 2 with both nodes up (its capacity view ignores node labels and drains).
# The driver grows a placement itself, at a checkpoint (placement.GrowWatcher); Ray's running resize is off.
NO_RUNNING_RESIZE_SECONDS = 10**9
NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries it (ray.util.placement_group.NODE_ID_LABEL_KEY)


def scaling_config(workers: WorkersSpec, market: str | None = None, count: int | None = None,
                   avoid_nodes: tuple[str, ...] = ()):
    """`market` overrides workers.market (spot-first runs each placement on spot or on-demand); `count` caps
    an elastic run at the workers the driver found room for (Ray may still start fewer, down to min, after a
    failure inside the placement)."""
    from ray.train import ScalingConfig

    resources = {"CPU": workers.cpus}
    if workers.gpus:
        resources["GPU"] = workers.gpus
    high = min(count, workers.max_workers) if count is not None else workers.max_workers
    num_workers: int | tuple[int, int] = (workers.min, high) if high > workers.min else workers.min
    selector = worker_selector(market or workers.market)
    if avoid_nodes:
        # Nodes being reclaimed: Ray's scheduler still places new workers there (seen: a worker of the next
        # placement started on the draining node, died with it, and cost a restart).
        selector = {**selector, NODE_ID_LABEL: f"!in({','.join(sorted(avoid_nodes))})"}
    return ScalingConfig(
        num_workers=num_workers,
        use_gpu=workers.gpus > 0,
        resources_per_worker=resources,
        label_selector=selector,
        elastic_resize_monitor_interval_s=NO_RUNNING_RESIZE_SECONDS,
    )


def failure_config(failure: FailureSpec):
    from ray.train import FailureConfig

    return FailureConfig(max_failures=failure.max_failures, max_preemption_failures=failure.max_preemptions)


def torch_backend(workers: WorkersSpec, logical_gpus: bool) -> str:
    """NCCL on real GPUs; gloo on CPU and on the logical GPUs the local cluster declares on a CPU machine."""
    return "nccl" if workers.gpus > 0 and not logical_gpus else "gloo"


def run_directory(spec: JobSpec, run_name: str) -> str:
    """URI of the run's folder: <checkpoint.uri>/<run name>."""
    return parse_uri(spec.checkpoint.uri).child(run_name).uri


@dataclass(frozen=True)
class TrialSharing:
    """A sweep trial's run (elastic.sweep): every worker asks for `share` of a GPU, ranks are placed by
    `strategy`, workers run elastic.sharing's wrapper, and (inside Tune) metrics flow to Tune."""

    share: float
    memory_fraction: float
    strategy: str = "PACK"
    probe_steps: int | None = None
    report_to_tune: bool = True


def build_trainer(spec: JobSpec, run_name: str, placement: Placement | None = None,
                  sharing: TrialSharing | None = None):
    """`placement` (from the driver loop) pins this fit() to a market and a size and tells the sessions how to
    end it; `sharing` makes it a sweep trial on a share of a GPU."""
    from ray.train import CheckpointConfig, RunConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    filesystem, storage_path = pyarrow_filesystem(spec.checkpoint.uri)
    logical_gpus = os.environ.get("ELASTIC_LOGICAL_GPUS") == "1"
    workers, function, callbacks = spec.workers, _worker_main, []
    payload = {"spec": spec.model_dump(mode="json"), "run_name": run_name,
               "placement": asdict(placement) if placement else None}
    if sharing is not None:
        from elastic.sharing import trial_worker_main

        workers, function = workers.model_copy(update={"gpus": sharing.share}), trial_worker_main
        payload["sharing"] = asdict(sharing)
        if sharing.report_to_tune:
            from ray.tune.integration.ray_train import TuneReportCallback

            callbacks = [TuneReportCallback()]
    scaling = scaling_config(workers, placement.market if placement else None,
                             placement.workers if placement else None, placement.avoid_nodes if placement else ())
    if sharing is not None:
        scaling = dataclasses.replace(scaling, placement_strategy=sharing.strategy)
    return TorchTrainer(
        function,
        train_loop_config=payload,
        torch_config=TorchConfig(backend=torch_backend(workers, logical_gpus)),
        scaling_config=scaling,
        run_config=RunConfig(
            name=run_name,
            storage_path=storage_path,
            storage_filesystem=filesystem,
            failure_config=failure_config(spec.failure),
            callbacks=callbacks,
            # Retention is ours (elastic.checkpoint): after a newer commit, marker first, folder kept as a
            # tombstone so Ray's run snapshot stays valid. Ray's own pruning ran too late to rely on at run end.
            checkpoint_config=CheckpointConfig(num_to_keep=None),
        ),
    )


# ---------------------------------------------------------------------------------------------------------
# Driver


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


@dataclass(frozen=True)
class RunSummary:
    run_name: str
    run_uri: str
    status: str
    metrics: dict
    checkpoint: str | None
    error: str | None
    seconds: float
    # spot-first: every placement in order, e.g. [{"market": "on-demand", "ended_at_step": 60, ...}, ...]
    placements: list = field(default_factory=list)


def run_job(spec: JobSpec, run_name: str) -> RunSummary:
    """Run the job to completion on the connected Ray cluster and write its summary next to its checkpoints."""
    # torch before ray.init: job drivers that first imported torch after connecting (with pyarrow's S3
    # client loaded) were seen dying with "Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so".
    import torch  # noqa: F401  (imported for its side effect on library load order)
    import ray

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
        checkpoint = _checkpoint_uri(spec, result.checkpoint)
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
    _write_summary(spec, run_name, summary)
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
    from elastic import placement as policy

    workers = spec.workers
    poll = float(os.environ.get(policy.POLL_SECONDS_VARIABLE) or policy.DEFAULT_POLL_SECONDS)
    control = policy.PlacementControl(run_uri)
    control.clear()  # leftovers of an earlier job of this run name
    spot_first = workers.market == "spot-first"
    market, why = (None, "") if spot_first else (workers.market, f"workers.market is {workers.market}")
    preemptions = failures = 0
    released: dict[str, int] | None = None  # slots the previous placement's workers are freeing, per node
    ending: _Fitting | None = None  # the previous placement's fit(), still shutting down
    ahead: _Started | None = None  # the next placement, started before the current one ended

    def start(sized: policy.Decision, reason: str, follows: str | None = None) -> _Started:
        swappable = spot_first and market == policy.ON_DEMAND and workers.swap_to_spot
        placement = Placement(id=policy.new_placement_id(), market=market, swappable=swappable, reason=reason,
                              workers=sized.spot_slots,
                              resizable=workers.elastic and sized.spot_slots < workers.max_workers,
                              avoid_nodes=policy.draining_nodes(), follows=follows)
        if spot_first and not swappable:
            policy.hint_spot_demand(workers, on=False)  # on spot now, or staying on on-demand
        record = {"market": placement.market, "workers": placement.workers, "reason": placement.reason,
                  "started": time.time()}
        placements.append(record)
        print(f"[elastic] placement {placement.id}: {placement.workers} worker(s) on {placement.market} nodes"
              + (f", started ahead of the end of placement {follows}" if follows else ""), flush=True)
        watcher = None
        if placement.swappable:
            watcher = policy.SwapWatcher(workers, control, placement.id, poll_seconds=poll).start()
        elif placement.resizable:
            watcher = policy.GrowWatcher(workers, control, placement.id, market, poll_seconds=poll).start()
        return _Started(placement, record, watcher, _Fitting(build_trainer(spec, run_name, placement, sharing)))

    def start_ahead(current: Placement) -> _Started | None:
        """At a reclaim notice, once its just-in-time checkpoint is due within START_AHEAD_SECONDS and the notice
        has settled (NOTICE_SETTLE_SECONDS): start the next placement now, sized with the ending placement's
        slots and avoiding the nodes draining by then, so the new controller is up by the time the old workers
        are gone. Its sessions wait for the old placement's acknowledgement."""
        notice = control.ending_soon(current.id)
        now = time.time()
        if notice is None or notice["eta"] - now > START_AHEAD_SECONDS \
                or now - notice["time"] < NOTICE_SETTLE_SECONDS:
            return None
        sized = policy.decide_workers(workers, policy.observe_nodes(), market,
                                      dict(Counter(notice.get("nodes") or [])))
        if sized.action != "start":
            return None  # too few slots even with the ending ones: sized after the end, as usual
        return start(sized, "resumed after a reclaim", follows=current.id)

    try:
        while True:
            if ahead is not None:
                started, ahead = ahead, None
            else:
                if market is None:  # spot-first: at start and after a reclaim, spot if it comes within the wait
                    policy.hint_spot_demand(workers)
                    decision = policy.wait_for_spot(workers, poll_seconds=poll)
                    market, why = decision.action, decision.reason
                sized = policy.wait_for_workers(workers, market, released=released,
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
                    ahead = start_ahead(current)

            try:
                ended = fitting.wait_for_end(lambda: control.ended(current.id), watch)
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
            ending, released = fitting, dict(Counter(ended.get("nodes") or []))
            kind = ended.get("kind", "swap")
            record.update(ended_at_step=ended["step"], ended_by=kind)
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
            policy.hint_spot_demand(workers, on=False)


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
    fitting: "_Fitting"

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

    def wait_for_end(self, acknowledged: Callable[[], dict | None],
                     on_poll: Callable[[], None] = lambda: None) -> dict | None:
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
    from ray.exceptions import ActorDiedError
    from ray.train import ControllerError

    if isinstance(err, ControllerError):
        return True
    # Seen: the controller of a placement started ahead died in its constructor reading Ray Train's run snapshot
    # while the ending placement's controller rewrote it (pyarrow reads an S3 object with a HEAD and then ranged
    # GETs, so a concurrent rewrite tears the read: "Unterminated string"). Started again, it reads the settled
    # snapshot. Ray keeps only the message of a constructor's error, hence the name test.
    return isinstance(err, ActorDiedError) and err.actor_init_failed \
        and "CheckpointManagerInitializationError" in str(err)


def read_summary(spec: JobSpec, run_name: str) -> dict | None:
    from elastic.storage import fsspec_filesystem

    fs, path = fsspec_filesystem(run_directory(spec, run_name))
    target = f"{path}/{SUMMARY_FILE}"
    if not fs.exists(target):
        return None
    with fs.open(target, "r") as handle:
        return json.load(handle)


def _write_summary(spec: JobSpec, run_name: str, summary: RunSummary) -> None:
    from elastic.storage import fsspec_filesystem

    fs, path = fsspec_filesystem(run_directory(spec, run_name))
    fs.makedirs(path, exist_ok=True)
    with fs.open(f"{path}/{SUMMARY_FILE}", "w") as handle:
        json.dump(asdict(summary), handle, indent=2, default=str)


def _checkpoint_uri(spec: JobSpec, checkpoint) -> str | None:
    if checkpoint is None:
        return None
    location = parse_uri(spec.checkpoint.uri)
    return f"{location.scheme}://{checkpoint.path}" if location.is_object_store else checkpoint.path


# ---------------------------------------------------------------------------------------------------------
# Worker side


def _worker_main(payload: dict) -> None:
    """Runs on every training worker: build the session and call the job's function with it."""
    from elastic.session import Session

    from elastic.placement import PlacementEnded

    # The first DistributedDataParallel(...) imports torch._dynamo (sympy included): a second or two of a
    # restart's critical path. Start it now; the session's setup (S3 client, collectives, the wait for a
    # predecessor placement) waits on the network meanwhile.
    threading.Thread(target=importlib.import_module, args=("torch._dynamo",), name="elastic-import",
                     daemon=True).start()
    spec = JobSpec.model_validate(payload["spec"])
    function = resolve_entrypoint(spec.entrypoint)
    try:
        function(Session(spec, payload["run_name"], placement=payload.get("placement")))
    except PlacementEnded:
        # The driver asked this placement to end (spot-first moving to spot) and it did, at a committed
        # checkpoint. Returning normally lets Ray Train finish the run cleanly: no failure budget is spent.
        return


def resolve_entrypoint(entrypoint: str) -> Callable[..., Any]:
    """`path/to/file.py:function` (relative to the working dir or sys.path) or `package.module:function`."""
    target, _, name = entrypoint.rpartition(":")
    if target.endswith(".py"):
        module = _load_file_module(target)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise SpecError(f"entrypoint: cannot import {target} ({err}); check the module path") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise SpecError(f"entrypoint: {target} has no function {name}; check the name after ':'")
    return function


def _load_file_module(relative: str):
    for base in [os.getcwd(), *sys.path]:
        candidate = Path(base or ".") / relative
        if candidate.is_file():
            module_name = "elastic_job_" + Path(relative).with_suffix("").as_posix().replace("/", "_").replace("-", "_")
            if module_name in sys.modules:
                return sys.modules[module_name]
            spec = importlib.util.spec_from_file_location(module_name, candidate)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module  # so pickled objects defined in the file can be found again
            spec.loader.exec_module(module)
            return module
    raise SpecError(f"entrypoint: {relative} not found in the working dir; submit from the project root")


def check_entrypoint(spec: JobSpec, working_dir: Path) -> None:
    """Client-side check, without importing user code: the file exists and defines the function."""
    import ast

    target, name = spec.entrypoint_target, spec.entrypoint_function
    if not target.endswith(".py"):
        return  # a module path is importable only in the job's environment; checked when the job starts
    path = working_dir / target
    if not path.is_file():
        raise SpecError(f"entrypoint: {target} not found under {working_dir}; fix the path or submit from the project root")
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except SyntaxError as err:
        raise SpecError(f"entrypoint: {target}:{err.lineno}: syntax error ({err.msg}); fix the file") from None
    if name not in _top_level_names(tree):
        functions = sorted(n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        raise SpecError(f"entrypoint: {target} defines no function '{name}'; functions there: "
                        f"{', '.join(functions) or 'none'}")


def _top_level_names(tree) -> set[str]:
    """Names a module binds at top level: defs, classes, assignments and imports (any may be the entry)."""
    import ast

    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names
