"""`elastic pack`: several different jobs trained at once as one Tune experiment on shared GPUs.

Each job is one trial of the experiment (the same trial driver as a sweep's, elastic.sweep.trial): it asks for
its own GPU share per worker, caps its memory to it, is retried alone at a doubled share after an out-of-memory
error, and resumes from its own checkpoints after a preemption, a driver loss or a run of the same pack again
(Tuner.restore). Its run is `<pack>-<job name>`, in the job's own checkpoint.uri, so every verb that takes a run
works on it (`status`, `report`, `checkpoints ls`). The experiment and its plan live in
`<first job's checkpoint.uri>/<pack>/`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from elastic.config.spec import JobSpec, load_job_spec
from elastic.driver.probe import PROBE_STEPS, measured_probe, probe_run
from elastic.errors import SpecError, UserError
from elastic.ledger import read_ledger
from elastic.ledger.events import PreemptionNotice, Restored, Steps, WorkersStarted
from elastic.placement import packing
from elastic.storage import parse_uri, pyarrow_filesystem
from elastic.sweep.layout import TRIAL_FILE, read_json, write_json
from elastic.worker.sharing import GPUS_FILE

log = logging.getLogger(__name__)

PACK_FILE = "elastic-pack.json"
DRIVER_CPUS = 0.05  # each job's trial driver and Train controller, on an on-demand node when there is one
MAX_FAILURES = 2  # Tune restarts of a job whose driver failed (it resumes from its checkpoint)
MAX_OOM_RETRIES = 2  # 1/4 -> 1/2 -> 1


@dataclass(frozen=True)
class PackedJob:
    name: str  # the job's name: its key in the pack and the end of its run name
    source: str  # the YAML it came from
    job: JobSpec


def load_packed_jobs(files: list[Path], overrides: tuple[str, ...]) -> list[PackedJob]:
    """Read every job; `FIELD=VALUE` overrides apply to every job, `JOB:FIELD=VALUE` to the job named JOB.
    Raises SpecError (one line) for a bad file, an override of a job not packed, or two jobs of one name."""
    if not files:
        raise UserError("pack needs at least one job file, e.g. `elastic pack jobs/digits_ddp.yaml jobs/charlm.yaml`")
    names = [load_job_spec(path).name for path in files]
    seen: dict[str, Path] = {}
    for name, path in zip(names, files):
        if name in seen:
            raise SpecError(f"{path}: a job named {name} is already packed ({seen[name]}); pack each job once")
        seen[name] = path
    common, targeted = split_overrides(overrides, names)
    return [
        PackedJob(name, str(path), load_job_spec(path, common + targeted.get(name, ())))
        for name, path in zip(names, files)
    ]


def split_overrides(overrides: tuple[str, ...], names: list[str]) -> tuple[tuple[str, ...], dict[str, tuple]]:
    """('config.epochs=2', 'charlm:config.lr=1e-3') -> (('config.epochs=2',), {'charlm': ('config.lr=1e-3',)}).
    The job name is what stands before a ':' in the field part (values may hold ':' themselves)."""
    common: list[str] = []
    targeted: dict[str, list[str]] = {}
    for item in overrides:
        field_part = item.split("=", 1)[0]
        if ":" not in field_part:
            common.append(item)
            continue
        name, _, rest = item.partition(":")
        if name not in names:
            raise SpecError(f"--set {item}: no packed job is named {name} (packed: {', '.join(names)})")
        targeted.setdefault(name, []).append(rest)
    return tuple(common), {k: tuple(v) for k, v in targeted.items()}


def default_name(jobs: list[PackedJob]) -> str:
    """The same jobs with the same settings pack under the same name, so running the pack again (after its
    driver was lost) restores it; a changed setting is another pack."""
    specs = sorted(j.job.model_dump_json() for j in jobs)
    digest = hashlib.sha256("\n".join(specs).encode()).hexdigest()[:6]
    return f"pack-{digest}"


def experiment_uri(name: str, jobs: list[PackedJob]) -> str:
    return parse_uri(jobs[0].job.checkpoint.uri).child(name).uri


def run_name(pack: str, job: PackedJob) -> str:
    return f"{pack}-{job.name}"


# ---------------------------------------------------------------------------------------------------------
# Plans: one per job


def prepare_plans(
    name: str, jobs: list[PackedJob], gpu_share: float | None, logical_gpus: bool, say: Callable[[str], None]
) -> dict:
    """{job name: {"plan", "probe"}}: read back when the pack is restored, else planned now. A fixed share is
    every job's; `auto` (gpu_share None) probes each job on a whole GPU and sizes its share from its peak."""
    uri = parse_uri(experiment_uri(name, jobs)).child(PACK_FILE).uri
    saved = read_json(uri)
    if saved is not None and set(saved) == {j.name for j in jobs}:
        say(f"plans from {uri}: " + ", ".join(f"{k} share {v['plan']['share']}" for k, v in saved.items()))
        return saved
    if gpu_share is None and logical_gpus:
        raise UserError(
            "--gpu-share auto measures each job's peak GPU memory, and logical GPUs (no CUDA) have none to "
            "measure; give a share, e.g. --gpu-share 0.25"
        )
    plans = {}
    for packed in jobs:
        probe = None
        if gpu_share is not None:
            plan = packing.fixed_plan(gpu_share)
        else:
            measured = probe_run(packed.job, f"{name}-{packed.name}-probe", PROBE_STEPS, say)
            probe = measured_probe(measured)
            if probe is None:
                raise UserError(f"{packed.source}: its probe measured no GPU memory; give --gpu-share a number")
            plan = packing.plan_packing(probe)
        plans[packed.name] = {"plan": plan.to_json(), "probe": probe.to_json() if probe else None}
        say(f"{packed.name}: share {plan.share}, memory cap {plan.memory_fraction:.2%} ({plan.reason})")
    write_json(uri, plans)
    return plans


