"""One rehearsed node: its own HOME and Ray temp dir on this host, its file mounts, its commands run as Ray's
updater runs them, and its processes found (and killed, for a reclaim) by a variable they all inherit."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from elastic.local import processes
from elastic.rehearsal.plan import NodeCommand, NodeType, as_ray_runs_it

NODE_VARIABLE = "ELASTIC_REHEARSAL_NODE"  # every process a node's commands start carries its role
SHIM_DIR = ".rehearsal-bin"  # in each node's HOME: the stand-ins for sudo, apt, systemd
COMMAND_TIMEOUT_SECONDS = 900.0  # a setup command installs torch and Ray into a fresh venv


class NodeCommandFailed(RuntimeError):
    pass


@dataclass
class RehearsedNode:
    node_type: NodeType
    home: Path
    temp_dir: Path
    log_path: Path
    env: dict[str, str]  # the node's environment for its commands (stand-ins included)
    ports: dict[str, int]  # its own `ray start` listeners
    commands: list[NodeCommand] = field(default_factory=list)
    node_id: str | None = None

    @property
    def role(self) -> str:
        return self.node_type.role


def copy_file_mounts(mounts: dict[str, str], node_home: Path, laptop_home: Path, cwd: Path, excludes: list[str]):
    """Copy every file mount as `ray up` would (rsync, with rsync_exclude): remote ~ is the node's HOME, local
    ~ the laptop's, a relative local path is relative to where `ray up` runs. Returns the remote paths."""
    copied = []
    for remote, local in mounts.items():
        source = laptop_home / local[2:] if local.startswith("~/") else cwd / local
        if not source.exists():
            raise NodeCommandFailed(f"file_mounts: {local} does not exist (run the rehearsal where `ray up` runs)")
        # An absolute remote path lands under the node's HOME too: the host's own / is not the node's.
        target = node_home / (remote[2:] if remote.startswith("~/") else remote.lstrip("/"))
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True, ignore=_excluded(excludes))
        else:
            shutil.copy2(source, target)
        copied.append(remote)
    return copied


def _excluded(patterns: list[str]):
    def ignore(_dir: str, names: list[str]) -> set[str]:
        return {n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)}

    return ignore


