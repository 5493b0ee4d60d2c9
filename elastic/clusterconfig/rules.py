"""Our rules for `ray up` cluster configs (AWS, GCP): what this project relies on and Ray does not check (spot and
on-demand worker types labeled as jobs select them, an on-demand head that offers nothing to training, the
supervised preemption watcher on spot types, token auth, closed ports, checkpoints in an object store, elastic
installed from a shipped checkout or a pinned release). The cloud fields of node configs: cloud_fields.py."""

from __future__ import annotations

import re
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from elastic.clusterconfig.cloud_fields import (
    check_aws_ingress,
    check_cloud_node_config,
    gpus,
    market_of,
    market_source,
    spot_hint,
)
from elastic.clusterconfig.problems import Problem, env_assignments, suggest
from elastic.placement.labels import HEAD_ROLE, MARKET_LABEL, MARKETS, ROLE_LABEL, WORKER_ROLE

WATCHER_COMMAND = "elastic watch-preemption"
REMOTE_SCHEMES = ("s3", "s3a", "gs", "gcs", "abfs", "abfss", "az")
STORAGE_ENV = re.compile(r"^(ELASTIC_[A-Z0-9_]*URI|[A-Z0-9_]*CHECKPOINT[A-Z0-9_]*(URI|PATH|DIR))$")
_BACKGROUND = re.compile(r"(?<![&<>])&(?![&>])")
WATCHER = re.compile(r"elastic\s+watch-preemption(?P<args>[^;&|\n]*)")
_PIP_INSTALL = re.compile(r"\bpip3?\s+install\b(?P<args>[^;&|\n]*)")
_HOME = re.compile(r"^(\$HOME|\$\{HOME\})(?=/|$)")


# ---------------------------------------------------------------------------------------------------------
# `ray up` configs (AWS, GCP)


def check_ray_up(config: dict, cloud: str) -> list[Problem]:
    problems: list[Problem] = []
    types: dict[str, dict] = config.get("available_node_types") or {}
    head = config.get("head_node_type")
    commands = {name: list(_node_commands(config, name, name == head)) for name in types}

    spot_gpu, on_demand_gpu = [], []
    for name, node_type in types.items():
        base = f"available_node_types.{name}"
        node_config = node_type.get("node_config") or {}
        problems += check_cloud_node_config(cloud, base, node_config)
        cloud_market = market_of(cloud, node_config)
        labels = node_type.get("labels") or {}
        problems += check_labels(f"{base}.labels", labels, head=name == head)
        label_market = labels.get(MARKET_LABEL)
        if label_market in MARKETS and cloud_market is not None and cloud_market != label_market:
            problems.append(
                Problem(
                    f"{base}.labels.{MARKET_LABEL}",
                    f"labeled '{label_market}' but {market_source(cloud)} makes it {cloud_market}; "
                    f"label it '{cloud_market}' or change the node config",
                )
            )
        if name == head:
            problems += _check_head(config, base, node_type, cloud_market, cloud)
            continue
        if gpus(cloud, node_type) > 0 and labels.get(ROLE_LABEL) == WORKER_ROLE:
            (spot_gpu if cloud_market == "spot" else on_demand_gpu).append(name)
        if cloud_market == "spot":
            problems += _check_watcher(commands[name], base, cloud)

    if not spot_gpu:
        problems.append(
            Problem(
                "available_node_types",
                f"no spot GPU worker type; add one with {spot_hint(cloud)}, GPUs, and labels "
                f"{{{MARKET_LABEL}: spot, {ROLE_LABEL}: {WORKER_ROLE}}}",
            )
        )
    if not on_demand_gpu:
        problems.append(
            Problem(
                "available_node_types",
                "no on-demand GPU worker type (the fallback when spot capacity is short); add one "
                f"with GPUs and labels {{{MARKET_LABEL}: on-demand, {ROLE_LABEL}: {WORKER_ROLE}}}",
            )
        )
    problems += _check_token_auth(config, commands)
    problems += _check_dashboard(config)
    problems += _check_storage(commands)
    problems += _check_package_pin(commands)
    problems += _check_elastic_install(config, commands)
    if cloud == "aws":
        problems += check_aws_ingress(config.get("provider") or {})
    return problems


