"""Fitting a run: one Ray Train fit() per placement until one finishes the run (spot-first, swap to spot and
grow at a checkpoint, start the next placement ahead of a reclaim); a sweep trial's single fit; a run on a GPU
share with its out-of-memory retry. The job driver around it (summary, ledger, `auto` share) is
elastic.driver.job."""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from elastic.checkpoint.store import run_directory
from elastic.config.spec import JobSpec
from elastic.driver.placements import PlacementExecutor
from elastic.driver.ray_config import build_trainer
from elastic.errors import TrialOutOfMemory
from elastic.ledger import LedgerWriter, NoLedger
from elastic.ledger.events import PlacementEnded, PlacementStarted
from elastic.placement import packing
from elastic.storage import fsspec_filesystem
from elastic.worker import in_process
from elastic.worker.sharing import OOM_FILE, TrialSharing, read_marker, trial_worker_main

logger = logging.getLogger(__name__)

MAX_OOM_RETRIES = 2  # a shared run's retries after running out of GPU memory: 1/4 -> 1/2 -> 1


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


def fit_in_process(
    spec: JobSpec,
    run_name: str,
    sharing: TrialSharing,
    forward,
    ledger: LedgerWriter | NoLedger,
) -> None:
    """A light trial's run: its one worker trains in this process (the Tune trainable's, which holds the
    worker's CPUs and GPU share), through the same worker entry as a worker group's, every report handed to
    `forward(metrics, checkpoint path)` for Tune (elastic.worker.in_process). One placement in the run ledger."""
    ledger.record(
        PlacementStarted(
            time.time(),
            placement="",
            market=spec.workers.market,
            workers=1,
            cpus_per_worker=spec.workers.cpus,
            gpus_per_worker=sharing.share,
            reason="light trial: in the trial's own process",
        )
    )
    ended_by = "failed"
    payload = {
        "spec": spec.model_dump(mode="json"),
        "run_name": run_name,
        "placement": None,
        "sharing": sharing.worker_payload(),
    }
    # A process group of one, as a worker group of one has: the session's DDP wrapper and its collectives run
    # unchanged (an in-memory store: no port to open).
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        with in_process.running_in_process(run_directory(spec, run_name), run_name, forward):
            trial_worker_main(payload)
        ended_by = "finished"
    finally:
        dist.destroy_process_group()
        ledger.record(PlacementEnded(time.time(), placement="", ended_by=ended_by))
        ledger.flush()