# ---------------------------------------------------------------------------------------------------------
# Running


def run_pack(
    name: str, jobs: list[PackedJob], gpu_share: float | None, logical_gpus: bool, say: Callable[[str], None]
) -> dict:
    """Run (or restore and finish) the pack on the connected cluster; returns the report `--json` prints."""
    from ray import tune

    from elastic.sweep.progress import LiveTable, Progress
    from elastic.sweep.runner import driver_resources, light_resources, restore_tuner
    from elastic.sweep.trial import is_light, trial_main

    started = time.monotonic()
    experiment = experiment_uri(name, jobs)
    filesystem, experiment_path = pyarrow_filesystem(experiment)
    plans = prepare_plans(name, jobs, gpu_share, logical_gpus, say)
    light = {j.name: is_light(j.job) for j in jobs}
    setup = {
        "sweep": name,
        "packed": {
            j.name: {"job": j.job.model_dump(mode="json"), "plan": plans[j.name]["plan"], "light": light[j.name]}
            for j in jobs
        },
        "max_oom_retries": MAX_OOM_RETRIES,
    }
    resources = {
        j.name: light_resources(j.job, plans[j.name]["plan"]["share"])
        if light[j.name]
        else driver_resources(DRIVER_CPUS)
        for j in jobs
    }
    trainable = tune.with_resources(
        tune.with_parameters(trial_main, setup=setup), functools.partial(_resources_of, resources)
    )
    space = {"job": tune.grid_search([j.name for j in jobs])}
    if tune.Tuner.can_restore(experiment_path, storage_filesystem=filesystem):
        say(f"restoring pack {name} from {experiment}")
        tuner = restore_tuner(experiment_path, filesystem, trainable, space)
    else:
        root_fs, root_path = pyarrow_filesystem(jobs[0].job.checkpoint.uri)
        tuner = tune.Tuner(
            trainable,
            param_space=space,
            tune_config=tune.TuneConfig(max_concurrent_trials=len(jobs), reuse_actors=False),
            run_config=tune.RunConfig(
                name=name,
                storage_path=root_path,
                storage_filesystem=root_fs,
                # A light job dies with its node when it is reclaimed: Tune's restart is its preemption budget too.
                failure_config=tune.FailureConfig(
                    max_failures=MAX_FAILURES
                    + max((j.job.failure.max_preemptions for j in jobs if light[j.name]), default=0)
                ),
                callbacks=[Progress(label="pack"), LiveTable([j.name for j in jobs])],
                verbose=0,
            ),
        )
    results = tuner.fit()
    errors = {r.config.get("job"): str(r.error).splitlines()[0][:200] for r in results if r.error is not None}
    return report(name, jobs, plans, errors, time.monotonic() - started)


def _resources_of(resources: dict, config: dict):
    """Each job's trial resources: a light job's trainable holds its worker's CPUs and GPU share."""
    return resources[config["job"]]


# ---------------------------------------------------------------------------------------------------------
# The report


def report(name: str, jobs: list[PackedJob], plans: dict, errors: dict, seconds: float) -> dict:
    """Each job's share, GPUs, state, time and restarts, and how many trained at once."""
    from elastic.checkpoint.store import run_directory

    rows, windows = [], {}
    for packed in jobs:
        run = run_name(name, packed)
        run_uri = run_directory(packed.job, run)
        record = read_json(parse_uri(run_uri).child(TRIAL_FILE).uri) or {}
        events = read_ledger(run_uri)
        windows[packed.name] = [(e.time, e.ended) for e in events if isinstance(e, Steps)]
        attempts = record.get("attempts", [])
        if packed.name in errors:
            state = "ERROR"
        else:
            state = "TERMINATED" if record.get("finished") else "STOPPED"
        finished = record.get("finished")
        last_steps = [e for e in events if isinstance(e, Steps)]
        rows.append(
            {
                "job": packed.name,
                "source": packed.source,
                "run": run,
                "share": attempts[-1]["share"] if attempts else plans[packed.name]["plan"]["share"],
                "planned_share": plans[packed.name]["plan"]["share"],
                "gpus": gpu_names(read_json(parse_uri(run_uri).child(GPUS_FILE).uri)),
                "state": state,
                "seconds": round(finished - attempts[0]["started"], 1) if finished and attempts else None,
                # worker groups started after the first: Ray Train's restarts after a preemption or a failure,
                # and the driver's retries after an out-of-memory error
                "restarts": max(0, sum(isinstance(e, WorkersStarted) for e in events) - 1),
                "preemptions": len({e.deadline or e.time for e in events if isinstance(e, PreemptionNotice)}),
                "ooms": len(record.get("ooms", [])),
                "resumed_from": sorted({e.step for e in events if isinstance(e, Restored)}),
                "step": last_steps[-1].last_step if last_steps else None,
                "error": errors.get(packed.name),
            }
        )
    return {
        "pack": name,
        "jobs": rows,
        "peak_concurrent": peak_concurrent(windows),
        "errors": len(errors),
        "seconds": round(seconds, 1),
    }


def gpu_names(ranks: list | None) -> list[str]:
    """`node:gpu` per rank (node ids shortened), from the gpus.json rank 0 wrote at its last start."""
    return [f"{entry['node'][:8]}:{','.join(entry['gpus']) or '-'}" for entry in ranks or []]


def peak_concurrent(windows: dict[str, list[tuple[float, float]]]) -> int:
    """The most jobs training at the same moment, from each job's step windows (start, end) in its own ledger;
    a job counts once however many of its windows overlap (two attempts' windows may)."""
    return packing.max_overlap([span for spans in windows.values() for span in packing.merged(spans)])
