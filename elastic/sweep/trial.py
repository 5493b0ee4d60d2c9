"""A sweep trial's driver: the function trainable Tune runs for each trial. It fits the job with the trial's
parameters under `<sweep>-<trial id>`, retries it with a bigger GPU share after an out-of-memory error
(elastic.placement.packing.bigger_share), and resumes from the run's checkpoints whenever it starts again. Its
reports reach Tune with a pointer to each committed checkpoint (elastic.sweep.tune_reports); when PBT restarts
it with another trial's, it adopts that checkpoint first (elastic.sweep.exploit)."""

from __future__ import annotations

import functools
import logging
import time
from queue import Queue

from elastic.checkpoint.store import CheckpointStore, run_directory
from elastic.config.spec import JobSpec
from elastic.config.sweep_spec import trial_job
from elastic.driver.fitting import fit_in_process, fit_run
from elastic.driver.run_ledger import end_run_ledger, start_run_ledger
from elastic.errors import TrialOutOfMemory
from elastic.placement import packing
from elastic.storage import fsspec_filesystem, parse_uri
from elastic.sweep import exploit, tune_reports
from elastic.sweep.layout import TRIAL_FILE, read_json, write_json
from elastic.worker.sharing import OOM_FILE, TrialSharing, read_marker

log = logging.getLogger(__name__)


def trial_main(config: dict, setup: dict) -> None:
    """One trial: the job with this trial's parameters, fitted under `<sweep>-<trial id>`; retried with a bigger
    GPU share after an out-of-memory error; resumed from the run's checkpoints whenever it starts again. The
    trial's run ledger (elastic.ledger) records it like a run."""
    from ray import tune

    trial_id = tune.get_context().get_trial_id()
    job, run_name, plan, light = trial_target(config, setup, trial_id)
    run_uri = run_directory(job, run_name)
    started = time.time()
    ledger = start_run_ledger(run_uri, run_name, job, kind_of_run="trial")
    status, error = "FAILED", None
    try:
        _run_trial(config, setup, trial_id, job, plan, light, run_name, run_uri, ledger)
        status = "SUCCEEDED"
    except BaseException as err:  # recorded in the trial's ledger, then raised to Tune as before
        error = f"{type(err).__name__}: {err}"
        raise
    finally:
        end_run_ledger(ledger, run_uri, started, status, error)


def is_light(job: JobSpec) -> bool:
    """A light trial trains in its Tune trainable's own process (no Train controller or worker group): one
    worker, not spot-first (whose moves between markets need the driver's placements), and elastic's session
    API (a Ray Train function's or a Trainer's own ray.train calls are refused inside a Tune trainable)."""
    return job.workers.max_workers == 1 and job.workers.market != "spot-first" and job.api == "session"


def trial_target(config: dict, setup: dict, trial_id: str) -> tuple[JobSpec, str, dict, bool]:
    """What this trial fits: (job, run name, packing plan, light). A sweep's trial is the sweep's job with the
    trial's parameters, run as `<sweep>-<trial id>`; a pack's (elastic.sweep.pack) is one of the packed jobs,
    chosen by `config["job"]`, run as `<pack>-<job>` with that job's own plan. Light: the trainable holds the
    worker's resources and trains in its own process."""
    packed = setup.get("packed")
    if packed is not None:
        entry = packed[config["job"]]
        job = JobSpec.model_validate(entry["job"])
        return job, f"{setup['sweep']}-{config['job']}", entry["plan"], bool(entry.get("light"))
    return _trial_spec(config, setup), f"{setup['sweep']}-{trial_id}", setup["plan"], bool(setup.get("light"))


def _trial_spec(config: dict, setup: dict) -> JobSpec:
    """The sweep's job with this trial's parameters, its runs under the sweep's train root."""
    job = trial_job(JobSpec.model_validate(setup["job"]), config)
    return job.model_copy(update={"checkpoint": job.checkpoint.model_copy(update={"uri": setup["train_root"]})})


