"""Runs with pytest-xdist (`make test`: -n 2): each integration module stays whole on one worker, in its order
(its tests share the module's stack and some build on the one before), while everything else is spread test by
test over both workers."""

from __future__ import annotations

INTEGRATION = "tests/integration/"


def integration_scope(nodeid: str) -> str:
    """The work unit of a test: its module for an integration test, the test itself otherwise."""
    if nodeid.startswith(INTEGRATION):
        return nodeid.split("::", 1)[0]
    return nodeid


def pytest_xdist_make_scheduler(config, log):
    # Not `--dist loadgroup` with an xdist_group mark: xdist 3.8 names the group by rewriting `item._nodeid`, which
    # pytest 9.2 no longer reads, so the mark was silently lost and one module's tests ran on both workers, each on
    # a stack of its own, out of order. A scheduler that sets the scope itself does not depend on that.
    from xdist.scheduler import LoadScopeScheduling

    class IntegrationModulesWhole(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return integration_scope(nodeid)

    return IntegrationModulesWhole(config, log)
