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
    """Writes to whatever sys.stdout is at the time of the call (Ray Train swaps it in its workers)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout
        super().emit(record)


def configure(level: str | int | None = None) -> None:
    """Send the `elastic` loggers' lines to stdout as `[elastic] message` (warnings and errors say so).
    Idempotent; `level` defaults to $ELASTIC_LOG_LEVEL, else INFO."""
    if level is None:
        level = os.environ.get(LEVEL_VARIABLE) or logging.INFO
    root = logging.getLogger("elastic")
    root.setLevel(level)
    root.propagate = False  # Ray's and the user's handlers on the root logger would print each line twice
    if not any(isinstance(h, _StdoutHandler) for h in root.handlers):
        handler = _StdoutHandler()
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
