"""`elastic sweep`: Ray Tune over Ray Train V2, with trials packed onto shared GPUs.

Each trial is a function trainable (elastic.sweep.trial: its "driver", a small CPU fraction on an on-demand
node) that runs one TorchTrainer under a deterministic run name, `<sweep>-<trial id>`, so a restarted trial
resumes from its own checkpoints. Its workers ask for the planned GPU share each and follow the job's market.
The experiment lives in storage (elastic.sweep.layout): running the same sweep again restores it
(Tuner.restore). This module plans the share (probe or spec), builds and runs the Tuner, and reports.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from collections.abc import Callable

from elastic.config.spec import JobSpec
from elastic.config.sweep_spec import SweepSpec, _example_value, trial_job
from elastic.driver.auth import auth_failure
from elastic.driver.probe import measured_probe, probe_run
from elastic.driver.submit import DEFAULT_EXCLUDES
from elastic.errors import ClusterError, UserError
from elastic.local import stack as local
from elastic.observability.tracking import MlflowRuns, sweep_parent_run
from elastic.placement import packing
from elastic.placement.labels import MARKET_LABEL, matches, worker_selector
from elastic.storage import parse_uri, pyarrow_filesystem
from elastic.sweep.layout import PLAN_FILE, TRIAL_FILE, experiment_uri, read_json, train_root, write_json
from elastic.sweep.ledger import end_sweep_ledger, start_sweep_ledger
from elastic.sweep.progress import Progress, SchedulerState
from elastic.sweep.trial import is_light, trial_main

log = logging.getLogger(__name__)

_TUNE_KEYS = {
    "timestamp",
    "time_this_iter_s",
    "time_total_s",
    "pid",
    "time_since_restore",
    "iterations_since_restore",
    "training_iteration",
}

GB = 1024**3


# ---------------------------------------------------------------------------------------------------------
# Storage layout


# ---------------------------------------------------------------------------------------------------------
# Plan: probe (auto) or the spec's share


def prepare_plan(sweep: SweepSpec, job: JobSpec, say: Callable[[str], None]) -> dict:
    """The packing plan of this sweep: read back from storage when the sweep is restored, else planned now."""
    uri = parse_uri(experiment_uri(sweep, job)).child(PLAN_FILE).uri
    saved = read_json(uri)
    if saved is not None:
        say(
            f"packing plan from {uri}: {saved['plan']['trials_per_gpu']} per GPU, share "
            f"{saved['plan']['share']} ({saved['plan']['reason']})"
        )
        return saved
    cfg = sweep.packing
    probe = None
    if not sweep.auto:
        plan = packing.fixed_plan(float(sweep.gpu_share))
    else:
        probe = run_probe(sweep, job, say)
        plan = packing.plan_packing(
            probe,
            headroom=cfg.headroom,
            context_bytes=int(cfg.context_gb * GB) if probe.source == "measured" else 0,
            max_per_gpu=cfg.max_per_gpu,
        )
    saved = {
        "plan": plan.to_json(),
        "probe": probe.to_json() if probe else None,
        "strategy": packing.rank_placement(job.workers.max_workers, plan.share),
    }
    write_json(uri, saved)
    say(
        f"packing plan: {plan.trials_per_gpu} trial(s) per GPU, share {plan.share}, memory cap "
        f"{plan.memory_fraction:.2%} per process, ranks {saved['strategy']} ({plan.reason})"
    )
    return saved


def run_probe(sweep: SweepSpec, job: JobSpec, say: Callable[[str], None]) -> packing.Probe:
    """A short Train run of the first configuration on a whole GPU: step time, and on CUDA the peak memory.
    Without CUDA there is no device memory to measure: the sweep's declared packing.gpu_memory_gb is used."""
    cfg = sweep.packing
    logical = os.environ.get("ELASTIC_LOGICAL_GPUS") == "1"
    if logical and cfg.gpu_memory_gb is None:
        raise UserError(
            "gpu_share auto on logical GPUs (no CUDA) needs packing.gpu_memory_gb, the declared "
            "peak memory of one trial; set it or give gpu_share a number"
        )
    measured = {}
    if cfg.probe:
        params = {key: _example_value(p) for key, p in sweep.space.items()}
        probe_job = trial_job(job, params).model_copy(
            update={"checkpoint": job.checkpoint.model_copy(update={"uri": train_root(sweep, job)})}
        )
        measured = probe_run(probe_job, f"{sweep.name}-probe", cfg.probe_steps, say)
    found = measured_probe(measured)
    if found is not None:
        return found
    if cfg.gpu_memory_gb is None:
        raise UserError("gpu_share auto without a probe measure needs packing.gpu_memory_gb; set it")
    return packing.Probe(
        int(cfg.gpu_memory_gb * GB), int(cfg.device_memory_gb * GB), measured.get("step_seconds"), "declared"
    )


