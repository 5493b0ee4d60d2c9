"""Our rules for `ray up` cluster configs (AWS, GCP): what this project relies on and Ray does not check (spot and
on-demand worker types labeled as jobs select them, an on-demand head that offers nothing to training, the
preemption watcher on spot types, token auth, closed ports, checkpoints in an object store, cloud spot fields)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from elastic.clusterconfig.problems import Problem, env_assignments, suggest
from elastic.placement.labels import HEAD_ROLE, MARKET_LABEL, MARKETS, ROLE_LABEL, WORKER_ROLE

WATCHER_COMMAND = "elastic watch-preemption"
REMOTE_SCHEMES = ("s3", "s3a", "gs", "gcs", "abfs", "abfss", "az")
AWS_MARKET_TYPES = ("spot", "capacity-block")
AWS_SPOT_OPTIONS = (
    "MaxPrice",
    "SpotInstanceType",
    "BlockDurationMinutes",
    "ValidUntil",
    "InstanceInterruptionBehavior",
)
GCP_PROVISIONING_MODELS = ("SPOT", "STANDARD")
GCP_TERMINATION_ACTIONS = ("STOP", "DELETE")
_WORLD = ("0.0.0.0/0", "::/0")
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
        problems += _check_cloud_node_config(cloud, base, node_config)
        cloud_market = _cloud_market(cloud, node_config)
        labels = node_type.get("labels") or {}
        problems += check_labels(f"{base}.labels", labels, head=name == head)
        label_market = labels.get(MARKET_LABEL)
        if label_market in MARKETS and cloud_market is not None and cloud_market != label_market:
            problems.append(
                Problem(
                    f"{base}.labels.{MARKET_LABEL}",
                    f"labeled '{label_market}' but {_market_source(cloud)} makes it {cloud_market}; "
                    f"label it '{cloud_market}' or change the node config",
                )
            )
        if name == head:
            problems += _check_head(config, base, node_type, cloud_market, cloud)
            continue
        if _gpus(cloud, node_type) > 0 and labels.get(ROLE_LABEL) == WORKER_ROLE:
            (spot_gpu if cloud_market == "spot" else on_demand_gpu).append(name)
        if cloud_market == "spot":
            problems += _check_watcher(commands[name], base, cloud)

    if not spot_gpu:
        problems.append(
            Problem(
                "available_node_types",
                f"no spot GPU worker type; add one with {_spot_hint(cloud)}, GPUs, and labels "
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
        problems += _check_aws_ingress(config.get("provider") or {})
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


# AWS ---------------------------------------------------------------------------------------------------


def _check_cloud_node_config(cloud: str, base: str, node_config: dict) -> list[Problem]:
    if cloud == "aws":
        return _check_aws_node_config(f"{base}.node_config", node_config)
    if cloud == "gcp":
        return _check_gcp_node_config(f"{base}.node_config", node_config)
    return []


def _check_aws_node_config(key: str, node_config: dict) -> list[Problem]:
    problems = []
    options = node_config.get("InstanceMarketOptions")
    if options is None:
        pass
    elif not isinstance(options, dict):
        problems.append(Problem(f"{key}.InstanceMarketOptions", "must be a mapping: {MarketType: spot}"))
    else:
        for field in options:
            if field not in ("MarketType", "SpotOptions"):
                problems.append(
                    Problem(
                        f"{key}.InstanceMarketOptions.{field}",
                        f"unknown field{suggest(field, ('MarketType', 'SpotOptions'))}; "
                        "InstanceMarketOptions takes MarketType and SpotOptions",
                    )
                )
        market = options.get("MarketType")
        if market not in AWS_MARKET_TYPES:
            problems.append(
                Problem(
                    f"{key}.InstanceMarketOptions.MarketType",
                    f"{market!r} is not a market type; use 'spot'"
                    if market is not None
                    else "missing; use MarketType: spot",
                )
            )
        spot = options.get("SpotOptions")
        if spot is not None:
            problems += _check_spot_options(f"{key}.InstanceMarketOptions.SpotOptions", spot)
    profile = node_config.get("IamInstanceProfile")
    if profile is not None and not (isinstance(profile, dict) and ("Arn" in profile or "Name" in profile)):
        problems.append(Problem(f"{key}.IamInstanceProfile", "must be {Name: PROFILE} or {Arn: ARN}"))
    return problems


def _check_spot_options(key: str, spot: Any) -> list[Problem]:
    if not isinstance(spot, dict):
        return [Problem(key, "must be a mapping, e.g. {MaxPrice: '1.20'}")]
    problems = []
    for field in spot:
        if field not in AWS_SPOT_OPTIONS:
            problems.append(
                Problem(
                    f"{key}.{field}",
                    f"unknown SpotOptions field{suggest(field, AWS_SPOT_OPTIONS)};"
                    f" valid: {', '.join(AWS_SPOT_OPTIONS)}",
                )
            )
    if "MaxPrice" in spot:
        price = spot["MaxPrice"]
        if not isinstance(price, str):
            problems.append(
                Problem(
                    f"{key}.MaxPrice",
                    f"{price!r} must be a quoted string (EC2 takes the price as text), e.g. MaxPrice: '{price}'",
                )
            )
        elif not re.fullmatch(r"\d+(\.\d+)?", price) or float(price) <= 0:
            problems.append(
                Problem(
                    f"{key}.MaxPrice", f"{price!r} is not a price; use USD per hour as a numeric string such as '1.20'"
                )
            )
    kind = spot.get("SpotInstanceType")
    if kind is not None and kind != "one-time":
        problems.append(
            Problem(
                f"{key}.SpotInstanceType",
                f"{kind!r}: Ray's autoscaler replaces reclaimed nodes itself, a persistent request "
                "would relaunch instances Ray no longer tracks; use 'one-time'",
            )
        )
    behavior = spot.get("InstanceInterruptionBehavior")
    if behavior is not None and behavior != "terminate":
        problems.append(
            Problem(
                f"{key}.InstanceInterruptionBehavior",
                f"{behavior!r} keeps reclaimed instances (and their EBS cost) around; use 'terminate'",
            )
        )
    return problems


def _check_aws_ingress(provider: dict) -> list[Problem]:
    problems = []
    rules = (provider.get("security_group") or {}).get("IpPermissions") or []
    for i, rule in enumerate(rules):
        if not isinstance(rule, dict):
            continue
        cidrs = [r.get("CidrIp") for r in rule.get("IpRanges") or [] if isinstance(r, dict)]
        cidrs += [r.get("CidrIpv6") for r in rule.get("Ipv6Ranges") or [] if isinstance(r, dict)]
        world = [c for c in cidrs if c in _WORLD]
        if not world:
            continue
        low, high = rule.get("FromPort"), rule.get("ToPort")
        if str(rule.get("IpProtocol")) == "tcp" and low == 22 and high == 22:
            continue  # SSH: Ray's own security group already allows it; nodes accept keys only
        ports = (
            "all ports"
            if str(rule.get("IpProtocol")) == "-1" or low in (None, -1)
            else (f"port {low}" if low == high else f"ports {low}-{high}")
        )
        problems.append(
            Problem(
                f"provider.security_group.IpPermissions[{i}]",
                f"opens {ports} to the world ({world[0]}); remove the rule and reach the dashboard "
                "and job API with `ray dashboard CONFIG` (an SSH tunnel), or restrict it to your "
                "network's CIDR",
            )
        )
    return problems


# GCP ---------------------------------------------------------------------------------------------------


def _check_gcp_node_config(key: str, node_config: dict) -> list[Problem]:
    problems = []
    scheduling = node_config.get("scheduling")
    accelerators = node_config.get("guestAccelerators") or []
    if scheduling is not None and not isinstance(scheduling, dict):
        return [
            Problem(
                f"{key}.scheduling",
                "must be a mapping (the Compute API's Scheduling object), e.g. "
                "{provisioningModel: SPOT, onHostMaintenance: TERMINATE}",
            )
        ]
    scheduling = scheduling or {}
    model = scheduling.get("provisioningModel")
    if model is not None and model not in GCP_PROVISIONING_MODELS:
        fix = str(model).upper() if str(model).upper() in GCP_PROVISIONING_MODELS else "SPOT or STANDARD"
        problems.append(
            Problem(f"{key}.scheduling.provisioningModel", f"{model!r} is not a provisioning model; use {fix}")
        )
    preemptible = scheduling.get("preemptible")
    if preemptible is not None and not isinstance(preemptible, bool):
        problems.append(Problem(f"{key}.scheduling.preemptible", f"{preemptible!r} must be true or false (unquoted)"))
    elif model == "SPOT" and preemptible is False:
        problems.append(
            Problem(
                f"{key}.scheduling.preemptible",
                "false contradicts provisioningModel: SPOT; set preemptible: true or remove it",
            )
        )
    action = scheduling.get("instanceTerminationAction")
    if action is not None:
        if action not in GCP_TERMINATION_ACTIONS:
            problems.append(
                Problem(
                    f"{key}.scheduling.instanceTerminationAction", f"{action!r} is not a termination action; use DELETE"
                )
            )
        elif action == "STOP":
            problems.append(
                Problem(
                    f"{key}.scheduling.instanceTerminationAction",
                    "STOP keeps reclaimed VMs (and their disks' cost) that Ray no longer uses; use DELETE",
                )
            )
    if _gcp_is_spot(node_config) and scheduling.get("automaticRestart") is True:
        problems.append(
            Problem(
                f"{key}.scheduling.automaticRestart",
                "spot VMs cannot restart automatically; set automaticRestart: false",
            )
        )
    if accelerators and scheduling.get("onHostMaintenance") != "TERMINATE":
        problems.append(
            Problem(
                f"{key}.scheduling.onHostMaintenance",
                "VMs with GPUs cannot live-migrate; set scheduling.onHostMaintenance: TERMINATE",
            )
        )
    for i, accel in enumerate(accelerators if isinstance(accelerators, list) else []):
        if not isinstance(accel, dict) or not accel.get("acceleratorType") or not accel.get("acceleratorCount"):
            problems.append(
                Problem(
                    f"{key}.guestAccelerators[{i}]",
                    "needs acceleratorType and acceleratorCount, e.g. "
                    "{acceleratorType: nvidia-l4, acceleratorCount: 1}",
                )
            )
    return problems


def _gcp_is_spot(node_config: dict) -> bool:
    scheduling = node_config.get("scheduling")
    if not isinstance(scheduling, dict):
        return False
    return scheduling.get("provisioningModel") == "SPOT" or scheduling.get("preemptible") is True


def _cloud_market(cloud: str, node_config: dict) -> str | None:
    """'spot' or 'on-demand' as the node config asks the cloud for; None when that field is itself invalid."""
    if cloud == "aws":
        options = node_config.get("InstanceMarketOptions")
        if options is None:
            return "on-demand"
        if not isinstance(options, dict) or options.get("MarketType") not in AWS_MARKET_TYPES:
            return None
        return "spot" if options["MarketType"] == "spot" else "on-demand"
    if cloud == "gcp":
        scheduling = node_config.get("scheduling", {})
        if (
            not isinstance(scheduling, dict)
            or scheduling.get("provisioningModel", "SPOT") not in GCP_PROVISIONING_MODELS
            or not isinstance(scheduling.get("preemptible", False), bool)
        ):
            return None
        return "spot" if _gcp_is_spot(node_config) else "on-demand"
    return "on-demand"


def _market_source(cloud: str) -> str:
    return "InstanceMarketOptions" if cloud == "aws" else "scheduling"


def _spot_hint(cloud: str) -> str:
    return (
        "node_config.InstanceMarketOptions: {MarketType: spot}"
        if cloud == "aws"
        else "node_config.scheduling: {provisioningModel: SPOT}"
    )


def _gpus(cloud: str, node_type: dict) -> float:
    resources = node_type.get("resources") or {}
    if "GPU" in resources:
        return float(resources["GPU"] or 0)
    node_config = node_type.get("node_config") or {}
    if cloud == "aws":  # Ray detects GPUs from the instance type when resources omit them
        family = str(node_config.get("InstanceType", "")).split(".")[0]
        return 1.0 if re.match(r"^(p|g)\d", family) else 0.0
    if cloud == "gcp":
        accelerators = node_config.get("guestAccelerators") or []
        return float(sum(a.get("acceleratorCount", 0) for a in accelerators if isinstance(a, dict)))
    return 0.0
