"""Ray Jobs client: submit a job spec, follow its logs, list, stop.

The project directory travels as the job's runtime_env working_dir; the validated spec travels in the job's
environment, so the driver runs exactly what the client checked (overrides included).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from elastic.checkpoint.store import run_directory
from elastic.config.entrypoint import check_entrypoint
from elastic.config.spec import JobSpec
from elastic.driver.auth import auth_failure
from elastic.driver.memory_plan import check_memory
from elastic.errors import ClusterError, SpecError, UserError
from elastic.local import stack as local
from elastic.logs import LEVEL_VARIABLE, PREFIX
from elastic.placement import labels
from elastic.placement.control import PlacementControl
from elastic.placement.feasibility import check_feasible
from elastic.placement.policy import NodeView
from elastic.storage import check_storage, require_filesystem

logger = logging.getLogger(__name__)

SPEC_VARIABLE = "ELASTIC_JOB_SPEC"
RUN_METADATA_KEY = "elastic_run"
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
# Never upload these with the working dir (Ray also honours .gitignore).
DEFAULT_EXCLUDES = [".venv/", ".git/", "**/__pycache__/", ".pytest_cache/", ".elastic/", "*.egg-info/"]


@dataclass(frozen=True)
class Target:
    """The Ray job API to talk to; `local` is the local stack's state when that is the target."""

    address: str
    local: local.LocalState | None


@dataclass(frozen=True)
class Submitted:
    job_id: str
    run_name: str
    address: str


def resolve_target(address: str | None) -> Target:
    """--address, else RAY_API_SERVER_ADDRESS, else the local stack if it is up."""
    if address:
        state = local.running_state()
        is_local = state is not None and state.dashboard_url == address.rstrip("/")
        return Target(address, state if is_local else None)
    if os.environ.get("RAY_API_SERVER_ADDRESS"):
        state = local.running_state()
        is_local = state is not None and state.dashboard_url == os.environ["RAY_API_SERVER_ADDRESS"]
        return Target(os.environ["RAY_API_SERVER_ADDRESS"], state if is_local else None)
    state = local.running_state()
    if state is not None:
        return Target(state.dashboard_url, state)
    raise ClusterError(
        "no cluster to talk to; run `elastic local up`, or pass --address http://HEAD:8265 "
        "(for a cloud cluster, tunnel it with `ray dashboard CLUSTER.yaml`)"
    )


def client(target: Target):
    """A JobSubmissionClient for the target; one line and exit 2 if it cannot be reached."""
    if target.local is not None:
        # Our local stack decides its auth mode and token; CLI and cluster must agree.
        target.local.use_ray()
    from ray.job_submission import JobSubmissionClient  # ray only when a cluster is asked: the CLI starts fast

    try:
        return JobSubmissionClient(target.address)
    except Exception as err:  # ConnectionError, auth errors, bad URLs: all mean "cannot use this address"
        refused = auth_failure(err, f"the Ray job API at {target.address}")
        if refused is not None:
            raise refused from None
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ClusterError(
            f"cannot reach the Ray job API at {target.address} ({first[:160]}); "
            "check --address, the tunnel, and RAY_AUTH_MODE/token"
        ) from None


def submit(
    spec: JobSpec,
    target: Target,
    suffix: str | None = None,
    working_dir: Path | None = None,
    check_bucket: bool = True,
    spec_source: str | None = None,
) -> Submitted:
    """`spec_source`: the job file, named in the error line of a bad entrypoint."""
    working_dir = (working_dir or Path.cwd()).resolve()
    check_spec(spec, working_dir, spec_source)
    run_name = spec.run_name(suffix)
    if check_bucket:
        _check_storage_from_client(spec, target)
    if spec.workers.gpus == "auto" and target.local is not None and target.local.logical_gpus:
        raise SpecError(
            f"{spec_source or spec.name}: workers.gpus: auto sizes the share from the GPU memory a probe measures, "
            "and the local stack's logical GPUs have none (no CUDA); give workers.gpus a fraction, e.g. 0.5"
        )
    jobs = client(target)
    nodes = live_nodes(target)
    if spec.workers.gpu_memory_gb is None:  # the GPU types the cluster's nodes report
        check_memory(spec, working_dir, nodes, spec_source)
    _check_fits(spec, target, nodes or [], spec_source)
    running = [j for j in _run_jobs(jobs, run_name) if j.status not in TERMINAL]
    if running:
        raise UserError(
            f"run {run_name} is already running as job {running[0].submission_id}; "
            f"stop it with `elastic stop {run_name}` or submit with --suffix"
        )
    runtime_env: dict = {
        "working_dir": str(working_dir),
        "excludes": DEFAULT_EXCLUDES + list(spec.runtime_env.excludes),
        "env_vars": {**log_environment(), **spec.runtime_env.env_vars, SPEC_VARIABLE: spec.model_dump_json()},
    }
    if spec.runtime_env.pip:
        runtime_env["pip"] = list(spec.runtime_env.pip)
    job_id = f"{run_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    jobs.submit_job(
        entrypoint=f"python -m elastic run --run-name {shlex.quote(run_name)}",
        submission_id=job_id,
        runtime_env=runtime_env,
        metadata={RUN_METADATA_KEY: run_name, "elastic_job": spec.name},
        entrypoint_label_selector=driver_placement(target, nodes),
    )
    return Submitted(job_id=job_id, run_name=run_name, address=target.address)


