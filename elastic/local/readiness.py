"""Waiting for the local stack's parts to come up, and saying exactly what is wrong when one does not.

Each wait has its own message: a port that never listens (the process died or is stuck before binding), the
dashboard that listens but whose job API does not answer (ray[default] missing, a token refused), a node whose
raylet runs but that never shows up in the cluster (with what was seen of it and the last lines of its log).
"""

from __future__ import annotations

import re
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

from elastic.environment import overridden
from elastic.errors import ClusterError
from elastic.local.processes import Launched
from elastic.local.state import LocalState, NodePlan, home_dir
from elastic.placement.labels import NODE_NAME_LABEL

LOG_LINES_SHOWN = 5
# A Go server's fatal line: glog's ("F1207 18:49:38.826111 filer.go:454 ..."), a panic, a runtime fatal error.
FATAL_LINE = re.compile(r"^(F\d{4} \d|panic: |fatal error: )")
# What `ray start` prints when its raylet did not register with the GCS within Ray's fixed 30 s (ray/_private/
# node.py): seen on a 2-core machine under load. The node will never join; starting it again usually works.
RAY_START_TIMED_OUT = "The current node timed out during startup"


class ExitedAtStart(ClusterError):
    """A process we started exited before it listened: the caller may start it again (on other ports)."""


class NodeStartTimedOut(ClusterError):
    """A node's `ray start` gave up registering (Ray's own fixed window): the caller may start it again."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


def logs_dir() -> Path:
    return home_dir() / "local" / "logs"


def wait_for_port(port: int, timeout: float, what: str, log: Path, root: Launched | None = None) -> None:
    """Until something listens on `port`; with `root`, an `ExitedAtStart` as soon as that process is gone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(1)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        if root is not None and root.process() is None:
            raise ExitedAtStart(f"{what} exited before it listened on port {port}; {_tail(log)}")
        time.sleep(0.2 if root is not None else 0.3)
    raise ClusterError(f"{what} did not start listening on port {port} within {timeout:.0f}s; {_tail(log)}")


def wait_for_job_api(state: LocalState, timeout: float) -> None:
    """The dashboard first (its port listening), then its job API answering with this stack's token."""
    port = int(state.dashboard_url.rsplit(":", 1)[1])
    wait_for_port(port, timeout, "the Ray dashboard", logs_dir() / "head.log")
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        request = urllib.request.Request(f"{state.dashboard_url}/api/version", headers=state.auth_headers())
        try:
            with urllib.request.urlopen(request, timeout=2) as resp:
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}"
        except urllib.error.HTTPError as err:
            last = f"HTTP {err.code}"
            if err.code in (401, 403):
                raise ClusterError(
                    f"the job API at {state.dashboard_url} refused the stack's token ({last}); run "
                    "`elastic local down` and `elastic local up` again"
                ) from None
        except OSError as err:
            last = str(getattr(err, "reason", err))
        time.sleep(0.5)
    raise ClusterError(
        f"the dashboard at {state.dashboard_url} listens but its job API did not answer within {timeout:.0f}s "
        f"({last}); is ray[default] installed? {_tail(logs_dir() / 'head.log')}"
    )


def ray_clients_at(state: LocalState):
    """Ray's state API and job client take RAY_API_SERVER_ADDRESS, then RAY_ADDRESS, over the address they are
    given: while this process polls the stack, both name this stack, whatever the shell exported."""
    return overridden({"RAY_ADDRESS": state.ray_address, "RAY_API_SERVER_ADDRESS": state.dashboard_url})


def wait_for_nodes(state: LocalState, plan: list[NodePlan], timeout: float) -> list[dict]:
    """The nodes of `plan`, once each is ALIVE in the cluster under its `elastic-node` label."""
    from ray.util.state import list_nodes  # ray only once nodes are started: the CLI starts fast

    by_name = {n.name: n for n in plan}
    deadline = time.monotonic() + timeout
    seen: dict[str, dict] = {}
    listed: list = []
    error = ""
    while time.monotonic() < deadline:
        try:
            with ray_clients_at(state):
                listed = list_nodes(address=state.dashboard_url, raise_on_missing_output=False, detail=True)
            error = ""
        except Exception as err:  # the dashboard answers only once it is up; keep polling until the deadline
            listed, error = [], f"{type(err).__name__}: {err}"
        for node in listed:
            name = (node.labels or {}).get(NODE_NAME_LABEL)
            if name in by_name and node.state == "ALIVE":
                p = by_name[name]
                seen[name] = {
                    "node_id": node.node_id,
                    "name": name,
                    "market": p.market,
                    "role": p.role,
                    "cpus": p.cpus,
                    "gpus": p.gpus,
                }
        if len(seen) == len(plan):
            return [seen[n.name] for n in plan]
        for node in plan:
            if node.name not in seen and RAY_START_TIMED_OUT in _tail(logs_dir() / f"{node.name}.log"):
                raise NodeStartTimedOut(
                    node.name, f"local node {node.name} gave up joining: " + _tail(logs_dir() / f"{node.name}.log")
                )
        _check_roots_alive(state)
        time.sleep(1.0)
    missing = [n for n in plan if n.name not in seen]
    raise ClusterError(
        f"local nodes {', '.join(n.name for n in missing)} did not join within {timeout:.0f}s: "
        + "; ".join(_diagnose(state, node, listed, error) for node in missing)
    )


def _diagnose(state: LocalState, node: NodePlan, listed: list, error: str) -> str:
    """What was seen of a node that did not join: its process, its entry in the cluster, its log."""
    roots = [r for r in state.launched() if r.role == node.name]
    alive = any(r.process() is not None for r in roots)
    facts = [f"{node.name}: process {'alive' if alive else 'not running'}"]
    if error:
        facts.append(f"the cluster's node list could not be read ({error[:200]})")
    else:
        mine = [n for n in listed if (n.labels or {}).get(NODE_NAME_LABEL) == node.name]
        if mine:
            facts.append(f"registered as {mine[-1].node_id[:12]} in state {mine[-1].state}")
        else:
            labelled = sorted((n.labels or {}).get(NODE_NAME_LABEL, "?") for n in listed)
            facts.append(f"not registered (the cluster lists {len(listed)} nodes: {', '.join(labelled) or 'none'})")
    facts.append(_tail(logs_dir() / f"{node.name}.log"))
    return ", ".join(facts)


def _check_roots_alive(state: LocalState) -> None:
    for root in state.launched():
        if root.process() is None:
            log = logs_dir() / f"{root.role}.log"
            raise ClusterError(f"local {root.role} process exited during start-up; {_tail(log)}")


def _tail(log: Path, lines: int = LOG_LINES_SHOWN) -> str:
    """`see LOG`, the log's first fatal line if it has one, and its last non-empty lines joined with ' | '
    (an error stays one line). The fatal line first: a Go server's fatal error is followed by every
    goroutine's stack, and its last lines say nothing."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return f"see {log} (not written)"
    fatal = next((line.strip() for line in text if FATAL_LINE.match(line)), "")
    last = [line.strip() for line in text if line.strip()][-lines:]
    return (
        f"see {log}"
        + (f"; fatal: {fatal}" if fatal and fatal not in last else "")
        + (f"; last lines: {' | '.join(last)}" if last else " (empty)")
    )
