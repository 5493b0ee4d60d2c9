"""Runs with pytest-xdist (`make test`: -n 2): each integration module stays whole on one worker, in its order
(its tests share the module's stack and some build on the one before), while everything else is spread test by
test over both workers. The longest modules start first (the unit tests fill the end), and the run ends with
each module's total seconds, to keep MODULE_SECONDS current."""

from __future__ import annotations

from collections import defaultdict

INTEGRATION = "tests/integration/"

# Seconds each integration module took in CI (setup included), from the "seconds per integration module" summary
# (here: the clean-clone CI run of 2026-12-08, 56 min in all, two xdist workers, nothing else on the machine).
# Longest first is how two workers finish together: a long module started late is the run's tail. A module not
# listed goes after these, in collection order.
MODULE_SECONDS = {
    "test_submit_digits.py": 2480,
    "test_preemption_e2e.py": 1340,
    "test_sweep.py": 830,
    "test_local_lifecycle.py": 530,
    "test_spot_first.py": 250,
    "test_checkpoint_dcp.py": 160,
}


def integration_scope(nodeid: str) -> str:
    """The work unit of a test: its module for an integration test, the test itself otherwise."""
    if nodeid.startswith(INTEGRATION):
        return nodeid.split("::", 1)[0]
    return nodeid


def longest_first(nodeids: list[str]) -> list[str]:
    """Integration modules by MODULE_SECONDS (longest first, each module's tests in their order), then the other
    integration modules, then everything else, each group in collection order."""

    def key(indexed: tuple[int, str]) -> tuple[int, float, int]:
        index, nodeid = indexed
        if not nodeid.startswith(INTEGRATION):
            return (2, 0.0, index)
        module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
        if module in MODULE_SECONDS:
            return (0, -MODULE_SECONDS[module], index)
        return (1, 0.0, index)

    return [nodeid for _, nodeid in sorted(enumerate(nodeids), key=key)]


def pytest_collection_modifyitems(config, items):
    order = {nodeid: i for i, nodeid in enumerate(longest_first([item.nodeid for item in items]))}
    items.sort(key=lambda item: order[item.nodeid])


_module_seconds: dict[str, float] = defaultdict(float)
_config = None


def pytest_configure(config):
    global _config
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist): its terminal is the log
        _config = config


def pytest_runtest_logreport(report):
    if report.nodeid.startswith(INTEGRATION):
        _module_seconds[report.nodeid.split("::", 1)[0]] += report.duration
    terminal = _config.pluginmanager.get_plugin("terminalreporter") if _config is not None else None
    if terminal is not None and report.passed and report.when == "call" and report.nodeid.startswith(INTEGRATION):
        terminal.write_line(f"\npassed ({report.duration:.0f} s) {report.nodeid}")  # the log shows progress
    if report.failed and terminal is not None:
        # Named the moment it fails, with the end of its message: a CI run cut at its time limit never prints
        # pytest's summary, and then this line is all its log says of a failure.
        lines = report.longreprtext.splitlines()
        message = [line[1:].strip() for line in lines if line.startswith("E ")][:3] or lines[-1:]
        terminal.write_line(
            f"\nFAILED ({report.when}, {report.duration:.0f} s) {report.nodeid}: {' '.join(message)[:300]}"
        )


def pytest_terminal_summary(terminalreporter):
    if _module_seconds:
        terminalreporter.write_sep("=", "seconds per integration module (setup, call and teardown)")
        for module, seconds in sorted(_module_seconds.items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f"{seconds:8.1f}s {module}")


def pytest_xdist_make_scheduler(config, log):
    # Not `--dist loadgroup` with an xdist_group mark: xdist 3.8 names the group by rewriting `item._nodeid`, which
    # pytest 9.2 no longer reads, so the mark was silently lost and one module's tests ran on both workers, each on
    # a stack of its own, out of order. A scheduler that sets the scope itself does not depend on that.
    from xdist.scheduler import LoadScopeScheduling

    class IntegrationModulesWhole(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return integration_scope(nodeid)

    config.option.loadscopereorder = False  # keep longest_first's order (xdist would sort by number of tests)
    return IntegrationModulesWhole(config, log)