def run_commands(node: RehearsedNode, phase: str | None = None) -> list[dict]:
    """Run the node's commands (of one phase, or all) in order; stop at the first failure, as `ray up` does."""
    results = []
    for index, command in enumerate(node.commands):
        if phase and command.phase != phase:
            continue
        started = time.monotonic()
        env = dict(node.env)
        if node.node_id:
            env["ELASTIC_NODE_ID"] = node.node_id
        with open(node.log_path, "a") as out:
            out.write(f"\n$ {command.rewritten}\n")
            out.flush()
            # A start command runs in a session of its own, raised until the node has joined (the caller
            # calls back_to_normal_priority): each node stands in for a machine, as the local stack's do
            # (elastic.local.processes: under load a raylet missed Ray's 15 s for its agent to start).
            start = command.phase == "start"
            proc = subprocess.Popen(
                as_ray_runs_it(command.rewritten, command.env),
                cwd=node.home,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=start,
            )
            if start:
                processes.raise_priority(proc.pid)
            try:
                code = proc.wait(timeout=COMMAND_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                code = -1
        result = {
            "phase": command.phase,
            "command": _first_line(command.command),
            "seconds": round(time.monotonic() - started, 1),
            "exit": code,
        }
        results.append(result)
        if code != 0:
            raise NodeCommandFailed(
                f"{node.role} node: {command.phase} command {index + 1} exited {code}: "
                f"{_first_line(command.command)} (log: {node.log_path}){_tail(node.log_path)}"
            )
        if command.phase == "start" and node.node_id is None:
            node.node_id = find_node_id(node.temp_dir)
    return results


def _tail(path: Path, lines: int = 8) -> str:
    """The command's last lines, so a failure on a machine whose files are gone (CI) still says why."""
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()[-lines:]
    except OSError:
        return ""
    return "\n" + "\n".join("  | " + line[:300] for line in text)


def _first_line(command: str, width: int = 100) -> str:
    text = " ".join(command.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def find_node_id(temp_dir: Path) -> str | None:
    """The Ray node id of the raylet started under this node's temp dir (a host runs three of them here)."""
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            cmdline = proc.info["cmdline"] or []
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if not cmdline or not cmdline[0].endswith("raylet") or not any(str(temp_dir) in a for a in cmdline):
            continue
        for arg in cmdline:
            found = re.fullmatch(r"--node_id=([0-9a-f]{56})", arg)
            if found:
                return found.group(1)
    return None


def node_processes(role: str, marker: str) -> list[psutil.Process]:
    """The processes of this rehearsal's node `role` (another rehearsal on the host has nodes of that role)."""
    ours = {p.pid for p in processes.find_marked(marker)}
    return [p for p in processes.find_marked(role, variable=NODE_VARIABLE) if p.pid in ours]


def back_to_normal_priority(role: str, marker: str, session_niceness: int = 0) -> None:
    """Once the node has joined: its processes at niceness 0, its session at `session_niceness`."""
    processes.sessions_back_to_normal(node_processes(role, marker), session_niceness)


def kill_node(role: str, marker: str) -> int:
    """Every process of the node at once (raylet, workers, watcher, units), as a VM that vanishes."""
    procs = node_processes(role, marker)
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)
    return len(procs)


def unit_state(state_dir: Path, unit: str) -> dict | None:
    try:
        return json.loads((state_dir / "units" / f"{unit}.state.json").read_text())
    except (OSError, ValueError):
        return None


def http_json(url: str, token: str, timeout: float = 10.0, data: bytes | None = None) -> dict:
    request = urllib.request.Request(url, data=data, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"{}")


def alive_nodes(dashboard_url: str, token: str) -> list[dict]:
    """Ray's state API over HTTP (the rehearsal never imports Ray: a CLI process reads Ray's auth mode once)."""
    body = http_json(
        f"{dashboard_url}/api/v0/nodes?limit=100&filter_keys=state&filter_predicates=%3D&filter_values=ALIVE&detail=1",
        token,
    )
    return body.get("data", {}).get("result", {}).get("result", [])


def pip_settings() -> dict[str, str]:
    """This machine's pip settings (its index, wheel folders, cache), which a fresh HOME would lose: the install
    is the config's, where the packages come from is the machine's."""
    settings = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
    settings.setdefault("PIP_CACHE_DIR", str(Path.home() / ".cache" / "pip"))
    for config in (Path.home() / ".config" / "pip" / "pip.conf", Path.home() / ".pip" / "pip.conf"):
        if "PIP_CONFIG_FILE" not in settings and config.is_file():
            settings["PIP_CONFIG_FILE"] = str(config)
    return settings


def fresh_home(home: Path) -> None:
    """A new user's HOME as useradd and cloud-init make it (/etc/skel: .profile, .bashrc), whose .bashrc first
    puts the shims on PATH where a node has /usr/bin's sudo and systemd-run. First: Ray's commands run in a
    login shell (/etc/profile resets PATH) and source ~/.bashrc again, and a venv's activate there restores the
    PATH it saw the first time; a PATH entry added after it would be lost."""
    skel = Path("/etc/skel")
    if skel.is_dir():
        shutil.copytree(skel, home, dirs_exist_ok=True)
    home.mkdir(parents=True, exist_ok=True)
    bashrc = home / ".bashrc"
    rest = bashrc.read_text() if bashrc.exists() else ""
    first = f'case ":$PATH:" in *":$HOME/{SHIM_DIR}:"*) ;; *) PATH="$HOME/{SHIM_DIR}:$PATH" ;; esac  # rehearsal\n'
    bashrc.write_text(first + rest)
    profile = home / ".profile"
    if not profile.exists():
        profile.write_text('[ -f "$HOME/.bashrc" ] && . "$HOME/.bashrc"\n')
