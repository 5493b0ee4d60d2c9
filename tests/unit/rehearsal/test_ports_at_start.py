"""A node's `ray start` binds ports picked minutes earlier (before its setup commands): any taken meanwhile by
another process of the host are picked again, and the commands that name them planned again."""

from __future__ import annotations

import socket
from pathlib import Path

import yaml

from elastic.rehearsal.plan import HEAD, SPOT, pick_node_types
from elastic.rehearsal.report import Report
from elastic.rehearsal.runner import _Rehearsal

ROOT = Path(__file__).resolve().parents[3]


def rehearsal(tmp_path) -> _Rehearsal:
    config = yaml.safe_load((ROOT / "cluster-configs" / "aws-spot-gpu.yaml").read_text())
    r = _Rehearsal(config, "aws", tmp_path, Report("aws-spot-gpu.yaml", "aws"), "weed", lambda _m: None)
    r._make_nodes(*pick_node_types(config))
    return r


def start_commands(node) -> str:
    return "\n".join(c.rewritten for c in node.commands if c.phase == "start")


def test_a_listener_taken_since_the_plan_is_picked_again(tmp_path):
    r = rehearsal(tmp_path)
    spot = r.nodes[SPOT]
    taken = spot.ports["object-manager-port"]
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        assert f"--object-manager-port={taken}" in start_commands(spot)
        r._reclaim_taken_ports(spot)
    assert spot.ports["object-manager-port"] != taken
    assert f"--object-manager-port={spot.ports['object-manager-port']}" in start_commands(spot)
    assert f"--object-manager-port={taken}" not in start_commands(spot)


def test_a_taken_gcs_port_moves_the_head_and_every_workers_address(tmp_path):
    r = rehearsal(tmp_path)
    gcs = r.ports.map(6379)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", gcs))
        squatter.listen()
        r._reclaim_taken_ports(r.nodes[HEAD])
    moved = r.ports.map(6379)
    assert moved != gcs
    assert f"--port={moved}" in start_commands(r.nodes[HEAD])
    assert r.nodes[SPOT].env["RAY_ADDRESS"] == f"127.0.0.1:{moved}"
    assert f"--address=$RAY_HEAD_IP:{moved}" in start_commands(r.nodes[SPOT])


def test_nothing_is_planned_again_when_every_port_is_still_free(tmp_path):
    r = rehearsal(tmp_path)
    before = {role: start_commands(node) for role, node in r.nodes.items()}
    r._reclaim_taken_ports(r.nodes[HEAD])
    assert {role: start_commands(node) for role, node in r.nodes.items()} == before
