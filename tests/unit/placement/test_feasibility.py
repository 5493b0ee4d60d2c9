"""check_feasible: a request the cluster's worker nodes can never hold is named with its numbers (pure, no Ray)."""

from __future__ import annotations

from elastic.config.spec import WorkersSpec
from elastic.placement.feasibility import check_feasible, slots_on
from elastic.placement.labels import MARKET_LABEL, ROLE_LABEL
from elastic.placement.policy import NodeView


def node(market: str, cpus: float, gpus: float = 0.0, role: str = "worker") -> NodeView:
    total = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    return NodeView(f"{market}-{cpus}-{gpus}", {ROLE_LABEL: role, MARKET_LABEL: market}, available={}, total=total)


# The local stack's default: an on-demand head that trains nothing, 2 spot and 1 on-demand worker of 2 CPUs.
LOCAL = [node("on-demand", 0, role="head"), node("spot", 2), node("spot", 2), node("on-demand", 2)]


def workers(**fields) -> WorkersSpec:
    return WorkersSpec.model_validate({"min": 1, **fields})


def test_a_job_that_fits_is_feasible_with_its_capacity():
    verdict = check_feasible(workers(min=2, max=2, market="spot"), LOCAL)
    assert verdict.problem is None and verdict.capacity == 4  # 2 spot nodes x 2 one-CPU workers


def test_more_workers_than_the_nodes_hold_is_refused_with_the_numbers():
    verdict = check_feasible(workers(min=10_000, market="spot"), LOCAL)
    assert verdict.problem == (
        "workers.min: 10000 workers of 1 CPU each do not fit: the 2 spot worker nodes hold at most 4; "
        "lower workers.min to 4 or add nodes"
    )
    assert verdict.capacity == 4


def test_a_worker_bigger_than_every_node_is_refused_naming_the_biggest():
    verdict = check_feasible(workers(cpus=3, gpus=1, market="any"), LOCAL)
    assert verdict.problem == (
        "workers: one worker needs 3 CPU + 1 GPU but the largest of the 3 worker nodes has 2 CPU, 0 GPU; "
        "lower workers.cpus or workers.gpus or add bigger nodes"
    )


def test_gpus_count_per_node():
    gpu_nodes = [node("spot", 8, 1), node("spot", 8, 1), node("on-demand", 8, 4)]
    assert slots_on(gpu_nodes[2], workers(cpus=1, gpus=2)) == 2
    assert check_feasible(workers(min=2, gpus=1, market="spot"), gpu_nodes).problem is None
    refused = check_feasible(workers(min=3, gpus=1, market="spot"), gpu_nodes)
    assert "hold at most 2" in refused.problem and "1 CPU + 1 GPU" in refused.problem


def test_spot_first_may_use_either_market():
    nodes = [node("spot", 1), node("on-demand", 4)]
    assert check_feasible(workers(min=3, market="spot-first"), nodes).problem is None  # on-demand holds 4
    assert "on-demand worker nodes hold at most 4" in check_feasible(workers(min=5, market="spot-first"), nodes).problem
    assert check_feasible(workers(min=3, market="spot"), nodes).problem is not None


def test_the_head_never_counts_and_a_cluster_without_worker_nodes_is_not_judged():
    assert check_feasible(workers(min=1, market="on-demand"), [node("on-demand", 64, role="head")]).problem is None
    assert check_feasible(workers(min=1), []).problem is None
    assert check_feasible(workers(min=3), [node("on-demand", 64, role="head"), node("spot", 2)]).problem is not None


def test_fractional_shares_fit_despite_float_error():
    assert slots_on(node("spot", 1.0), workers(cpus=0.1)) == 10
