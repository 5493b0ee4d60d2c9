"""The rehearsal's plan: the config's commands as Ray's updater runs them, with the one-host rewrites."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml

from elastic.rehearsal.plan import (
    HEAD,
    ON_DEMAND,
    SPOT,
    PlanError,
    PortMap,
    as_ray_runs_it,
    listener_flags,
    pick_node_types,
    plan_node,
    rewrite_for_one_host,
    updater_env,
)

ROOT = Path(__file__).resolve().parents[3]


def ports() -> PortMap:
    return PortMap(itertools.count(40000).__next__)


def node_ports(role: str) -> dict[str, int]:
    return {flag: 50000 + i for i, flag in enumerate(listener_flags(role))}


@pytest.mark.parametrize("config", ["aws-spot-gpu.yaml", "gcp-spot-gpu.yaml"])
def test_the_shipped_configs_have_a_head_a_spot_and_an_on_demand_type(config):
    head, spot, on_demand = pick_node_types(yaml.safe_load((ROOT / "cluster-configs" / config).read_text()))
    assert (head.role, spot.role, on_demand.role) == (HEAD, SPOT, ON_DEMAND)
    assert spot.labels["market"] == "spot" and on_demand.labels["market"] == "on-demand"


def test_a_config_without_an_on_demand_worker_type_cannot_be_rehearsed():
    config = {
        "head_node_type": "head",
        "available_node_types": {"head": {"labels": {"market": "on-demand"}}, "w": {"labels": {"market": "spot"}}},
    }
    with pytest.raises(PlanError, match="market: on-demand"):
        pick_node_types(config)


def test_ray_start_gets_the_nodes_own_ports_and_temp_dir_and_the_shared_head_port():
    shared = ports()
    head_cmd, head_rewrites = rewrite_for_one_host(
        "ray start --head --port=6379 --object-manager-port=8076 --autoscaling-config=~/x.yaml --dashboard-host=127.0.0.1",
        HEAD,
        shared,
        node_ports(HEAD),
        "/tmp/el-head",
    )
    worker_cmd, _ = rewrite_for_one_host(
        "ray stop; ray start --address=$RAY_HEAD_IP:6379 --object-manager-port=8076",
        SPOT,
        shared,
        node_ports(SPOT),
        "/tmp/el-spot",
    )
    gcs = shared.fixed[6379]
    assert f"--port={gcs}" in head_cmd and f"--address=$RAY_HEAD_IP:{gcs}" in worker_cmd
    assert "--autoscaling-config" not in head_cmd and "8076" not in head_cmd + worker_cmd
    assert "--temp-dir=/tmp/el-head" in head_cmd and "--temp-dir=/tmp/el-spot" in worker_cmd
    assert "--dashboard-port=" in head_cmd and "--dashboard-port=" not in worker_cmd
    assert worker_cmd.startswith("true;"), "ray stop would stop every node on the host"
    assert any("autoscaling-config" in r for r in head_rewrites)
    # Flags the config sets keep their place (Click takes the last of a repeated option): never added twice.
    for flag in ("--object-manager-port=", "--port="):
        assert head_cmd.count(flag) == 1


def test_ray_default_temp_dir_becomes_the_nodes_own():
    command, rewrites = rewrite_for_one_host(
        'ls /tmp/ray/session_latest/sockets/raylet; echo "$(readlink -f /tmp/ray/session_latest)/logs"',
        SPOT,
        ports(),
        node_ports(SPOT),
        "/tmp/el-spot",
    )
    assert "/tmp/ray" not in command and command.count("/tmp/el-spot/session_latest") == 2
    assert rewrites == ["/tmp/ray -> this node's temp dir"]


def test_commands_without_ray_are_left_alone():
    command = '~/elastic-venv/bin/pip install -q "$HOME/elastic-src[gcp]"'
    assert rewrite_for_one_host(command, HEAD, ports(), node_ports(HEAD), "/tmp/x") == (command, [])


def test_updater_env_matches_what_rays_updater_exports():
    spot = pick_node_types(yaml.safe_load((ROOT / "cluster-configs" / "aws-spot-gpu.yaml").read_text()))[1]
    assert updater_env(spot, "setup", "10.0.0.1") == {"RAY_HEAD_IP": "10.0.0.1"}
    start = updater_env(spot, "start", "10.0.0.1")
    assert start["RAY_OVERRIDE_LABELS"] == spot.labels and start["RAY_OVERRIDE_RESOURCES"] == spot.resources


def test_the_command_line_is_the_one_rays_ssh_runner_builds():
    """Pinned against Ray's own (private) builders, so a change in Ray shows up here."""
    from ray.autoscaler._private.command_runner import _with_environment_variables, _with_interactive
    from ray.autoscaler._private.util import with_envs

    env = {"RAY_OVERRIDE_LABELS": {"market": "spot"}, "RAY_OVERRIDE_RESOURCES": {"CPU": 4}}
    command = "ray start --address=$RAY_HEAD_IP:6379"
    (with_ip,) = with_envs([command], {"RAY_HEAD_IP": "127.0.0.1"})
    ray_argv = _with_interactive(_with_environment_variables(with_ip, env))
    ours = as_ray_runs_it(command, {"RAY_HEAD_IP": "127.0.0.1", **env})
    # Ray quotes the whole inner command for its ssh argv; run locally, the argv carries it unquoted.
    import shlex

    assert ours[:4] == ray_argv[:4] and shlex.split(ray_argv[4]) == [ours[4]]


def test_the_spot_watcher_case_matches_the_labels_as_ray_exports_them():
    """The configs start the watcher on `case "$RAY_OVERRIDE_LABELS" in *'"market":"spot"'*`: Ray exports the
    labels as compact JSON, so the pattern must match it (a space after the colon would never match)."""
    import subprocess

    config = yaml.safe_load((ROOT / "cluster-configs" / "aws-spot-gpu.yaml").read_text())
    head, spot, on_demand = pick_node_types(config)
    shared = ports()
    for node, expected in ((spot, "spot"), (on_demand, "not")):
        (watcher,) = [
            c for c in plan_node(config, node, shared, node_ports(node.role), "/tmp/x", "h") if "case" in c.command
        ]
        probe = watcher.rewritten.split(")", 1)[0] + ") echo spot ;; *) echo not ;; esac"
        exports = as_ray_runs_it(probe, watcher.env)[4].split("&& (", 1)[1].rsplit(")", 1)[0]
        out = subprocess.run(["bash", "-c", exports], capture_output=True, text=True).stdout.strip()
        assert out == expected, (exports, out)


def test_a_venv_without_a_python_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    import sys

    from elastic.cli import main

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(
        sys, "argv", ["elastic", "cluster", "rehearse", "cluster-configs/aws-spot-gpu.yaml", "--venv", str(tmp_path)]
    )
    with pytest.raises(SystemExit) as exited:
        main()
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(lines) == 1, lines
    assert f"--venv {tmp_path}: no bin/python there; make one with `python3 -m venv {tmp_path}`" in lines[0]