# ---------------------------------------------------------------------------------------------------------
# The trial driver (a Tune function trainable)


def param_space(sweep: SweepSpec) -> dict:
    from ray import tune

    space = {}
    for key, param in sweep.space.items():
        if param.choice is not None:
            space[key] = tune.choice(param.choice)
        elif param.grid is not None:
            space[key] = tune.grid_search(param.grid)
        elif param.uniform is not None:
            space[key] = tune.uniform(*param.uniform)
        else:
            space[key] = tune.loguniform(*param.loguniform)
    return space


def scheduler(sweep: SweepSpec):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    spec = sweep.scheduler
    if spec.type == "asha":
        return ASHAScheduler(
            time_attr=spec.time_attr,
            max_t=spec.max_t,
            grace_period=spec.grace_period,
            reduction_factor=spec.reduction_factor,
        )
    if spec.type == "pbt":
        from elastic.sweep.pbt import PinningPBT

        space = param_space(sweep)
        return PinningPBT(
            run_name_of=functools.partial(_trial_run_name, sweep.name),
            time_attr=spec.time_attr,
            perturbation_interval=spec.perturbation_interval,
            hyperparam_mutations={k: space[k] for k in sweep.pbt_keys()},
            quantile_fraction=spec.quantile_fraction,
        )
    return FIFOScheduler()


def restore_tuner(experiment_path: str, filesystem, trainable, space: dict):
    """Tune's experiment as stored, to finish: unfinished and errored trials resume (from their own checkpoints)."""
    from ray import tune

    return tune.Tuner.restore(
        experiment_path,
        trainable,
        resume_unfinished=True,
        resume_errored=True,
        param_space=space,
        storage_filesystem=filesystem,
    )


def _trial_run_name(sweep: str, trial_id: str) -> str:
    return f"{sweep}-{trial_id}"  # as elastic.sweep.trial names it


def driver_resources(cpus: float):
    """A small CPU fraction per trial driver, on on-demand nodes when the cluster labels them (a driver on a
    reclaimed spot node would take its trial down with it)."""
    import ray
    from ray import tune

    on_demand = [
        n
        for n in ray.nodes()
        if n.get("Alive")
        and (n.get("Labels") or {}).get(MARKET_LABEL) == "on-demand"
        and n.get("Resources", {}).get("CPU", 0) >= cpus
    ]
    selector = [{MARKET_LABEL: "on-demand"}] if on_demand else None
    return tune.PlacementGroupFactory([{"CPU": cpus}], bundle_label_selector=selector)


def light_resources(job: JobSpec, share: float):
    """A light trial's trainable holds what its one worker needs: the worker's CPUs and its GPU share, on a node
    of the job's market (elastic.sweep.trial.is_light)."""
    from ray import tune

    return tune.PlacementGroupFactory(
        [{"CPU": job.workers.cpus, "GPU": share}], bundle_label_selector=[worker_selector(job.workers.market)]
    )


def sweep_is_light(sweep: SweepSpec, job: JobSpec) -> bool:
    """Light trials unless the sweep asks otherwise, the job has several workers or is spot-first, or the
    space changes the workers (the trainable's resources are fixed before a trial's parameters are)."""
    return sweep.light_trials and is_light(job) and not any(key.startswith("workers.") for key in sweep.space)


