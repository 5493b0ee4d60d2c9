"""Unit tests for elastic/local/preempt.py's node selection (the reclaim itself runs in tests/integration)."""

from __future__ import annotations

import random

import pytest

from elastic.errors import ClusterError
from elastic.local.preempt import select_nodes
from elastic.local.stack import LocalState


def state() -> LocalState:
    nodes = [
        {"node_id": "h" * 8, "name": "head", "market": "on-demand", "role": "head"},
        {"node_id": "a" * 8, "name": "on-demand-0", "market": "on-demand", "role": "worker"},
        {"node_id": "b" * 8, "name": "spot-0", "market": "spot", "role": "worker"},
        {"node_id": "c" * 8, "name": "spot-1", "market": "spot", "role": "worker"},
    ]
    return LocalState(
        marker="m",
        temp_dir="/tmp/x",
        ray_address="",
        dashboard_url="",
        s3_endpoint="",
        bucket="b",
        logical_gpus=False,
        nodes=nodes,
    )


def names(nodes: list[dict]) -> list[str]:
    return [n["name"] for n in nodes]


def test_by_name_or_id_prefix_and_never_the_head():
    assert names(select_nodes(state(), node="spot-1", busy=set())) == ["spot-1"]
    assert names(select_nodes(state(), node="bbb", busy=set())) == ["spot-0"]
    with pytest.raises(ClusterError, match="--node head: no such worker node"):
        select_nodes(state(), node="head", busy=set())


def test_a_market_prefers_nodes_running_training_workers():
    assert names(select_nodes(state(), market="spot", busy=set())) == ["spot-0"]
    assert names(select_nodes(state(), market="spot", busy={"c" * 8})) == ["spot-1"]
    assert names(select_nodes(state(), market="spot", count=2, busy={"c" * 8})) == ["spot-1", "spot-0"]


def test_random_and_counts_beyond_the_pool():
    picked = select_nodes(state(), pick_random=True, market="spot", rng=random.Random(3), busy=set())
    assert len(picked) == 1 and picked[0]["market"] == "spot"
    with pytest.raises(ClusterError, match="--count 3: only 2 spot node"):
        select_nodes(state(), market="spot", count=3, busy=set())
    with pytest.raises(ClusterError, match="no on-demand node"):
        select_nodes(LocalState(**{**state().__dict__, "nodes": state().nodes[2:]}), market="on-demand", busy=set())
