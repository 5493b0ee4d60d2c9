"""The job's entrypoint on the worker: resolve `file.py:function` or `package.module:function` and call it with
a Session (the train function Ray Train runs on every worker). The client-side check without importing the
user's code is elastic.config.entrypoint's."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic.config.spec import JobSpec
from elastic.errors import SpecError
from elastic.placement.control import PlacementEnded
from elastic.worker.session import Session


def worker_main(payload: dict) -> None:
    """Runs on every training worker: build the session and call the job's function with it."""
    # The first DistributedDataParallel(...) imports torch._dynamo (sympy included): a second or two of a
    # restart's critical path. Start it now; the session's setup (S3 client, collectives, the wait for a
    # predecessor placement) waits on the network meanwhile.
    threading.Thread(target=importlib.import_module, args=("torch._dynamo",), name="elastic-import",
                     daemon=True).start()
    spec = JobSpec.model_validate(payload["spec"])
    function = resolve_entrypoint(spec.entrypoint)
    try:
        function(Session(spec, payload["run_name"], placement=payload.get("placement")))
    except PlacementEnded:
        # The driver asked this placement to end (spot-first moving to spot) and it did, at a committed
        # checkpoint. Returning normally lets Ray Train finish the run cleanly: no failure budget is spent.
        return


def resolve_entrypoint(entrypoint: str) -> Callable[..., Any]:
    """`path/to/file.py:function` (relative to the working dir or sys.path) or `package.module:function`."""
    target, _, name = entrypoint.rpartition(":")
    if target.endswith(".py"):
        module = _load_file_module(target)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise SpecError(f"entrypoint: cannot import {target} ({err}); check the module path") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise SpecError(f"entrypoint: {target} has no function {name}; check the name after ':'")
    return function


def _load_file_module(relative: str):
    for base in [os.getcwd(), *sys.path]:
        candidate = Path(base or ".") / relative
        if candidate.is_file():
            module_name = "elastic_job_" + Path(relative).with_suffix("").as_posix().replace("/", "_").replace("-", "_")
            if module_name in sys.modules:
                return sys.modules[module_name]
            spec = importlib.util.spec_from_file_location(module_name, candidate)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module  # so pickled objects defined in the file can be found again
            spec.loader.exec_module(module)
            return module
    raise SpecError(f"entrypoint: {relative} not found in the working dir; submit from the project root")
