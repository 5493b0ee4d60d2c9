"""Environment variables set for a block of code and put back after it, as they were (set or unset)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


@contextmanager
def overridden(values: Mapping[str, str | None]) -> Iterator[None]:
    """`values` in os.environ for the block (None: unset); every name named comes back as it was."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            _put(name, value)
        yield
    finally:
        for name, value in saved.items():
            _put(name, value)


def _put(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