def _node_commands(config: dict, name: str, is_head: bool) -> Iterable[tuple[str, str]]:
    """(key, command) for every command `ray up` and the autoscaler run on nodes of this type."""
    node_type = config["available_node_types"][name]
    if "initialization_commands" in node_type:
        yield from _keyed(node_type, "initialization_commands", f"available_node_types.{name}.")
    else:
        yield from _keyed(config, "initialization_commands")
    if is_head:
        yield from _keyed(config, "setup_commands")
        yield from _keyed(config, "head_setup_commands")
        yield from _keyed(config, "head_start_ray_commands")
        return
    if "worker_setup_commands" in node_type:  # a node type's own list replaces the global setup lists
        yield from _keyed(node_type, "worker_setup_commands", f"available_node_types.{name}.")
    else:
        yield from _keyed(config, "setup_commands")
        yield from _keyed(config, "worker_setup_commands")
    yield from _keyed(config, "worker_start_ray_commands")


def _keyed(container: dict, field: str, prefix: str = "") -> Iterable[tuple[str, str]]:
    for i, command in enumerate(container.get(field) or []):
        yield f"{prefix}{field}[{i}]", str(command)


def check_labels(key: str, labels: Any, head: bool) -> list[Problem]:
    if not isinstance(labels, dict):
        return [Problem(key, "labels must be a mapping of Ray node labels")]
    problems = []
    want_role = HEAD_ROLE if head else WORKER_ROLE
    role = labels.get(ROLE_LABEL)
    if role != want_role:
        why = (
            "drivers and controllers select the head by it"
            if head
            else f"training workers select {ROLE_LABEL}={WORKER_ROLE}"
        )
        problems.append(
            Problem(
                f"{key}.{ROLE_LABEL}" if role is not None else key,
                f"{'missing ' + ROLE_LABEL + ' label' if role is None else repr(role) + ' is the wrong role'}"
                f" ({why}); set labels.{ROLE_LABEL}: {want_role}",
            )
        )
    market = labels.get(MARKET_LABEL)
    if market is None:
        problems.append(
            Problem(
                key,
                f"missing {MARKET_LABEL} label; jobs select nodes by it: set labels.{MARKET_LABEL}: spot or on-demand",
            )
        )
    elif market not in MARKETS:
        problems.append(
            Problem(
                f"{key}.{MARKET_LABEL}",
                f"{market!r} is not a market jobs request{suggest(market, MARKETS)}; use one of {', '.join(MARKETS)}",
            )
        )
    return problems


def _check_head(config: dict, base: str, node_type: dict, market: str, cloud: str) -> list[Problem]:
    problems = []
    if market == "spot":
        fix = "remove InstanceMarketOptions" if cloud == "aws" else "use scheduling.provisioningModel: STANDARD"
        problems.append(
            Problem(
                f"{base}.node_config",
                f"the head is on spot: a reclaim ends every driver, the autoscaler and the job API; {fix} on the head",
            )
        )
    resources = node_type.get("resources") or {}
    start = " ".join(cmd for _, cmd in _keyed(config, "head_start_ray_commands"))
    cpus_zero = resources.get("CPU") == 0 or (
        "CPU" not in resources and re.search(r"--num-cpus[= ]+0\b", start) is not None
    )
    if not cpus_zero:
        problems.append(
            Problem(
                f"{base}.resources.CPU" if "CPU" in resources else f"{base}.resources",
                "the head offers CPUs to training; set resources.CPU: 0 (it hosts job drivers "
                "and controllers, which need none)",
            )
        )
    if resources.get("GPU", 0) != 0:
        problems.append(
            Problem(
                f"{base}.resources.GPU",
                "the head offers GPUs to training; use a CPU instance for the head and set resources.GPU: 0",
            )
        )
    return problems


_SUPERVISED_HINT = (
    'sudo systemd-run --unit=elastic-watcher --collect --uid="$(id -u)" -p Restart=always -p RestartSec=2 '
    '-p StandardOutput=append:"$(readlink -f /tmp/ray/session_latest)/logs/elastic-watch-preemption.log" '
    f"/bin/bash -c 'source ~/.elastic-env && exec {WATCHER_COMMAND} --provider CLOUD'"
)


