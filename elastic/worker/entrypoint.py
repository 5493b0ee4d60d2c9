"""The job's entrypoint on the worker: resolve `file.py:function` or `package.module:function` and call it with
a Session (the train function Ray Train runs on every worker). The client-side check without importing the
user's code is elastic.config.entrypoint's."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from elastic import logs
from elastic.config.spec import JobSpec
from elastic.errors import PlacementEnded, SpecError
from elastic.worker.session import Session


class WorkerSetup(Protocol):
    """An optional step of the worker entry around the job's function (a sweep trial's GPU sharing,
    elastic.worker.sharing)."""

    def before_session(self, spec: JobSpec) -> None:
        """Before the entrypoint is imported and the session built (environment variables, say)."""

    def run(self, session: Session, train: Callable[[Session], Any]) -> None:
        """Call `train(session)`, with whatever set-up and handling the step adds."""


def worker_main(payload: dict, setup: WorkerSetup | None = None) -> None:
    """Runs on every training worker, of a job and of a sweep trial alike: set up logging, build the session
    and call the job's function with it (through `setup`, if given)."""
    _configure_logging()
    # The first DistributedDataParallel(...) imports torch._dynamo (sympy included): a second or two of a
    # restart's critical path. Start it now; the session's setup (S3 client, collectives, the wait for a
    # predecessor placement) waits on the network meanwhile.
    threading.Thread(
        target=importlib.import_module, args=("torch._dynamo",), name="elastic-import", daemon=True
    ).start()
    spec = JobSpec.model_validate(payload["spec"])
    if setup is not None:
        setup.before_session(spec)
    if spec.api == "ray-train":
        from elastic.adapters.ray_train import install, run_ray_train_function

        install()  # before the user's module is imported: `from ray.train import report` gets the routed one
        train = run_ray_train_function
    elif spec.api == "transformers":
        from elastic.adapters.transformers import install as install_transformers
        from elastic.adapters.transformers import run_transformers_function

        install_transformers()
        train = run_transformers_function
    else:
        train = _call_with_session
    function = resolve_entrypoint(spec.entrypoint)
    session = Session(spec, payload["run_name"], placement=payload.get("placement"))
    try:
        if setup is None:
            train(session, function)
        else:
            setup.run(session, lambda s: train(s, function))
        session.drain_reports()  # a function that returned without finish() (or a sweep's probe) may leave some
    except PlacementEnded as ended:
        # The driver asked this placement to end (spot-first moving to spot) and it did, at a committed
        # checkpoint. Returning normally lets Ray Train finish the run cleanly: no failure budget is spent.
        session.attempt_ended(ended.step, ended.reason or "placement ended")
        return
    finally:
        session.close()


def _call_with_session(session: Session, function: Callable[[Session], Any]) -> None:
    function(session)


def _configure_logging() -> None:
    """elastic's lines as `[elastic] ...` on stdout; Ray Train's line per report ("Reporting training result
    ...", one per checkpoint and rank) only when asked for with ELASTIC_LOG_LEVEL=DEBUG."""
    logs.configure()
    if logging.getLogger("elastic").isEnabledFor(logging.DEBUG):
        return
    try:  # Ray Train's worker context logs under its file's path (logging.getLogger(__file__))
        from ray.train.v2._internal.execution import context as ray_train_context
    except ImportError:  # another Ray version: its report lines stay
        return
    logging.getLogger(ray_train_context.__file__).setLevel(logging.WARNING)


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
