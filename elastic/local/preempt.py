"""`elastic preempt`: a spot reclaim on the local cluster, through the same path as on a cloud.

With notice, the node's metadata endpoint announces the reclaim (as AWS's IMDS would), the node's
`elastic watch-preemption` daemon sees it and drains the Ray node, and at the deadline the node is killed: its
raylet, workers and daemons all at once, as a VM that vanishes. `--hard` kills without notice. `--replace-after`
starts a like node later, as an autoscaler would. A node started without a metadata endpoint (an on-demand
node, or a stack from before watchers) is drained directly through Ray's drain API instead, and says so.
"""

from __future__ import annotations

import logging
import os
import random
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from elastic.errors import ClusterError
from elastic.local import processes
from elastic.local import stack as local
from elastic.local.metadata_server import post_admin
from elastic.placement.labels import WORKER_ROLE

_log = logging.getLogger(__name__)


@dataclass
class Reclaim:
    """What happened to one node, with unix times, for logs, --json and the recovery benchmark."""

    name: str
    node_id: str
    market: str
    notice_seconds: float | None
    path: str = ""  # metadata (announced to the watcher) | drain (Ray's drain API directly) | hard
    announced_at: float | None = None
    killed_at: float | None = None
    processes_killed: int = 0
    replacement: dict | None = None
    replaced_at: float | None = None


@dataclass
class PreemptReport:
    reclaims: list[Reclaim] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"reclaims": [asdict(r) for r in self.reclaims]}


def select_nodes(
    state: local.LocalState,
    node: str | None = None,
    pick_random: bool = False,
    market: str | None = None,
    count: int = 1,
    rng: random.Random | None = None,
    busy: set[str] | None = None,
) -> list[dict]:
    """Worker nodes to reclaim: by name or node id (prefix), at random, or of a market, nodes running a
    training worker first (`busy`: their ids; default: asked of Ray's state API)."""
    workers = [n for n in state.nodes if n["role"] == WORKER_ROLE]
    if node is not None:
        chosen = [n for n in workers if n["name"] == node or n["node_id"].startswith(node)]
        if not chosen:
            names = ", ".join(n["name"] for n in workers) or "none"
            raise ClusterError(f"--node {node}: no such worker node on the local stack (nodes: {names})")
        return chosen[:1]
    pool = [n for n in workers if market is None or n["market"] == market]
    if not pool:
        raise ClusterError(
            f"no {market or 'worker'} node on the local stack to preempt; "
            f"add one with `elastic local add-node --market {market or 'spot'}`"
        )
    if count > len(pool):
        raise ClusterError(f"--count {count}: only {len(pool)} {market or 'worker'} node(s) on the local stack")
    if pick_random:
        return (rng or random.Random()).sample(pool, count)
    busy = _nodes_with_training_workers(state) if busy is None else busy
    return sorted(pool, key=lambda n: n["node_id"] not in busy)[:count]  # stable: busy nodes first


def _nodes_with_training_workers(state: local.LocalState) -> set[str]:
    """Nodes running a Ray Train worker now (a reclaim of an idle node shows nothing)."""
    # The stack's auth mode and token first: Ray reads RAY_AUTH_MODE once, when it is imported.
    state.use_ray()
    try:
        from ray.util.state import list_actors  # ray only when a cluster is there to ask: the CLI starts fast

        actors = list_actors(
            address=state.dashboard_url, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False
        )
    except Exception as err:  # the state API is unavailable: fall back to the stack's order
        _log.warning(
            "could not tell which nodes run training workers (%s: %s); choosing in the stack's order "
            "(name the node with --node to be sure)",
            type(err).__name__,
            str(err)[:200],
        )
        return set()
    return {a.node_id for a in actors if "RayTrainWorker" in (a.class_name or "")}


def preempt(
    nodes: list[dict],
    notice: float | None,
    hard: bool = False,
    replace_after: float | None = None,
    log: Callable[[str], None] = print,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> PreemptReport:
    """Reclaim `nodes` of the running local stack at the same moment (correlated reclaims are the common case)."""
    state = local.running_state()
    if state is None:
        raise ClusterError("no local stack running; start one with `elastic local up`")
    report = PreemptReport([Reclaim(n["name"], n["node_id"], n["market"], None if hard else notice) for n in nodes])
    if not hard:
        for reclaim, node in zip(report.reclaims, nodes):
            _announce(state, node, reclaim, notice or 0.0, log, clock)
        deadline = max(r.announced_at for r in report.reclaims) + (notice or 0.0)
        sleep(max(0.0, deadline - clock()))
    for reclaim in report.reclaims:
        reclaim.path = reclaim.path or "hard"
        reclaim.processes_killed = kill_node(reclaim.name)
        reclaim.killed_at = clock()
        log(f"{reclaim.name}: node {reclaim.node_id[:12]} killed ({reclaim.processes_killed} processes)")
    if replace_after is not None:
        sleep(replace_after)
        for reclaim in report.reclaims:
            reclaim.replacement = local.add_node(reclaim.market)
            reclaim.replaced_at = clock()
            log(
                f"{reclaim.name}: replaced by {reclaim.replacement['name']} "
                f"(node {reclaim.replacement['node_id'][:12]})"
            )
    return report


def _announce(state: local.LocalState, node: dict, reclaim: Reclaim, notice: float, log, clock) -> None:
    url = node.get("metadata_url")
    reclaim.announced_at = clock()
    if url:
        post_admin(url, "reclaim", notice=f"{notice:g}")
        reclaim.path = "metadata"
        log(
            f"{node['name']}: reclaim announced on its metadata endpoint, {notice:g} s notice "
            "(its watcher drains the Ray node)"
        )
        return
    drain(state, node["node_id"], deadline_seconds=notice)
    reclaim.path = "drain"
    log(f"{node['name']}: no metadata endpoint on this node; drained through Ray directly, {notice:g} s deadline")


def drain(state: local.LocalState, node_id: str, deadline_seconds: float) -> None:
    """Ray's own `ray drain-node` with reason PREEMPTION (what the watcher does from a cloud notice)."""
    ray_bin = processes.binary("ray", "ray[default]")
    proc = subprocess.run(
        [
            ray_bin,
            "drain-node",
            f"--address={state.ray_address}",
            f"--node-id={node_id}",
            "--reason=DRAIN_NODE_REASON_PREEMPTION",
            "--reason-message=elastic preempt (simulated spot reclaim)",
            f"--deadline-remaining-seconds={max(0, int(deadline_seconds))}",
        ],
        env={**os.environ, **state.env()},
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode != 0:
        raise ClusterError(
            f"ray drain-node failed for node {node_id[:12]}: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}"
        )


def kill_node(name: str) -> int:
    """Kill a local node's raylet tree and its daemons (watcher, metadata endpoint), and forget it."""
    with local.state_lock():
        state = local.running_state()
        if state is None:
            raise ClusterError("no local stack running")
        roles = {name, f"watcher-{name}", f"metadata-{name}"}
        killed = processes.kill_trees([root for root in state.launched() if root.role in roles])
        state.roots = [root.to_dict() for root in state.launched() if root.role not in roles]
        state.nodes = [n for n in state.nodes if n["name"] != name]
        state.retired = [*state.retired, name]
        local.save_state(state)
    return killed
