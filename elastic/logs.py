"""Logging for every elastic process: one logger per module under the `elastic` logger, one format.

Library code calls `logging.getLogger(__name__)` and never configures logging. The processes that elastic
starts configure it once: the CLI (`-v` / `-q`), a job's driver and each training worker. Lines keep the
`[elastic] ` prefix that users grep job logs for. ELASTIC_LOG_LEVEL (DEBUG, INFO, WARNING) carries the CLI's
level into the job's driver and workers.
"""

from __future__ import annotations

import logging
import os
import sys

LEVEL_VARIABLE = "ELASTIC_LOG_LEVEL"
PREFIX = "[elastic] "


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever sys.stdout (or sys.stderr) is at the time of the call (Ray Train swaps them in its
    workers)."""

    def __init__(self, to_stderr: bool = False) -> None:
        self.to_stderr = to_stderr
        super().__init__(sys.stderr if to_stderr else sys.stdout)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr if self.to_stderr else sys.stdout
        super().emit(record)


def configure(level: str | int | None = None, to_stderr: bool | None = None) -> None:
    """Send the `elastic` loggers' lines to stdout (stderr with `to_stderr`: a command whose stdout is a JSON
    document; None keeps what an earlier call chose) as `[elastic] message` (warnings and errors say so).
    Idempotent; `level` defaults to $ELASTIC_LOG_LEVEL, else INFO."""
    if level is None:
        level = os.environ.get(LEVEL_VARIABLE) or logging.INFO
    root = logging.getLogger("elastic")
    root.setLevel(level)
    root.propagate = False  # Ray's and the user's handlers on the root logger would print each line twice
    handlers = [h for h in root.handlers if isinstance(h, _StdoutHandler)]
    if handlers:
        if to_stderr is not None:
            handlers[0].to_stderr = to_stderr
    else:
        handler = _StdoutHandler(bool(to_stderr))
        handler.setFormatter(_Formatter())
        root.addHandler(handler)


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info and logging.getLogger("elastic").isEnabledFor(logging.DEBUG):
            message += "\n" + self.formatException(record.exc_info)
        if record.levelno >= logging.WARNING:
            return f"{PREFIX}{record.levelname.lower()}: {message}"
        return PREFIX + message