def check_spec(spec: JobSpec, working_dir: Path | None = None, spec_source: str | None = None) -> None:
    """What is checked before any cluster is asked anything: the entrypoint, and the model's memory plan when
    the spec says the GPU's memory (a refusal needs no cluster)."""
    working_dir = (working_dir or Path.cwd()).resolve()
    for line in check_entrypoint(spec, working_dir, spec_source):
        logger.warning("%s", line)
    if spec.workers.gpu_memory_gb is not None:
        check_memory(spec, working_dir, None, spec_source)


def live_nodes(target: Target) -> list[NodeView] | None:
    """The cluster's live nodes (labels and total resources) from Ray's state API; None if it cannot say (a
    minimal dashboard, an old Ray)."""
    try:
        from ray.util.state import list_nodes  # ray only when a cluster is asked: the CLI starts fast

        nodes = list_nodes(address=target.address, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)
    except Exception:  # the state API is unavailable: the callers fall back to Ray's defaults
        return None
    return [
        NodeView(node_id=n.node_id, labels=dict(n.labels or {}), available={}, total=dict(n.resources_total or {}))
        for n in nodes
    ]


def _check_fits(spec: JobSpec, target: Target, nodes: list[NodeView], spec_source: str | None) -> None:
    """Refuse workers the local stack can never hold (its nodes are all it has); on another cluster only warn, as
    its autoscaler may add nodes of a type not running now."""
    verdict = check_feasible(spec.workers, nodes)
    if verdict.problem is None:
        return
    line = f"{spec_source or spec.name}: {verdict.problem}"
    if target.local is not None:
        raise UserError(f"{line} (the local stack: `elastic local up --help` sizes its nodes)")
    logger.warning("%s (submitting anyway: the cluster may add nodes)", line)


def driver_placement(target: Target, nodes: list[NodeView] | None = None) -> dict[str, str] | None:
    """Where the job driver runs: never on spot. With no resources or selector, Ray Jobs already pins drivers to
    the head, unless the cluster sets RAY_JOB_ALLOW_DRIVER_ON_WORKER_NODES=1; an explicit selector for the
    labeled on-demand head holds either way. The driver's node also hosts the Ray Train controller (Ray attaches
    it to the driver's node) and a Tune controller (it runs in the driver). A cluster without the labels keeps
    Ray's default: a selector nothing matches would leave the job pending forever; so does a cluster whose nodes
    the state API cannot list. `nodes`: the live nodes, when the caller has just read them."""
    nodes = nodes if nodes is not None else live_nodes(target)
    selector = labels.driver_selector()
    if nodes is None:
        return None
    return selector if any(labels.matches(node.labels, selector) for node in nodes) else None


def follow(target: Target, job_id: str, out=sys.stdout) -> str:
    """Stream the job's logs until it ends; return its final status."""
    jobs = client(target)

    async def tail() -> None:
        async for lines in jobs.tail_job_logs(job_id):
            out.write(lines)
            out.flush()

    asyncio.run(tail())
    # The log stream can close a moment before the status turns terminal.
    deadline = time.monotonic() + 30
    status = str(jobs.get_job_status(job_id).value)
    while status not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.5)
        status = str(jobs.get_job_status(job_id).value)
    return status


