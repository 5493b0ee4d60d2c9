"""A command run with --json prints its JSON document alone on stdout: log lines (a warning that a local node
was started again, say) go to stderr; without --json they go to stdout, as they always have."""

from __future__ import annotations

import logging

import pytest

from elastic import logs


@pytest.fixture
def elastic_logger():
    root = logging.getLogger("elastic")
    saved = list(root.handlers), root.level, root.propagate
    root.handlers = []
    yield logging.getLogger("elastic.local.stack")
    root.handlers, root.level, root.propagate = list(saved[0]), saved[1], saved[2]


def test_to_stderr_sends_lines_to_stderr_and_a_later_plain_configure_keeps_it(elastic_logger, capsys):
    logs.configure(logging.INFO, to_stderr=True)
    logs.configure()  # e.g. the driver code the same process runs later
    elastic_logger.warning("local node spot-3 gave up joining; starting another")
    out, err = capsys.readouterr()
    assert out == "" and err == "[elastic] warning: local node spot-3 gave up joining; starting another\n"


def test_lines_go_to_stdout_by_default(elastic_logger, capsys):
    logs.configure(logging.INFO)
    elastic_logger.info("checkpoint at step 5 committed")
    out, err = capsys.readouterr()
    assert out == "[elastic] checkpoint at step 5 committed\n" and err == ""
