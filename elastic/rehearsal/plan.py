"""What a rehearsal runs: a `ray up` config's node commands, as Ray's updater would run them, for one host.

Pure: no Ray, no processes. The runner (runner.py) executes the plan.

Ray's updater runs each command over SSH as `bash --login -c -i 'source ~/.bashrc; export OMP_NUM_THREADS=1
PYTHONWARNINGS=ignore && (export VAR=VALUE;... COMMAND)'`: setup commands bare, start commands with the node
type's resources and labels in RAY_OVERRIDE_RESOURCES / RAY_OVERRIDE_LABELS (compact JSON), worker commands
prefixed by `export RAY_HEAD_IP=...; ` (ray.autoscaler._private: command_runner, updater, util.with_envs).

Three nodes share this host, so each command gets the few rewrites one host needs, every one reported:
- `ray stop` stops every Ray on the host (the head a worker's commands would stop is the rehearsal's own):
  skipped;
- `--autoscaling-config=...`: the autoscaler calls the cloud's API, which is what the rehearsal leaves out;
- `/tmp/ray`, Ray's default temp dir, becomes the node's own (nodes of one host sharing it would share one
  runtime-env folder, and one node's cleanup would pull a job's working_dir from under another's workers);
- fixed ports (6379, 8076, ...) become free loopback ports, the same number mapped the same way on every node,
  and `ray start` gets free ports for the listeners a host's second node would collide on.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field

HEAD, SPOT, ON_DEMAND = "head", "spot", "on-demand"
RAY_DEFAULT_TEMP_DIR = "/tmp/ray"

# `ray start` listeners that default to fixed numbers or that two nodes of one host must not share.
_PORT_FLAGS = (
    "port",
    "object-manager-port",
    "node-manager-port",
    "metrics-export-port",
    "runtime-env-agent-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
)
_HEAD_PORT_FLAGS = ("dashboard-port", "ray-client-server-port")
_PORT_FLAG = re.compile(r"--(?P<flag>[a-z-]*port)[= ](?P<port>\d+)\b")
_ADDRESS_PORT = re.compile(r"(--address[= ]\S*?):(?P<port>\d+)\b")
_RAY_STOP = re.compile(r"\bray stop\b")
_AUTOSCALING_CONFIG = re.compile(r"\s*--autoscaling-config[= ]\S+")
_RAY_START = re.compile(r"\bray start\b")


class PlanError(ValueError):
    """The config cannot be rehearsed (no spot worker type, no on-demand worker type, ...)."""


@dataclass(frozen=True)
class NodeType:
    role: str  # head, spot, on-demand
    name: str  # the config's node type name
    resources: dict
    labels: dict


@dataclass
class NodeCommand:
    phase: str  # setup or start
    command: str  # as the config writes it
    rewritten: str  # what runs (the one-host rewrites applied)
    rewrites: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)  # what Ray's updater exports before it


@dataclass
class PortMap:
    """Every fixed port a config names, mapped to one free loopback port (the GCS port included), shared by the
    nodes; plus per-node listeners. `free_port` supplies them."""

    free_port: Callable[[], int]
    fixed: dict[int, int] = field(default_factory=dict)

    def map(self, port: int) -> int:
        if port not in self.fixed:
            self.fixed[port] = self.free_port()
        return self.fixed[port]


def pick_node_types(config: dict) -> tuple[NodeType, NodeType, NodeType]:
    """The head type, the first spot worker type and the first on-demand worker type (by the `market` label)."""
    types = config.get("available_node_types") or {}
    head_name = config.get("head_node_type")
    if head_name not in types:
        raise PlanError(f"head_node_type {head_name!r} is not in available_node_types")

    def node_type(role: str, name: str) -> NodeType:
        spec = types[name] or {}
        return NodeType(role, name, dict(spec.get("resources") or {}), dict(spec.get("labels") or {}))

    workers = [name for name in types if name != head_name]
    by_market = {}
    for market in (SPOT, ON_DEMAND):
        found = [n for n in workers if (types[n] or {}).get("labels", {}).get("market") == market]
        if not found:
            raise PlanError(f"no worker node type is labeled market: {market}; a rehearsal plays one of each")
        by_market[market] = node_type(market, found[0])
    return node_type(HEAD, head_name), by_market[SPOT], by_market[ON_DEMAND]


def node_commands(config: dict, node: NodeType) -> list[tuple[str, str]]:
    """(phase, command) in the order Ray's updater runs them on a node of this type."""
    setup = list(config.get("setup_commands") or [])
    if node.role == HEAD:
        setup += config.get("head_setup_commands") or []
        start = config.get("head_start_ray_commands") or []
    else:
        setup += config.get("worker_setup_commands") or []
        start = config.get("worker_start_ray_commands") or []
    return [("setup", c) for c in setup] + [("start", c) for c in start]


