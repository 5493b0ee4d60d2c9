"""Pure translations from a job spec to Ray Train V2's config, and the TorchTrainer of one fit().

Elastic worker counts (min < max), separate failure and preemption budgets, storage at the job's checkpoint
URI, and placement on nodes of the job's market by Ray node labels.
"""

from __future__ import annotations

import dataclasses
import os

from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from elastic.checkpoint.store import run_directory
from elastic.config.spec import FailureSpec, JobSpec, WorkersSpec
from elastic.driver.gpu_sharing import RUN_URI_VARIABLE, RUN_VARIABLE
from elastic.placement.control import Placement
from elastic.placement.labels import worker_selector
from elastic.placement.policy import worker_resources
from elastic.storage import pyarrow_filesystem
from elastic.worker.entrypoint import worker_main
from elastic.worker.sharing import TrialSharing, trial_worker_main

# Ray's own resize of a running elastic group restarts it from the last checkpoint, losing the steps since,
# and was seen flapping 2 -> 1 -> 2 with both nodes up (its capacity view ignores node labels and drains).
# The driver grows a placement itself, at a checkpoint (placement.GrowWatcher); Ray's running resize is off.
NO_RUNNING_RESIZE_SECONDS = 10**9
NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries it (ray.util.placement_group.NODE_ID_LABEL_KEY)


def scaling_config(
    workers: WorkersSpec, market: str | None = None, count: int | None = None, avoid_nodes: tuple[str, ...] = ()
):
    """`market` overrides workers.market (spot-first runs each placement on spot or on-demand); `count` caps
    an elastic run at the workers the driver found room for (Ray may still start fewer, down to min, after a
    failure inside the placement)."""
    high = min(count, workers.max_workers) if count is not None else workers.max_workers
    num_workers: int | tuple[int, int] = (workers.min, high) if high > workers.min else workers.min
    selector = worker_selector(market or workers.market)
    if avoid_nodes:
        # Nodes being reclaimed: Ray's scheduler still places new workers there (seen: a worker of the next
        # placement started on the draining node, died with it, and cost a restart).
        selector = {**selector, NODE_ID_LABEL: f"!in({','.join(sorted(avoid_nodes))})"}
    return ScalingConfig(
        num_workers=num_workers,
        use_gpu=workers.gpus_at_most > 0,
        resources_per_worker=worker_resources(workers),
        label_selector=selector,
        elastic_resize_monitor_interval_s=NO_RUNNING_RESIZE_SECONDS,
    )


def failure_config(failure: FailureSpec):
    return FailureConfig(max_failures=failure.max_failures, max_preemption_failures=failure.max_preemptions)


def torch_backend(workers: WorkersSpec, logical_gpus: bool) -> str:
    """NCCL on real GPUs; gloo on CPU and on the logical GPUs the local cluster declares on a CPU machine."""
    return "nccl" if workers.gpus_at_most > 0 and not logical_gpus else "gloo"


def build_trainer(
    spec: JobSpec, run_name: str, placement: Placement | None = None, sharing: TrialSharing | None = None
):
    """`placement` (from the driver loop) pins this fit() to a market and a size and tells the sessions how to
    end it; `sharing` makes it a sweep trial on a share of a GPU."""
    filesystem, storage_path = pyarrow_filesystem(spec.checkpoint.uri)
    logical_gpus = os.environ.get("ELASTIC_LOGICAL_GPUS") == "1"
    workers, function, callbacks = spec.workers, worker_main, []
    payload = {
        "spec": spec.model_dump(mode="json"),
        "run_name": run_name,
        "placement": placement.to_dict() if placement else None,
    }
    if sharing is not None:
        workers, function = workers.model_copy(update={"gpus": sharing.share}), trial_worker_main
        payload["sharing"] = sharing.worker_payload()
        if sharing.tune_callback is not None:  # a sweep trial's reports (and checkpoints) to Tune
            callbacks = [sharing.tune_callback]
    scaling = scaling_config(
        workers,
        placement.market if placement else None,
        placement.workers if placement else None,
        placement.avoid_nodes if placement else (),
    )
    worker_env = None
    if sharing is not None:
        scaling = dataclasses.replace(scaling, placement_strategy=sharing.strategy)
        # Named in the workers' runtime env, so `elastic status` can tell whose worker holds which GPU share.
        worker_env = {"env_vars": {RUN_VARIABLE: run_name, RUN_URI_VARIABLE: run_directory(spec, run_name)}}
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
            worker_runtime_env=worker_env,
            # Retention is ours (elastic.checkpoint): after a newer commit, marker first, folder kept as a
            # tombstone so Ray's run snapshot stays valid. Ray's own pruning ran too late to rely on at run end.
            checkpoint_config=CheckpointConfig(num_to_keep=None),
        ),
    )
