"""The bridge to Ray's drain API: drain one Ray node with reason PREEMPTION and a deadline.

`RayDrainer` talks to the GCS directly (`GcsClient.drain_node`, what `ray drain-node` calls in Ray 2.60), so the
watcher is never a Ray driver: no job, no worker process, nothing for the cluster to schedule. Ray is imported
only when a drain or a node lookup happens, so everything else here runs without it.

Which node: `--node-id` if given; else the Ray node running on this host. Ray 2.60 finds local raylets the way
`ray.init(address="auto")` does (`ray._private.services.find_node_ids()`: the `--node_id` of raylet processes on
this host); a node of the cluster is ours if it is alive and either one of those raylets or, where processes are
not visible (a KubeRay sidecar container), the one node whose NodeManagerAddress is this host's IP. Several
candidates (a local cluster with many raylets on one host) are an error: pass --node-id.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from elastic.errors import ClusterError, DrainError

DRAIN_REASON = "DRAIN_NODE_REASON_PREEMPTION"


@dataclass(frozen=True)
class DrainOutcome:
    accepted: bool
    node_id: str
    reason: str = ""  # Ray's rejection message when not accepted


class Drainer(Protocol):
    def drain(self, deadline_s: float, message: str) -> DrainOutcome:
        """Ask Ray to drain the node by `deadline_s` (epoch seconds) for a preemption."""
        ...

    def is_alive(self) -> bool:
        """Whether the node is still up (Ray ends an idle node as soon as it is drained)."""
        ...


@dataclass(frozen=True)
class NodeView:
    node_id: str  # hex
    address: str  # NodeManagerAddress
    alive: bool


def pick_local_node(nodes: Iterable[NodeView], local_raylet_ids: Iterable[str], host_ip: str | None) -> str:
    """The node this host runs (see the module docstring). Pure: raises DrainError (none yet) or ClusterError."""
    alive = [n for n in nodes if n.alive]
    local = set(local_raylet_ids)
    for candidates, how in (
        ([n for n in alive if n.node_id in local], "raylet processes on this host"),
        ([n for n in alive if host_ip and n.address == host_ip], f"nodes at {host_ip}"),
    ):
        if len(candidates) == 1:
            return candidates[0].node_id
        if len(candidates) > 1:
            ids = ", ".join(sorted(n.node_id[:12] for n in candidates))
            raise ClusterError(
                f"{len(candidates)} Ray nodes match this host ({how}: {ids}); pass --node-id to say which one to drain"
            )
    raise DrainError(
        f"no alive Ray node runs on this host ({host_ip or 'unknown IP'}) yet; "
        "start the watcher after `ray start`, or pass --node-id"
    )


class RayDrainer:
    """Drains through the GCS at `address` (default: RAY_ADDRESS, else the cluster `ray start` joined here)."""

    def __init__(self, address: str | None = None, node_id: str | None = None, rpc_timeout_s: float = 10.0):
        self._address = address
        self._node_id = node_id
        self.rpc_timeout_s = rpc_timeout_s
        self._client = None

    def gcs_address(self) -> str:
        # Ray's internals only once a drain is needed: `elastic watch-preemption` polls for hours without them.
        # Private: Ray 2.60 has no public way to resolve "auto" to the GCS address without ray.init().
        from ray._private import services

        try:
            address = services.canonicalize_bootstrap_address(self._address or "auto")
        except Exception as err:  # Ray raises ConnectionError/ValueError variants here; all mean the same
            raise ClusterError(
                f"cannot find the Ray cluster ({err}); pass --address HOST:PORT or set RAY_ADDRESS"
            ) from None
        if not address:
            raise ClusterError("no Ray cluster on this host; pass --address HOST:PORT or set RAY_ADDRESS")
        return address

    def client(self):
        if self._client is None:
            # Private: the GCS client `ray drain-node` uses; Ray 2.60 has no public drain API for a non-driver.
            from ray._raylet import GcsClient

            self._client = GcsClient(address=self.gcs_address())
        return self._client

    def node_id(self) -> str:
        if self._node_id is None:
            from ray._private import services  # find_node_ids: no public equivalent in Ray 2.60
            from ray.core.generated.gcs_pb2 import GcsNodeInfo
            from ray.util import get_node_ip_address

            try:
                infos = self.client().get_all_node_info(timeout=self.rpc_timeout_s)
            except Exception as err:  # any RPC failure: the GCS is not reachable now
                raise DrainError(f"cannot list Ray nodes at {self.gcs_address()}: {err}") from None
            nodes = [
                NodeView(node_id.hex(), info.node_manager_address, info.state == GcsNodeInfo.GcsNodeState.ALIVE)
                for node_id, info in infos.items()
            ]
            self._node_id = pick_local_node(nodes, services.find_node_ids(), get_node_ip_address())
        return self._node_id

    def is_alive(self) -> bool:
        from ray.core.generated.gcs_pb2 import GcsNodeInfo

        try:
            infos = self.client().get_all_node_info(timeout=self.rpc_timeout_s)
        except Exception:  # the GCS does not answer: treat the node as up, the caller holds to its deadline
            return True
        node_id = self.node_id()
        return any(n.hex() == node_id and i.state == GcsNodeInfo.GcsNodeState.ALIVE for n, i in infos.items())

    def drain(self, deadline_s: float, message: str) -> DrainOutcome:
        from ray.core.generated import autoscaler_pb2

        node_id = self.node_id()
        try:
            accepted, reason = self.client().drain_node(
                node_id,
                autoscaler_pb2.DrainNodeReason.Value(DRAIN_REASON),
                message,
                int(deadline_s * 1000),
                timeout=self.rpc_timeout_s,
            )
        except Exception as err:  # any RPC failure is worth another try on the next poll
            raise DrainError(f"drain request for node {node_id} failed: {err}") from None
        return DrainOutcome(bool(accepted), node_id, str(reason or ""))