def updater_env(node: NodeType, phase: str, head_ip: str) -> dict:
    """What Ray's updater exports before a command: labels and resources for start commands, the head's IP
    for every worker command."""
    env: dict = {}
    if node.role != HEAD:
        env["RAY_HEAD_IP"] = head_ip
    if phase == "start":
        if node.role == HEAD:
            env["RAY_USAGE_STATS_ENABLED"] = 0
        if node.resources:
            env["RAY_OVERRIDE_RESOURCES"] = node.resources
        if node.labels:
            env["RAY_OVERRIDE_LABELS"] = node.labels
    return env


def as_ray_runs_it(command: str, env: dict) -> list[str]:
    """argv of the command as Ray's SSH command runner builds it (login shell, ~/.bashrc, the exports)."""
    # The autoscaler prefixes worker commands with the head's IP (util.with_envs) before the updater's command
    # runner puts its own exports (compact JSON, shell-quoted) in front of that.
    exports = "".join(
        f"export {key}={shlex.quote(json.dumps(value, separators=(',', ':')))};"
        for key, value in env.items()
        if key != "RAY_HEAD_IP"
    )
    if "RAY_HEAD_IP" in env:
        exports += f"export RAY_HEAD_IP={env['RAY_HEAD_IP']}; "
    inner = f"source ~/.bashrc; export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore && ({exports}{command})"
    return ["bash", "--login", "-c", "-i", inner]


def rewrite_for_one_host(command: str, role: str, ports: PortMap, node_ports: dict[str, int], temp_dir: str):
    """(command, rewrites): the one-host rewrites (module docstring). `node_ports` holds this node's listeners
    by flag, added to `ray start` where the config leaves them to Ray's defaults."""
    rewrites: list[str] = []
    text = command
    if _RAY_STOP.search(text):
        text = _RAY_STOP.sub("true", text)
        rewrites.append("`ray stop` skipped: it stops every Ray on the host, and the host holds all three nodes")
    if _AUTOSCALING_CONFIG.search(text):
        text = _AUTOSCALING_CONFIG.sub("", text)
        rewrites.append("--autoscaling-config dropped: the autoscaler calls the cloud's API, left out here")
    if RAY_DEFAULT_TEMP_DIR in text:
        text = re.sub(re.escape(RAY_DEFAULT_TEMP_DIR) + r"(?![\w-])", temp_dir, text)
        rewrites.append(f"{RAY_DEFAULT_TEMP_DIR} -> this node's temp dir")
    if not _RAY_START.search(text):
        return text, rewrites

    named = set()

    def port_flag(match: re.Match) -> str:
        flag, port = match["flag"], int(match["port"])
        named.add(flag)
        new = node_ports[flag] if flag in node_ports and flag != "port" else ports.map(port)
        rewrites.append(f"--{flag}={port} -> {new}")
        return f"--{flag}={new}"

    def address_port(match: re.Match) -> str:
        port = int(match["port"])
        rewrites.append(f"head port {port} -> {ports.map(port)}")
        return f"{match.group(1)}:{ports.map(port)}"

    text = _PORT_FLAG.sub(port_flag, text)
    text = _ADDRESS_PORT.sub(address_port, text)
    wanted = [f for f in (*_PORT_FLAGS, *(_HEAD_PORT_FLAGS if role == HEAD else ())) if f != "port"]
    added = [f"--{flag}={node_ports[flag]}" for flag in wanted if flag not in named and flag in node_ports]
    added += [f"--temp-dir={temp_dir}", "--node-ip-address=127.0.0.1"]
    text = _RAY_START.sub("ray start " + " ".join(added), text, count=1)
    rewrites.append("ray start: " + " ".join(added))
    return text, rewrites


def listener_flags(role: str) -> tuple[str, ...]:
    """The `ray start` listeners a node of this role gets a port of its own for (see rewrite_for_one_host)."""
    return tuple(f for f in (*_PORT_FLAGS, *(_HEAD_PORT_FLAGS if role == HEAD else ())) if f != "port")


def plan_node(
    config: dict, node: NodeType, ports: PortMap, node_ports: dict[str, int], temp_dir: str, head_ip: str
) -> list[NodeCommand]:
    planned = []
    for phase, command in node_commands(config, node):
        rewritten, rewrites = rewrite_for_one_host(command, node.role, ports, node_ports, temp_dir)
        planned.append(NodeCommand(phase, command, rewritten, rewrites, updater_env(node, phase, head_ip)))
    return planned


def file_mounts(config: dict) -> dict[str, str]:
    """remote path (~-relative, as on the node) -> local path (as the laptop has it)."""
    return {str(remote): str(local) for remote, local in (config.get("file_mounts") or {}).items()}


def rsync_excludes(config: dict) -> list[str]:
    return [str(p) for p in config.get("rsync_exclude") or []]