def _check_watcher(commands: list[tuple[str, str]], base: str, cloud: str) -> list[Problem]:
    hint = _SUPERVISED_HINT.replace("CLOUD", cloud)
    started = [
        (key, cmd, match)
        for key, cmd in commands
        for match in WATCHER.finditer(cmd)
        if "--drain-now" not in match.group("args")  # a shutdown unit's drain, not the watcher itself
    ]
    if not started:
        return [
            Problem(
                base,
                f"spot nodes of this type do not start the preemption watcher; add `{hint}` to "
                "worker_start_ray_commands (after `ray start`)",
            )
        ]
    problems = []
    for key, cmd, match in started:
        provider = re.search(r"--provider[= ]+(\S+)", match.group("args"))
        if provider and provider.group(1).strip("'\"") not in (cloud, "auto"):
            problems.append(
                Problem(
                    key,
                    f"the watcher is started with --provider {provider.group(1)} on this "
                    f"{cloud} cluster; use --provider {cloud}",
                )
            )
        # Supervised: a systemd unit that restarts it (nohup in the setup's SSH session is never restarted, and
        # is killed with the session's scope when the VM shuts down).
        launcher = cmd[: match.start()]
        if "systemd-run" not in launcher:
            why = (
                "runs in the foreground and would block node setup"
                if not _BACKGROUND.search(cmd[match.start() :])
                else "is not supervised: nothing restarts it when it exits"
            )
            problems.append(Problem(key, f"the watcher {why}; start it as a systemd unit: `{hint}`"))
        elif not re.search(r"Restart=(always|on-failure)", launcher):
            problems.append(
                Problem(key, "the watcher's systemd unit is never restarted; add -p Restart=always -p RestartSec=2")
            )
    return problems


def _check_token_auth(config: dict, commands: dict[str, list[tuple[str, str]]]) -> list[Problem]:
    problems = []
    modes = {
        name: [(key, value) for key, cmd in cmds for var, value in env_assignments(cmd) if var == "RAY_AUTH_MODE"]
        for name, cmds in commands.items()
    }
    fix = "export RAY_AUTH_MODE=token in setup_commands (every node) before `ray start`"
    if not any(modes.values()):
        problems.append(Problem("setup_commands", f"Ray token authentication is off on every node; {fix}"))
    for name, found in modes.items():
        if not found and any(modes.values()):
            problems.append(
                Problem(f"available_node_types.{name}", f"Ray token authentication is off on these nodes; {fix}")
            )
        for key, value in found:
            if value != "token":
                problems.append(
                    Problem(key, f"RAY_AUTH_MODE={value} turns Ray token authentication off; use RAY_AUTH_MODE=token")
                )
    mounts = config.get("file_mounts") or {}
    if not any(str(remote).rstrip("/").endswith(".ray/auth_token") for remote in mounts) and not any(
        var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
        for cmds in commands.values()
        for _, cmd in cmds
        for var, _ in env_assignments(cmd)
    ):
        problems.append(
            Problem(
                "file_mounts",
                "no Ray auth token reaches the nodes; add file_mounts: "
                "{'~/.ray/auth_token': '~/.ray/auth_token'} (create it first with "
                "`ray get-auth-token --generate`)",
            )
        )
    return problems


def _check_dashboard(config: dict) -> list[Problem]:
    problems = []
    for key, cmd in _keyed(config, "head_start_ray_commands"):
        host = re.search(r"--dashboard-host[= ]+['\"]?([^\s'\";]+)", cmd)
        if host and host.group(1) in ("0.0.0.0", "::", "[::]"):
            problems.append(
                Problem(
                    key,
                    f"--dashboard-host={host.group(1)} serves the dashboard and job API on "
                    "every interface; use --dashboard-host=127.0.0.1 and reach it with "
                    "`ray dashboard CONFIG` (an SSH tunnel)",
                )
            )
    return problems