def job_message(target: Target, job_id: str) -> str:
    """Ray's one-line message for the job (why it failed, or that it succeeded)."""
    return client(target).get_job_info(job_id).message or ""


def list_runs(target: Target) -> list[dict]:
    """Jobs submitted by elastic, newest first."""
    jobs = client(target)
    rows = []
    for job in jobs.list_jobs():
        metadata = job.metadata or {}
        if RUN_METADATA_KEY not in metadata:
            continue
        rows.append(
            {
                "run": metadata[RUN_METADATA_KEY],
                "job_id": job.submission_id,
                "status": str(job.status.value if hasattr(job.status, "value") else job.status),
                "start_time": job.start_time,
                "end_time": job.end_time,
                "message": job.message,
            }
        )
    return sorted(rows, key=lambda r: r["start_time"] or 0, reverse=True)


def driver_status(target: Target, job_id: str) -> dict | None:
    """What the run's driver says it is doing (running, or waiting for capacity and why), from the run folder;
    None if it cannot be read from here (a cloud bucket this machine has no access to)."""
    try:
        info = client(target).get_job_info(job_id)
        spec = JobSpec.model_validate(json.loads(info.runtime_env["env_vars"][SPEC_VARIABLE]))
        run = (info.metadata or {})[RUN_METADATA_KEY]
        if target.local is None:
            status = PlacementControl(run_directory(spec, run)).status()
        else:
            with target.local.environment():
                status = PlacementControl(run_directory(spec, run)).status()
        return status.to_dict() if status is not None else None
    except Exception:  # best effort: status still lists the job
        return None


def latest_job(target: Target, run_or_job: str) -> str:
    """Job id of the newest job of a run (or the job id itself)."""
    for row in list_runs(target):
        if run_or_job in (row["run"], row["job_id"]):
            return row["job_id"]
    raise UserError(f"no job found for run '{run_or_job}'; see `elastic status` for the runs on this cluster")


def logs(target: Target, run_or_job: str) -> str:
    return client(target).get_job_logs(latest_job(target, run_or_job))


def stop(target: Target, run_or_job: str) -> str:
    job_id = latest_job(target, run_or_job)
    client(target).stop_job(job_id)
    return job_id


def _run_jobs(jobs, run_name: str) -> list:
    return [j for j in jobs.list_jobs() if (j.metadata or {}).get(RUN_METADATA_KEY) == run_name]


def _check_storage_from_client(spec: JobSpec, target: Target) -> None:
    """Check the bucket from here when we hold what the cluster will use; cloud nodes use their own role."""
    # This machine reads the run's checkpoints and summary too (elastic status, checkpoints ls).
    require_filesystem(spec.checkpoint.uri)
    if target.local is not None:
        with target.local.environment():
            check_storage(spec.checkpoint.uri)
        return
    try:
        import boto3  # only for an S3 check from the client

        has_credentials = boto3.Session().get_credentials() is not None
    except Exception:  # no boto config at all: nothing to check with
        has_credentials = False
    if has_credentials:
        check_storage(spec.checkpoint.uri)


def spec_from_environment() -> JobSpec:
    """The driver's copy of the spec, as the client validated it."""
    raw = os.environ.get(SPEC_VARIABLE)
    if not raw:
        raise UserError(f"{SPEC_VARIABLE} is not set; pass a job file: elastic run JOB.yaml")
    return JobSpec.model_validate(json.loads(raw))


# Ray's driver folds log lines that differ only in tokens holding digits, from anywhere in the cluster within
# 5 s, into one "[repeated 2x across cluster]": of "[elastic] worker rank 0/2 on node 5d87..." and "... rank
# 1/2 on node 3f7e..." only one was printed (seen failing a test that reads each rank's placement). Our own
# lines are each rank's account of the run: Ray never folds them.
NEVER_FOLDED = {"RAY_DEDUP_LOGS_ALLOW_REGEX": re.escape(PREFIX)}


def log_environment() -> dict[str, str]:
    """How the job's driver and workers log: `elastic -v`/`-q`'s level, and every rank's `[elastic]` lines
    printed (what the spec's env_vars set wins)."""
    level = os.environ.get(LEVEL_VARIABLE)
    return {**NEVER_FOLDED, **({LEVEL_VARIABLE: level} if level else {})}
