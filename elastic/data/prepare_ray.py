"""`elastic data prepare SRC DEST --address ADDR`: the conversion as Ray tasks on a cluster, for datasets no
single machine should convert.

The client plans (elastic.data.prepare.plan_source: lists the source files with fsspec, reads the first one's
schema), marks DEST as being written, and starts one task per group of source files (a big file is a group by
itself; small ones go together up to --shard-mb): each task is `elastic.data.prepare.convert_files`, the very
function the local path runs in its threads, streaming its files into `part-<first source index>-<n>.parquet`
straight to DEST. The client collects what each task wrote (paths, row-group rows, bytes) and commits the
dataset through `elastic.data.prepare.commit`, as the local path does: shards of an earlier run that this one
did not write are removed and the manifest is written last. Names depend on the source files and --shard-mb
only, so a re-run (or a task Ray retries) overwrites instead of adding.

The tasks get the storage endpoint and credentials the client has: its AWS_*/FSSPEC_* variables go in the
tasks' runtime_env env_vars (never printed; variables that name a file on this machine stay here). The client's
copy of the `elastic` package travels with them (runtime_env py_modules), so the nodes convert with the same code
that planned.

Not distributed: a global shuffle (--shuffle-seed) needs every row in one place, a .npy/.npz is one file read
whole, and a generator runs in the client's process; each is refused here with one line (`check_distributable`).
Connecting (ray.init, token auth, one line for an unreachable address) is the CLI's (elastic.cli.data): this
module runs on the connection the process already has.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from elastic.data.manifest import DatasetError, Manifest
from elastic.data.prepare import (
    SourcePlan,
    Written,
    begin,
    commit,
    convert_files,
    is_generator,
    is_numpy,
    plan_source,
)
from elastic.errors import UserError

_log = logging.getLogger(__name__)

STORAGE_PREFIXES = ("AWS_", "FSSPEC_")
# Paths on the client (a profile, a credentials or CA file): meaningless on a node, and a profile a node lacks
# makes botocore fail where the node's own credential chain would have worked.
CLIENT_ONLY = {
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CA_BUNDLE",
}
# Ray runs a task again when its worker or node dies; the shards it rewrites have the same names.
TASK_RETRIES = 3
PROGRESS_EVERY_S = 10.0


def check_distributable(source: str, shuffle_seed: int | None) -> None:
    """One line for what cannot run as tasks on a cluster, before anything connects."""
    if shuffle_seed is not None:
        raise DatasetError(
            "--shuffle-seed cannot be combined with --address: a global shuffle needs every row in one place, not "
            "a file per task; drop --shuffle-seed (StreamingDataset's block shuffle mixes row groups across the "
            "dataset every epoch), or prepare without --address on a machine that holds the dataset"
        )
    if is_generator(source):
        raise DatasetError(
            f"{source}: a generator runs in this process, not on a cluster; prepare it without --address"
        )
    if is_numpy(source):
        raise DatasetError(f"{source}: a .npy/.npz is one file read whole; prepare it without --address")


def storage_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The client's storage endpoint and credentials for the tasks' runtime_env (its AWS_* and FSSPEC_*
    variables, less those that name a file on this machine)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(STORAGE_PREFIXES) and k not in CLIENT_ONLY}


def job_runtime_env(environ: dict[str, str] | None = None) -> dict:
    """For ray.init when the CLI connects: the storage variables, and this `elastic` package as py_modules (Ray
    uploads a local package only at the job level), so the nodes convert with the code that planned."""
    import elastic

    return {
        "env_vars": storage_env(environ),
        "py_modules": [str(Path(elastic.__file__).parent)],
        "excludes": ["__pycache__/", "*.pyc"],
    }


def prepare_on_ray(
    source: str,
    dest: str,
    shard_mb: float = 128.0,
    row_group_mb: float = 4.0,
    shuffle_seed: int | None = None,
) -> Manifest:
    """Convert `source` to `dest` as Ray tasks on the cluster this process is connected to (ray.init first)."""
    import ray

    check_distributable(source, shuffle_seed)
    if not ray.is_initialized():
        raise RuntimeError("prepare_on_ray needs a Ray connection: call ray.init(address=...) first")
    plan = plan_source(source)
    groups = plan.groups(shard_mb)
    begin(dest)
    _log.info(f"{dest}: {len(plan.files)} source file(s) as {len(groups)} Ray task(s)")
    task = ray.remote(convert_files).options(
        num_cpus=1,
        max_retries=TASK_RETRIES,
        # Also on a connection made without job_runtime_env (a notebook's, a test's); merged with the job's.
        runtime_env={"env_vars": storage_env()},
        name="elastic-data-prepare",
    )
    refs = {task.remote(*plan.convert_args(group, dest, shard_mb, row_group_mb)): group for group in groups}
    written = _collect(plan, refs)
    return commit(dest, written, source)


def _collect(plan: SourcePlan, refs: dict) -> list[Written]:
    """Every task's shards; on the first failure the others are cancelled and it is one line (the marker stays:
    readers refuse the half-written dataset until a run finishes)."""
    import ray
    from ray.exceptions import RayError

    written: dict[int, list[Written]] = {}  # by the group's first source index: the source's order
    pending = list(refs)
    started = reported = time.monotonic()
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        if pending:  # and all the others done by now: a wait is a pass over thousands of refs, not one per task
            more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            ready += more
        for ref in ready:
            try:
                written[refs[ref][0]] = ray.get(ref)
            except RayError as err:
                for other in pending:
                    ray.cancel(other)
                raise _one_line(err, plan, refs[ref]) from None
        if not pending or time.monotonic() - reported >= PROGRESS_EVERY_S:
            reported = time.monotonic()
            _log.info(f"{len(refs) - len(pending)}/{len(refs)} task(s) done in {reported - started:.1f}s")
    return [shard for first in sorted(written) for shard in written[first]]


def _one_line(err: Exception, plan: SourcePlan, group: list[int]) -> Exception:
    """What a failed task means for the user, in one line: its own error (a file it cannot read), the storage
    error it met (no endpoint, no credentials: the nodes' side of DEST), or a task Ray could not finish (a
    worker or node lost, out of memory) with the fix. The task's traceback goes to the debug log (-v)."""
    from ray.exceptions import RayTaskError

    files = f"{plan.files[group[0]]}" + (f" (and {len(group) - 1} more)" if len(group) > 1 else "")
    _log.debug(f"the task converting {files} failed", exc_info=err)
    if isinstance(err, RayTaskError):
        cause = err.cause
        if isinstance(cause, UserError):
            return cause
        return DatasetError(
            f"{plan.source}: the task converting {files} failed on the cluster ({type(cause).__name__}: "
            f"{_first_line(cause)}); check that every node reaches the source and DEST with the storage variables "
            "of this shell (AWS_*, FSSPEC_*) or its own credentials (run with -v for the task's traceback)"
        )
    return DatasetError(
        f"{plan.source}: the task converting {files} did not finish ({type(err).__name__}: {_first_line(err)}); "
        "run it again (with a smaller --shard-mb if a node ran out of memory)"
    )


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__