def _check_storage(commands: dict[str, list[tuple[str, str]]]) -> list[Problem]:
    problems, seen = [], set()
    for cmds in commands.values():
        for key, cmd in cmds:
            for var, value in env_assignments(cmd):
                if STORAGE_ENV.match(var) and (key, var) not in seen:
                    seen.add((key, var))
                    problems += storage_problem(key, var, value)
    return problems


def _check_package_pin(commands: dict[str, list[tuple[str, str]]]) -> list[Problem]:
    """Nodes must run the elastic-train (and so the Ray) version of the laptop that submits to them."""
    try:
        local = version("elastic-train")
    except PackageNotFoundError:  # running from a source tree without an install: nothing to compare with
        local = None
    problems, seen = [], set()
    for cmds in commands.values():
        for key, cmd in cmds:
            for match in re.finditer(r"\belastic-train(?![\w-])(\S*)", cmd):
                if key in seen:
                    continue
                seen.add(key)
                spec = match.group(1).strip("'\"")
                pinned = re.fullmatch(r"==([\w.+!-]+)", spec)
                if not pinned:
                    problems.append(
                        Problem(
                            key,
                            f"installs elastic-train{spec} unpinned; pin the version you run "
                            f"here: elastic-train=={local or 'X.Y.Z'}",
                        )
                    )
                elif local and pinned.group(1) != local:
                    problems.append(
                        Problem(
                            key,
                            f"installs elastic-train=={pinned.group(1)} but this elastic is "
                            f"{local}; the nodes and the submitting machine must run the same "
                            f"version: elastic-train=={local}",
                        )
                    )
    return problems


def _check_elastic_install(config: dict, commands: dict[str, list[tuple[str, str]]]) -> list[Problem]:
    """Every node installs elastic: a published release (pinned, above) or a source tree file_mounts ships."""
    mounts = {_home_path(str(remote)) for remote in config.get("file_mounts") or {}}
    problems, seen = [], set()
    for name, cmds in commands.items():
        installs_elastic = False
        for key, cmd in cmds:
            for match in _PIP_INSTALL.finditer(cmd):
                for arg in match.group("args").split():
                    arg = arg.strip("'\"")
                    if "elastic-train" in arg:
                        installs_elastic = True
                    if not re.match(r"^(~|\$HOME|\$\{HOME\}|/)", arg):
                        continue
                    tree = _home_path(re.sub(r"\[[^\]]*\]$", "", arg))
                    installs_elastic = True  # a source tree; whether it reaches the nodes is checked here
                    if f"{tree}/pyproject.toml" in mounts or (key, tree) in seen:
                        continue
                    seen.add((key, tree))
                    shipped = any(m == tree or m.startswith(tree + "/") for m in mounts)
                    what = (
                        f"but file_mounts copy no {tree}/pyproject.toml"
                        if shipped
                        else "which no file_mounts entry copies to the nodes"
                    )
                    problems.append(
                        Problem(
                            key,
                            f"installs {tree}, {what}; add file_mounts {{'{tree}/pyproject.toml': 'pyproject.toml', "
                            f"'{tree}/README.md': 'README.md', '{tree}/elastic': 'elastic'}} and run `ray up` from "
                            "the repository root",
                        )
                    )
        if not installs_elastic:
            problems.append(
                Problem(
                    f"available_node_types.{name}",
                    "no setup command installs elastic on these nodes; ship this checkout with file_mounts "
                    '(~/elastic-src/pyproject.toml, README.md, elastic/) and `pip install "$HOME/elastic-src"` in '
                    "setup_commands",
                )
            )
    return problems


def _home_path(path: str) -> str:
    """$HOME/x and ~/x name the same remote path; trailing slashes do not matter."""
    return _HOME.sub("~", path.strip()).rstrip("/")


def storage_problem(key: str, var: str, value: str) -> list[Problem]:
    scheme = value.split("://", 1)[0].lower() if "://" in value else ""
    if scheme in REMOTE_SCHEMES or value.startswith("$"):
        return []
    return [
        Problem(
            key,
            f"{var}={value or '(empty)'} is node-local storage: a reclaimed node takes its "
            "checkpoints with it; use an object store URI such as s3://BUCKET/runs or gs://BUCKET/runs",
        )
    ]