def _run_trial(
    config: dict,
    setup: dict,
    trial_id: str,
    job: JobSpec,
    plan: dict,
    light: bool,
    run_name: str,
    run_uri: str,
    ledger,
) -> None:
    record_uri = parse_uri(run_uri).child(TRIAL_FILE).uri
    record = read_json(record_uri) or {"run_name": run_name, "params": config, "attempts": [], "ooms": []}
    if record.get("finished"):
        # Finished before the sweep's driver died (after Tune last saved its state), or PBT chose to clone into
        # it at its very last report: nothing to redo, and no copy to make.
        _release_pin(run_name)
        return
    share = record["attempts"][-1]["share"] if record["attempts"] else plan["share"]
    store = CheckpointStore(run_uri)
    fs, _ = fsspec_filesystem(run_uri)
    adopted = _adopt_what_pbt_cloned(record, run_name, store, config)
    while True:
        latest = store.latest_committed()
        record["attempts"].append(
            {"share": share, "resumed_from": latest.step if latest else None, "started": time.time()}
        )
        write_json(record_uri, record)
        fraction = packing.memory_cap(plan["memory_fraction"] * share / plan["share"])
        # workers.gpus = the share: spot-first's capacity checks count GPU shares too
        shared_job = job.model_copy(update={"workers": job.workers.model_copy(update={"gpus": share})})
        strategy = packing.rank_placement(job.workers.max_workers, share)
        if light and share == plan["share"]:
            # Trains here, in the share this trainable holds; reports reach Tune through a plain queue.
            queue = Queue()
            sharing = TrialSharing(share=share, memory_fraction=fraction, strategy=strategy, adopted_step=adopted)
            fit = functools.partial(fit_in_process, shared_job, run_name, sharing, _to(queue), ledger)
        else:
            # A worker group of its own (several workers, or a light trial retried at a bigger share than the
            # one it holds); the Train controller's callback carries its reports through a queue actor.
            queue = tune_reports.open_queue()
            sharing = TrialSharing(
                share=share,
                memory_fraction=fraction,
                strategy=strategy,
                adopted_step=adopted,
                tune_callback=tune_reports.CommitsToTune(queue),
            )
            fit = functools.partial(fit_run, shared_job, run_name, run_uri, [], sharing, ledger=ledger)
        failure: BaseException | None = None
        try:
            tune_reports.fit_reporting_to_tune(fit, queue, run_name, run_uri)
        except Exception as err:  # the run's failure; an OOM marker decides whether it is retried
            failure = err
        record["attempts"][-1]["ended"] = time.time()
        oom = read_marker(fs, f"{store.root}/{OOM_FILE}", clear=True)
        if oom is None:
            if failure is not None:
                raise failure
            record["finished"] = time.time()
            write_json(record_uri, record)
            return
        record["ooms"].append(oom)
        if share >= 1 or len(record["ooms"]) > setup["max_oom_retries"]:
            write_json(record_uri, record)
            raise TrialOutOfMemory(
                f"trial {trial_id} ran out of memory at GPU share {share} "
                f"({len(record['ooms'])} time(s)): {oom.get('error')}"
            )
        share = packing.bigger_share(share)
        log.warning(
            "trial %s: out of memory at step %s; retrying with GPU share %s from its last checkpoint",
            trial_id,
            oom.get("step"),
            share,
        )


def _to(queue: Queue):
    """A light trial's reports, as the Train controller's callback would queue them (tune_reports)."""
    return lambda metrics, path: queue.put({"metrics": metrics, "checkpoint_path": path})


# ---------------------------------------------------------------------------------------------------------
# Tune


def _release_pin(run_name: str) -> None:
    """Unpin the checkpoint PBT restarted this trial with, if it is another trial's (elastic.sweep.pbt)."""
    from ray import tune

    found = tune_reports.read_pointer(tune.get_checkpoint())
    if found is not None and found["run"] != run_name:
        CheckpointStore(found["run_uri"]).unpin(run_name)


def _adopt_what_pbt_cloned(record: dict, run_name: str, store: CheckpointStore, params: dict) -> int | None:
    """When PBT restarted this trial with another trial's checkpoint (its exploit), adopt that checkpoint
    into this run (elastic.sweep.exploit) and record the lineage. Returns the adopted step, or None."""
    from ray import tune

    found = tune_reports.read_pointer(tune.get_checkpoint())
    if found is None or found["run"] == run_name:
        return None  # a first start, or a restart of this trial from its own checkpoint
    if exploit.already_adopted(record, found["run"], found["step"]):
        return record["exploits"][-1]["step"]
    donor = CheckpointStore(found["run_uri"])
    step = exploit.adopt(donor, found["step"], store)
    donor.unpin(run_name)  # pinned by the scheduler (elastic.sweep.pbt) until this copy
    donor_params = (read_json(parse_uri(donor.run_uri).child(TRIAL_FILE).uri) or {}).get("params") or {}
    entry = exploit.record_exploit(record, found["run"], found["step"], step, donor.uri(step), params, donor_params)
    write_json(parse_uri(store.run_uri).child(TRIAL_FILE).uri, record)
    log.info("exploit: %s adopted %s's checkpoint of step %d; mutated %s", run_name, found["run"], step,
             entry["mutated"])  # fmt: skip
    return step
