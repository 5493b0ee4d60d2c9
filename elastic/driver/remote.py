"""Verbs that drive work (`elastic sweep`, `verify-resume`, `bench ...`) run from a laptop as Ray jobs.

Given `--address http://HEAD:8265` (or an http:// RAY_ADDRESS), the verb does not run in the calling process:
its own command line is submitted as a Ray job, with the project directory as the job's working_dir and the
driver on the on-demand head (as `elastic submit` places job drivers). The client streams the job's output and
reads back the verb's result from one line the job prints (RESULT_PREFIX + JSON), so it shows the same table
or JSON as a local run. A job keeps running when the client goes away; running the same sweep again attaches
to the job still running instead of starting a second driver.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from elastic.driver.submit import (
    DEFAULT_EXCLUDES,
    RUN_METADATA_KEY,
    TERMINAL,
    Target,
    client,
    driver_placement,
    log_environment,
)

# Set in a remote verb's job: the verb prints its result as one RESULT_PREFIX line instead of a table or JSON.
RESULT_VARIABLE = "ELASTIC_EMIT_RESULT"
RESULT_PREFIX = "[elastic-result] "
COMMAND_METADATA_KEY = "elastic_command"


def remote_address(address: str | None) -> str | None:
    """The job API to run a verb through: --address, else RAY_ADDRESS when it names a job API (http[s]://).

    A RAY_ADDRESS like `auto` or HOST:6379 is a GCS address, which a driver joins directly: the verb then runs
    here as before. Inside a remote verb's job Ray sets RAY_ADDRESS to the GCS, so the job never recurses."""
    if address:
        return address
    env = os.environ.get("RAY_ADDRESS", "")
    return env if env.startswith(("http://", "https://")) else None


def is_remote_job() -> bool:
    """True inside the Ray job that runs a verb for a remote client."""
    return bool(os.environ.get(RESULT_VARIABLE))


def result_line(result: dict) -> str:
    return RESULT_PREFIX + json.dumps(result, default=str)


@dataclass(frozen=True)
class RemoteJob:
    job_id: str
    attached: bool  # True: a job of the same key was already running, and we follow it instead of a new one


def start(target: Target, argv: list[str], key: str, working_dir: Path, attach_running: bool = False) -> RemoteJob:
    """Submit `elastic ARGV` as a Ray job (or find the running job of `key` when attach_running)."""
    jobs = client(target)
    if attach_running:
        for job in jobs.list_jobs():
            if (job.metadata or {}).get(RUN_METADATA_KEY) == key and str(job.status.value) not in TERMINAL:
                return RemoteJob(job.submission_id, attached=True)
    job_id = f"{_slug(key)}-{time.strftime('%Y%m%d-%H%M%S')}"
    jobs.submit_job(
        entrypoint="python -m elastic " + shlex.join(argv),
        submission_id=job_id,
        runtime_env={
            "working_dir": str(working_dir),
            "excludes": DEFAULT_EXCLUDES,
            # The verb inside the job reaches the job API through the same address (run on the head, a tunnel's
            # http://127.0.0.1:8265 is the head's own dashboard too).
            # RAY_OVERRIDE_JOB_RUNTIME_ENV: a verb that starts its own Ray driver inside the job (a sweep's Tune
            # driver) passes ray.init a runtime_env of its own; Ray refuses the two unless told to combine them.
            "env_vars": {
                **log_environment(),
                RESULT_VARIABLE: "1",
                "RAY_API_SERVER_ADDRESS": target.address,
                "RAY_OVERRIDE_JOB_RUNTIME_ENV": "1",
            },
        },
        # RUN_METADATA_KEY lists it in `elastic status` and lets `elastic stop` find it by key or job id.
        metadata={RUN_METADATA_KEY: key, COMMAND_METADATA_KEY: argv[0]},
        entrypoint_label_selector=driver_placement(target),
    )
    return RemoteJob(job_id, attached=False)


def follow(target: Target, job_id: str, write: Callable[[str], None]) -> tuple[str, dict | None]:
    """Stream the job's output line by line to `write`, except the result line, which is parsed and returned
    with the job's final status."""
    jobs = client(target)
    found: list[dict] = []
    pending = [""]

    def take(text: str, flush: bool = False) -> None:
        lines = (pending[0] + text).split("\n")
        pending[0] = "" if flush else lines.pop()
        for line in lines:
            if line.startswith(RESULT_PREFIX):
                found.append(json.loads(line[len(RESULT_PREFIX) :]))
            elif line or not flush:
                write(line + "\n")

    async def tail() -> None:
        async for chunk in jobs.tail_job_logs(job_id):
            take(chunk)
        take("", flush=True)

    asyncio.run(tail())
    # The log stream can close a moment before the status turns terminal.
    deadline = time.monotonic() + 30
    status = str(jobs.get_job_status(job_id).value)
    while status not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.5)
        status = str(jobs.get_job_status(job_id).value)
    return status, (found[-1] if found else None)


def _slug(key: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", key.lower()).strip("-")[:80]
