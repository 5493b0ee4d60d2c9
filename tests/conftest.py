"""Runs with pytest-xdist (`make test`: -n 2 --dist loadgroup): the integration tests stay one serial group on
one worker (each starts Ray stacks and wants the machine), while the unit tests run beside them on the other."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.get_closest_marker("integration") is not None or "tests/integration/" in item.nodeid:
            item.add_marker(pytest.mark.xdist_group("integration"))
