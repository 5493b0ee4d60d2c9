"""Node labels shared by the local cluster, the cloud cluster configs and the trainer's placement.

Ray node labels (`ray start --labels`, `ray_start_params` labels in cluster YAMLs) carry these, so a job
selects nodes by market the same way on the local stack and on a cloud.
"""

from __future__ import annotations

MARKET_LABEL = "market"  # "spot" or "on-demand"
ROLE_LABEL = "elastic-role"  # "head" (drivers, controllers) or "worker" (training workers)
NODE_NAME_LABEL = "elastic-node"  # stable name of a local node, e.g. "spot-0"
# The cloud's instance type (g5.xlarge, g2-standard-8...): the run ledger records it and reports price by it.
INSTANCE_TYPE_LABEL = "elastic-instance-type"

HEAD_ROLE = "head"
WORKER_ROLE = "worker"
MARKETS = ("spot", "on-demand")


def worker_selector(market: str) -> dict[str, str]:
    """Label selector for training workers of a job whose workers.market is `market`."""
    selector = {ROLE_LABEL: WORKER_ROLE}
    if market in MARKETS:
        selector[MARKET_LABEL] = market
    return selector


def driver_selector() -> dict[str, str]:
    """Label selector for job drivers (and so Train and Tune controllers, which Ray places on the driver's
    node): the head, which the cluster configs and the local stack run on on-demand capacity."""
    return {ROLE_LABEL: HEAD_ROLE, MARKET_LABEL: "on-demand"}


def matches(labels: dict[str, str], selector: dict[str, str]) -> bool:
    """Equality selectors only (all this package uses)."""
    return all(labels.get(key) == value for key, value in selector.items())