def market_gpus(market: str) -> float:
    """GPUs on the worker nodes a job of this market may use (what its trials' workers can share)."""
    import ray

    selector = worker_selector("on-demand" if market == "spot-first" else market)
    if market == "spot-first":
        selector = {k: v for k, v in selector.items() if k != "market"}
    return sum(
        n.get("Resources", {}).get("GPU", 0)
        for n in ray.nodes()
        if n.get("Alive") and matches(n.get("Labels") or {}, selector)
    )


def run_sweep(sweep: SweepSpec, job: JobSpec, resume: bool = False, say: Callable[[str], None] = print) -> dict:
    """Run (or restore and finish) the sweep on the connected cluster; returns the report `--json` prints."""
    from ray import tune

    started = time.monotonic()
    experiment = experiment_uri(sweep, job)
    filesystem, experiment_path = pyarrow_filesystem(experiment)
    restorable = tune.Tuner.can_restore(experiment_path, storage_filesystem=filesystem)
    if resume and not restorable:
        raise UserError(f"--resume: no sweep {sweep.name} to restore at {experiment}; run it without --resume")
    saved = prepare_plan(sweep, job, say)
    parent = sweep_parent_run(job.tracking, sweep.name)
    if parent is not None:  # one MLflow run per trial, nested under the sweep's run
        tracking = job.tracking.model_copy(
            update={"parent_run_id": parent, "experiment": job.tracking.experiment or sweep.name}
        )
        job = job.model_copy(update={"tracking": tracking})
        say(f"tracking: trials log to MLflow under the sweep's run {parent}")
    setup = {
        "sweep": sweep.name,
        "job": job.model_dump(mode="json"),
        "train_root": train_root(sweep, job),
        "plan": saved["plan"],
        "max_oom_retries": sweep.packing.max_oom_retries,
    }
    light = sweep_is_light(sweep, job)
    setup["light"] = light
    resources = light_resources(job, saved["plan"]["share"]) if light else driver_resources(sweep.driver_cpus)
    trainable = tune.with_resources(tune.with_parameters(trial_main, setup=setup), resources)
    concurrent = sweep.max_concurrent or packing.concurrency_cap(
        saved["plan"]["trials_per_gpu"], market_gpus(job.workers.market), job.workers.max_workers
    )
    if restorable:
        say(f"restoring sweep {sweep.name} from {experiment}")
        tuner = restore_tuner(experiment_path, filesystem, trainable, param_space(sweep))
    else:
        root_fs, root_path = pyarrow_filesystem(sweep.storage or job.checkpoint.uri)
        trial_scheduler = scheduler(sweep)
        tuner = tune.Tuner(
            trainable,
            param_space=param_space(sweep),
            tune_config=tune.TuneConfig(
                metric=sweep.metric,
                mode=sweep.mode,
                num_samples=sweep.num_samples,
                scheduler=trial_scheduler,
                max_concurrent_trials=concurrent,
                reuse_actors=False,
            ),
            run_config=tune.RunConfig(
                name=sweep.name,
                storage_path=root_path,
                storage_filesystem=root_fs,
                # A light trial dies with its node when it is reclaimed: Tune's restart is its preemption budget too.
                failure_config=tune.FailureConfig(
                    max_failures=sweep.max_failures + (job.failure.max_preemptions if light else 0)
                ),
                # A trial's Tune checkpoints are pointers to its committed ones (elastic.sweep.tune_reports),
                # a few hundred bytes each: all are kept, since PBT may clone one a few reports old.
                callbacks=[Progress(), SchedulerState(trial_scheduler)],
                verbose=0,
            ),
        )
    ledger = start_sweep_ledger(
        experiment, sweep.name, market_gpus(job.workers.market), saved["plan"]["share"], sweep.num_samples
    )
    summary = None
    try:
        results = tuner.fit()
        summary = report(sweep, job, results, saved, time.monotonic() - started)
        return summary
    finally:
        end_sweep_ledger(ledger, sweep.name, summary)
        if parent is not None:
            MlflowRuns(job.tracking.mlflow).finish(parent)


