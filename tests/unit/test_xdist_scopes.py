"""`make test` keeps each integration module whole on one xdist worker (tests/conftest.py's scheduler): its tests
share one stack and some build on the one before."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def _root_conftest():
    spec = importlib.util.spec_from_file_location("root_conftest", Path(__file__).parents[1] / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_integration_test_is_scoped_to_its_module_and_a_unit_test_to_itself():
    scope = _root_conftest().integration_scope
    module = "tests/integration/test_submit_digits.py"
    assert scope(f"{module}::test_local_up") == module
    assert scope(f"{module}::test_verify_resume[jobs/charlm.yaml-overrides0-False]") == module
    unit = "tests/unit/data/test_streaming.py::test_columnar[2]"
    assert scope(unit) == unit


def test_the_longest_integration_modules_start_first_and_unit_tests_fill_the_end():
    conftest = _root_conftest()
    nodeids = [
        "tests/unit/a/test_x.py::test_one",
        "tests/integration/test_fsdp.py::test_a",
        "tests/integration/test_local_lifecycle.py::test_first",
        "tests/integration/test_submit_digits.py::test_first",
        "tests/integration/test_local_lifecycle.py::test_second",
        "tests/integration/test_submit_digits.py::test_second",
        "tests/unit/b/test_y.py::test_two",
    ]
    assert conftest.longest_first(nodeids) == [
        "tests/integration/test_submit_digits.py::test_first",
        "tests/integration/test_submit_digits.py::test_second",
        "tests/integration/test_local_lifecycle.py::test_first",
        "tests/integration/test_local_lifecycle.py::test_second",
        "tests/integration/test_fsdp.py::test_a",
        "tests/unit/a/test_x.py::test_one",
        "tests/unit/b/test_y.py::test_two",
    ]
