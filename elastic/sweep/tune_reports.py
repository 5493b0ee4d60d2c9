"""A trial's committed checkpoints reach Tune as Tune checkpoints, so PBT can clone them.

Ray's TuneReportCallback forwards a Train run's metrics to Tune and nothing else: Tune never holds a
checkpoint of the trial, so PBT's exploit has nothing to copy. Here the Train controller's callback
(`CommitsToTune`) puts each report, with the path of the checkpoint it committed, on a queue of the trial;
the trial's own thread (`fit_reporting_to_tune`) takes them and calls `tune.report` with a *pointer*
checkpoint: a folder holding one small JSON (run, run folder, step), never the shards. The shards stay in
the run folder; an exploit copies them from there (elastic.sweep.exploit).
"""

from __future__ import annotations

import json
import logging
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from queue import Empty  # also what ray.util.queue raises (a subclass): a light trial's queue is a plain one
from typing import Any

from ray.train.v2.api.callback import UserCallback
from ray.util.queue import Queue

POINTER_FILE = "elastic-checkpoint.json"

log = logging.getLogger(__name__)


class CommitsToTune(UserCallback):
    """In the Train controller: every report of the trial's run, with its checkpoint's path, onto the queue."""

    def __init__(self, queue: Queue):
        self.queue = queue

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        item = {"metrics": dict(metrics[0]), "checkpoint_path": checkpoint.path if checkpoint else None}
        self.queue.put(item)  # returns once queued: the trial sees it before fit() returns


def open_queue() -> Queue:
    """The trial's report queue (an actor with no CPU, as Ray's own callback uses)."""
    return Queue(actor_options={"num_cpus": 0})


def pointer(run_name: str, run_uri: str, checkpoint_path: str) -> dict:
    """What a trial's Tune checkpoint holds: which committed checkpoint of which run."""
    folder = checkpoint_path.rstrip("/").rsplit("/", 1)[-1]
    step = int(folder.rsplit("-", 1)[-1])
    return {"run": run_name, "run_uri": run_uri, "step": step, "folder": folder}


def read_pointer(checkpoint) -> dict | None:
    """The pointer in a Tune checkpoint (tune.get_checkpoint()), or None for none or a foreign one."""
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as local:
        path = Path(local) / POINTER_FILE
        return json.loads(path.read_text()) if path.exists() else None


def fit_reporting_to_tune(fit: Callable[[], Any], queue: Queue, run_name: str, run_uri: str) -> None:
    """Run `fit` in a thread while this (Tune's training) thread reports what it queues: metrics, and a pointer
    checkpoint for every committed one. Raises what `fit` raised, after every queued report went to Tune."""
    from ray import tune

    failure: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            fit()
        except BaseException as err:  # handed to the reporting thread, which raises it
            failure.append(err)
        finally:
            done.set()

    thread = threading.Thread(target=run, name="elastic-trial-fit", daemon=True)
    thread.start()
    while True:
        try:
            item = queue.get(block=True, timeout=0.5)
        except Empty:
            if done.is_set() and queue.empty():
                break
            continue
        path = item.get("checkpoint_path")
        if path is None:
            tune.report(item["metrics"])
            continue
        with tempfile.TemporaryDirectory(prefix="elastic-tune-checkpoint-") as folder:
            (Path(folder) / POINTER_FILE).write_text(json.dumps(pointer(run_name, run_uri, path)))
            tune.report(item["metrics"], checkpoint=tune.Checkpoint.from_directory(folder))
    thread.join()
    if failure:
        raise failure[0]
