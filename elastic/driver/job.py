"""The driver of a submitted job (`elastic run`, what `elastic submit` starts on the cluster): connect, size an
`auto` GPU share with a probe, fit the run to its end (elastic.driver.fitting), and write its summary and ledger.
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
from elastic.driver.fitting import fit_run, fit_shared_run
from elastic.driver.probe import auto_share
from elastic.driver.run_ledger import end_run_ledger, start_run_ledger
from elastic.driver.runs import RunSummary, checkpoint_uri, write_summary
from elastic.errors import ClusterError, JobFailed

logger = logging.getLogger(__name__)


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
