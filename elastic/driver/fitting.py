"""The driver of a run: one Ray Train fit() per placement until one finishes the run (spot-first, swap to spot
and grow at a checkpoint, start the next placement ahead of a reclaim), and the run's summary.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict

import ray

# torch loaded before ray.init(): job drivers that first imported torch after connecting (with pyarrow's S3
# client loaded) were seen dying with "Intel oneMKL FATAL ERROR: Cannot load libtorch_cpu.so".
import torch  # noqa: F401  (imported for its side effect on library load order)

from elastic import logs
from elastic.checkpoint.store import run_directory
from elastic.config.spec import JobSpec
from elastic.driver.placements import PlacementExecutor
from elastic.driver.probe import auto_share
from elastic.driver.ray_config import build_trainer
from elastic.driver.run_ledger import end_run_ledger, start_run_ledger
from elastic.driver.runs import RunSummary, checkpoint_uri, write_summary
from elastic.errors import ClusterError, JobFailed, TrialOutOfMemory
from elastic.ledger import LedgerWriter, NoLedger
from elastic.ledger.events import PlacementEnded, PlacementStarted
from elastic.placement import packing
from elastic.storage import fsspec_filesystem
from elastic.worker.sharing import OOM_FILE, TrialSharing, read_marker

logger = logging.getLogger(__name__)

MAX_OOM_RETRIES = 2  # a shared run's retries after running out of GPU memory: 1/4 -> 1/2 -> 1


def run_job(spec: JobSpec, run_name: str) -> RunSummary:
    """Run the job to completion on the connected Ray cluster and write its summary next to its checkpoints."""
    logs.configure()
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
    logger.info(
        "run %s: %s workers on %s nodes, checkpoints in %s",
        run_name,
        f"{workers.min}" + (f"..{workers.max_workers}" if workers.elastic else ""),
        workers.market,
        run_uri,
    )
    started = time.monotonic()
    started_at = time.time()
    ledger = start_run_ledger(run_uri, run_name, spec)
    error: str | None = None
    metrics: dict = {}
    checkpoint: str | None = None
    placements: list[dict] = []
    try:
        if workers.gpus == "auto":  # probed on a whole GPU first, then a run on the share it measured
            share, reason = auto_share(spec, run_name, logger.info)
            logger.info("run %s: workers.gpus auto -> GPU share %s (%s)", run_name, share, reason)
            spec = spec.model_copy(update={"workers": workers.model_copy(update={"gpus": share})})
            workers = spec.workers
        if 0 < workers.gpus < 1:
            result = fit_shared_run(spec, run_name, run_uri, placements, ledger)
        else:
            result = fit_run(spec, run_name, run_uri, placements, ledger=ledger)
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
    end_run_ledger(ledger, run_uri, started_at, summary.status, error)
    logger.info("summary %s", json.dumps(asdict(summary), default=str))
    if error:
        raise JobFailed(run_name, "FAILED", error)
    return summary


def fit_run(
    spec: JobSpec,
    run_name: str,
    run_uri: str,
    placements: list[dict],
    sharing: TrialSharing | None = None,
    ledger: LedgerWriter | NoLedger | None = None,
):
    """Run to the end: the driver's sequence of placements (driver.placements), each in the run ledger. A sweep
    trial (`sharing`) is one fit() unless spot-first: Tune already schedules trials by capacity, and a trial's
    just-in-time checkpoint then waits for Ray Train's restart."""
    ledger = ledger if ledger is not None else NoLedger()
    if sharing is not None and spec.workers.market != "spot-first":
        workers = spec.workers
        ledger.record(
            PlacementStarted(
                time.time(),
                placement="",
                market=workers.market,
                workers=workers.max_workers,
                cpus_per_worker=workers.cpus,
                gpus_per_worker=sharing.share,
                reason="sweep trial",
            )
        )
        ended_by = "failed"
        try:
            result = build_trainer(spec, run_name, sharing=sharing).fit()
            ended_by = "finished"
            return result
        finally:
            ledger.record(PlacementEnded(time.time(), placement="", ended_by=ended_by))
            ledger.flush()
    return PlacementExecutor(spec, run_name, run_uri, placements, sharing, ledger=ledger).run()


def fit_shared_run(spec: JobSpec, run_name: str, run_uri: str, placements: list[dict], ledger: LedgerWriter | NoLedger):
    """A run whose workers ask for a fraction of a GPU (0 < workers.gpus < 1), as a sweep's trials do: each worker
    caps its memory at its share, so it runs out of memory itself instead of pushing a neighbour out; after an
    out-of-memory error the run goes on from its last checkpoint at a doubled share (up to a whole GPU)."""
    share = spec.workers.gpus
    fs, root = fsspec_filesystem(run_uri)
    for retry in range(MAX_OOM_RETRIES + 1):
        sharing = TrialSharing(
            share=share,
            memory_fraction=packing.memory_cap(share),
            strategy=packing.rank_placement(spec.workers.max_workers, share),
        )
        job = spec.model_copy(update={"workers": spec.workers.model_copy(update={"gpus": share})})
        failure: Exception | None = None
        try:
            result = PlacementExecutor(job, run_name, run_uri, placements, sharing, ledger=ledger).run()
        except Exception as err:  # the run's failure; an OOM marker says whether a bigger share may fix it
            failure = err
        oom = read_marker(fs, f"{root}/{OOM_FILE}", clear=True)
        if oom is None:
            if failure is not None:
                raise failure
            return result
        if share >= 1 or retry == MAX_OOM_RETRIES:
            break
        share = packing.bigger_share(share)
        logger.warning("run %s: out of memory at step %s; going on at GPU share %s", run_name, oom.get("step"), share)
    raise TrialOutOfMemory(f"run {run_name} ran out of GPU memory at share {share}: {oom.get('error')}")