def report(sweep: SweepSpec, job: JobSpec, results, saved: dict, seconds: float) -> dict:
    """Trials (params, metric, state, GPU share, restarts), the best config, and the plan."""
    trials = []
    for result in results:
        metrics = result.metrics or {}
        found = re.search(r"_([0-9a-f]{5}_\d{5})(?:_|$)", os.path.basename(str(result.path)))
        trial_id = metrics.get("trial_id") or (found.group(1) if found else None)
        record = (
            read_json(parse_uri(train_root(sweep, job)).child(f"{sweep.name}-{trial_id}", TRIAL_FILE).uri)
            if trial_id
            else None
        )
        attempts = (record or {}).get("attempts", [])
        if result.error is not None:
            state = "ERROR"
        elif record and record.get("finished"):
            state = "TERMINATED"
        else:
            state = "STOPPED"  # ended by the scheduler before the job finished
        trials.append(
            {
                "trial_id": trial_id,
                "params": result.config,
                "metric": metrics.get(sweep.metric),
                "state": state,
                "iterations": metrics.get("training_iteration"),
                "step": metrics.get("step"),
                "gpu_share": attempts[-1]["share"] if attempts else saved["plan"]["share"],
                "restarts": max(0, len(attempts) - 1),
                "ooms": len((record or {}).get("ooms", [])),
                "resumed_from": [a["resumed_from"] for a in attempts],
                "exploits": (record or {}).get("exploits", []),
                "error": str(result.error).splitlines()[0][:200] if result.error else None,
                "final_metrics": {
                    k: v
                    for k, v in metrics.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in _TUNE_KEYS
                },
            }
        )
    trials.sort(key=lambda t: t["trial_id"] or "")
    best = None
    try:
        best = results.get_best_result(metric=sweep.metric, mode=sweep.mode)
    except RuntimeError:  # no trial reported the metric
        pass
    return {
        "sweep": sweep.name,
        "experiment": experiment_uri(sweep, job),
        "metric": sweep.metric,
        "mode": sweep.mode,
        "plan": saved["plan"],
        "probe": saved.get("probe"),
        "rank_placement": saved.get("strategy"),
        "trials": trials,
        "best_config": best.config if best else None,
        "best_metric": (best.metrics or {}).get(sweep.metric) if best else None,
        "errors": sum(t["state"] == "ERROR" for t in trials),
        "seconds": round(seconds, 1),
    }


# ---------------------------------------------------------------------------------------------------------
# Driver connection


def disconnect() -> None:
    import ray

    ray.shutdown()


def connect(job: JobSpec | None = None, excludes: list[str] | tuple[str, ...] = ()) -> None:
    """Attach this process to the cluster as the sweep's driver; the working dir travels to every trial
    (`excludes` and the job's excludes left out)."""
    address = os.environ.get("RAY_ADDRESS")
    state = local.running_state()
    if not address and state is not None:
        os.environ.update(state.env())
        address = state.ray_address
    if state is not None and address == state.ray_address:
        state.use_ray()  # the stack's auth mode and token, whatever this shell exported
    # Imported only now: Ray reads RAY_AUTH_MODE once, when it is imported.
    import ray
    import torch  # noqa: F401  (before ray.init: see elastic.driver.job)

    if state is not None and state.logical_gpus:
        os.environ["ELASTIC_LOGICAL_GPUS"] = "1"
    try:
        ray.init(
            address=address or "auto",
            log_to_driver=False,
            runtime_env={
                "working_dir": os.getcwd(),
                "excludes": DEFAULT_EXCLUDES + (list(job.runtime_env.excludes) if job else []) + list(excludes),
                "env_vars": dict(job.runtime_env.env_vars) if job else {},
            },
        )
    except ConnectionError as err:
        refused = auth_failure(err, f"the Ray cluster at {address or 'auto'}")
        if refused is not None:
            raise refused from None
        raise ClusterError(
            "no Ray cluster to run the sweep on; start one with `elastic local up --gpus-per-node 2` or set RAY_ADDRESS"
        ) from None
