"""Checks of cluster configs (`ray up` YAMLs for AWS and GCP, KubeRay RayCluster manifests) before they cost money.

Every check is a pure function from a loaded config to a list of `Problem`s, each naming the key and the fix.
For `ray up` files Ray's own schema check runs first (on the config as `ray up` prepares it); ours then cover
what this project relies on and what Ray does not check:

- a spot and an on-demand GPU worker type exist, labeled as jobs select them (labels.py);
- the head is on-demand, labeled elastic-role=head, and offers no CPUs or GPUs to training;
- spot types start `elastic watch-preemption` in the background;
- Ray token authentication is on for every node, the token reaches the nodes, the dashboard is not bound to all
  interfaces and no port but SSH is opened to the world;
- checkpoint storage named in the nodes' environment is an object store, not a node's disk;
- cloud fields Ray passes through unchecked: AWS `InstanceMarketOptions` (Ray accepts `MarketType: spott`),
  GCP `scheduling`, and for KubeRay the RayCluster schema, spot node selectors and tolerations, grace periods
  and autoscaling.

The policy on open ports: SSH (22) from anywhere is allowed because Ray's AWS bootstrap always adds it to the
security group it creates and nodes accept keys only; any other port open to 0.0.0.0/0 or ::/0 is a problem.
"""

from __future__ import annotations

import copy
import difflib
import logging
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from elastic.errors import UserError
from elastic.placement.labels import HEAD_ROLE, MARKET_LABEL, MARKETS, ROLE_LABEL, WORKER_ROLE

WATCHER_COMMAND = "elastic watch-preemption"
# The longest spot notice among the clouds (AWS: 2 minutes); Ray drains a node within it. Pods of a KubeRay
# worker group must be allowed to outlive it, so the drain and the just-in-time checkpoint finish.
DRAIN_DEADLINE_S = 120
REMOTE_SCHEMES = ("s3", "s3a", "gs", "gcs", "abfs", "abfss", "az")
AWS_MARKET_TYPES = ("spot", "capacity-block")
AWS_SPOT_OPTIONS = ("MaxPrice", "SpotInstanceType", "BlockDurationMinutes", "ValidUntil",
                    "InstanceInterruptionBehavior")
GCP_PROVISIONING_MODELS = ("SPOT", "STANDARD")
GCP_TERMINATION_ACTIONS = ("STOP", "DELETE")
# Node selectors that put a pod on spot capacity, by platform; the value selects spot.
K8S_SPOT_SELECTORS = {
    "cloud.google.com/gke-spot": "true",
    "cloud.google.com/gke-preemptible": "true",
    "eks.amazonaws.com/capacityType": "SPOT",
    "karpenter.sh/capacity-type": "spot",
    "kubernetes.azure.com/scalesetpriority": "spot",
}
_WORLD = ("0.0.0.0/0", "::/0")
_ENV_ASSIGNMENT = re.compile(r"(?<![\w$.-])([A-Z][A-Z0-9_]*)=(\"[^\"]*\"|'[^']*'|[^\s;&|'\"]*)")
_STORAGE_ENV = re.compile(r"^(ELASTIC_[A-Z0-9_]*URI|[A-Z0-9_]*CHECKPOINT[A-Z0-9_]*(URI|PATH|DIR))$")
_BACKGROUND = re.compile(r"(?<![&<>])&(?![&>])")
_WATCHER = re.compile(r"elastic\s+watch-preemption(?P<args>[^;&|\n]*)")


class ClusterConfigError(UserError):
    """A cluster config cannot be read at all (missing file, not YAML, not a mapping)."""


@dataclass(frozen=True)
class Problem:
    key: str  # dotted path into the file, e.g. available_node_types.gpu_spot.node_config.InstanceType
    message: str  # what is wrong and the fix, one line

    def to_json(self) -> dict[str, str]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------------------
# entry points


def load_config(path: str | Path) -> dict:
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ClusterConfigError(f"{path}: cannot read it ({err.strerror or err})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ClusterConfigError(f"{path}{where}: not valid YAML ({getattr(err, 'problem', None) or err})") from None
    if not isinstance(data, dict):
        raise ClusterConfigError(f"{path}: expected a `ray up` config or a RayCluster manifest (a mapping)")
    return data


def config_kind(config: dict) -> str:
    """'kuberay' for a RayCluster manifest, else the `ray up` provider type ('aws', 'gcp', ...)."""
    if config.get("kind") == "RayCluster" or str(config.get("apiVersion", "")).startswith("ray.io/"):
        return "kuberay"
    provider = config.get("provider")
    if isinstance(provider, dict) and isinstance(provider.get("type"), str):
        return provider["type"]
    return "unknown"


def validate_file(path: str | Path) -> tuple[str, list[Problem]]:
    config = load_config(path)
    return config_kind(config), validate(config)


def validate(config: dict) -> list[Problem]:
    kind = config_kind(config)
    if kind == "kuberay":
        return _unique(check_kuberay(config))
    if kind == "unknown":
        return [Problem("provider.type", "no provider.type and not a RayCluster manifest; this command checks "
                                         "`ray up` configs (provider.type: aws or gcp) and KubeRay RayClusters")]
    problems = ray_schema_problems(config)
    if problems:  # our checks assume the shape Ray's schema guarantees
        return problems
    if kind not in ("aws", "gcp"):
        return [Problem("provider.type", f"'{kind}' clusters are not covered by these checks; "
                                         "use provider.type aws or gcp, or a KubeRay RayCluster")]
    from ray.autoscaler._private.util import fillout_defaults

    # Check what `ray up` will run: omitted top-level keys come from Ray's defaults for the provider.
    full = fillout_defaults(copy.deepcopy(config))
    return _unique(check_ray_up(full, kind))


# ---------------------------------------------------------------------------------------------------------
# Ray's own schema


def ray_schema_problems(config: dict) -> list[Problem]:
    """Ray's schema check, on the config as `ray up` prepares it (the raw YAML lacks fields Ray fills in)."""
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    quiet = logging.getLogger("ray.autoscaler._private.util")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # prepare_config logs routine INFO lines ("setting max workers ...")
    try:
        validate_config(prepare_config(copy.deepcopy(config)))
    except jsonschema.ValidationError as err:
        return [Problem(_path(err.absolute_path) or "(top level)", f"{_one_line(err.message)} (Ray's schema)")]
    except Exception as err:  # Ray raises ValueError, KeyError, NotImplementedError...: report, don't crash
        return [Problem("(config)", f"{_one_line(str(err)) or type(err).__name__} (Ray's config check)")]
    finally:
        quiet.setLevel(level)
    return []


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
        problems += _check_labels(f"{base}.labels", labels, head=name == head)
        label_market = labels.get(MARKET_LABEL)
        if label_market in MARKETS and cloud_market is not None and cloud_market != label_market:
            problems.append(Problem(f"{base}.labels.{MARKET_LABEL}",
                                    f"labeled '{label_market}' but {_market_source(cloud)} makes it {cloud_market}; "
                                    f"label it '{cloud_market}' or change the node config"))
        if name == head:
            problems += _check_head(config, base, node_type, cloud_market, cloud)
            continue
        if _gpus(cloud, node_type) > 0 and labels.get(ROLE_LABEL) == WORKER_ROLE:
            (spot_gpu if cloud_market == "spot" else on_demand_gpu).append(name)
        if cloud_market == "spot":
            problems += _check_watcher(commands[name], base, cloud)

    if not spot_gpu:
        problems.append(Problem("available_node_types",
                                f"no spot GPU worker type; add one with {_spot_hint(cloud)}, GPUs, and labels "
                                f"{{{MARKET_LABEL}: spot, {ROLE_LABEL}: {WORKER_ROLE}}}"))
    if not on_demand_gpu:
        problems.append(Problem("available_node_types",
                                "no on-demand GPU worker type (the fallback when spot capacity is short); add one "
                                f"with GPUs and labels {{{MARKET_LABEL}: on-demand, {ROLE_LABEL}: {WORKER_ROLE}}}"))
    problems += _check_token_auth(config, commands)
    problems += _check_dashboard(config)
    problems += _check_storage(commands)
    problems += _check_package_pin(commands)
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


def _check_labels(key: str, labels: Any, head: bool) -> list[Problem]:
    if not isinstance(labels, dict):
        return [Problem(key, "labels must be a mapping of Ray node labels")]
    problems = []
    want_role = HEAD_ROLE if head else WORKER_ROLE
    role = labels.get(ROLE_LABEL)
    if role != want_role:
        why = ("drivers and controllers select the head by it" if head
               else f"training workers select {ROLE_LABEL}={WORKER_ROLE}")
        problems.append(Problem(f"{key}.{ROLE_LABEL}" if role is not None else key,
                                f"{'missing ' + ROLE_LABEL + ' label' if role is None else repr(role) + ' is the wrong role'}"
                                f" ({why}); set labels.{ROLE_LABEL}: {want_role}"))
    market = labels.get(MARKET_LABEL)
    if market is None:
        problems.append(Problem(key, f"missing {MARKET_LABEL} label; jobs select nodes by it: set labels."
                                     f"{MARKET_LABEL}: spot or on-demand"))
    elif market not in MARKETS:
        problems.append(Problem(f"{key}.{MARKET_LABEL}",
                                f"{market!r} is not a market jobs request{_suggest(market, MARKETS)}; "
                                f"use one of {', '.join(MARKETS)}"))
    return problems


def _check_head(config: dict, base: str, node_type: dict, market: str, cloud: str) -> list[Problem]:
    problems = []
    if market == "spot":
        fix = "remove InstanceMarketOptions" if cloud == "aws" else "use scheduling.provisioningModel: STANDARD"
        problems.append(Problem(f"{base}.node_config", "the head is on spot: a reclaim ends every driver, the "
                                                       f"autoscaler and the job API; {fix} on the head"))
    resources = node_type.get("resources") or {}
    start = " ".join(cmd for _, cmd in _keyed(config, "head_start_ray_commands"))
    cpus_zero = resources.get("CPU") == 0 or (
        "CPU" not in resources and re.search(r"--num-cpus[= ]+0\b", start) is not None)
    if not cpus_zero:
        problems.append(Problem(f"{base}.resources.CPU" if "CPU" in resources else f"{base}.resources",
                                "the head offers CPUs to training; set resources.CPU: 0 (it hosts job drivers "
                                "and controllers, which need none)"))
    if resources.get("GPU", 0) != 0:
        problems.append(Problem(f"{base}.resources.GPU", "the head offers GPUs to training; use a CPU instance "
                                                         "for the head and set resources.GPU: 0"))
    return problems


def _check_watcher(commands: list[tuple[str, str]], base: str, cloud: str) -> list[Problem]:
    started = [(key, cmd, match) for key, cmd in commands for match in [_WATCHER.search(cmd)] if match]
    if not started:
        return [Problem(base, f"spot nodes of this type do not start the preemption watcher; add "
                              f"`nohup {WATCHER_COMMAND} --provider {cloud} >/tmp/ray/elastic-watcher.log 2>&1 &` "
                              "to worker_start_ray_commands (after `ray start`)")]
    problems = []
    for key, cmd, match in started:
        provider = re.search(r"--provider[= ]+(\S+)", match.group("args"))
        if provider and provider.group(1).strip("'\"") not in (cloud, "auto"):
            problems.append(Problem(key, f"the watcher is started with --provider {provider.group(1)} on this "
                                         f"{cloud} cluster; use --provider {cloud}"))
        if not _BACKGROUND.search(cmd[match.start():]):
            problems.append(Problem(key, "the watcher runs in the foreground and would block node setup; "
                                         f"start it with `nohup {WATCHER_COMMAND} ... &`"))
    return problems


def _check_token_auth(config: dict, commands: dict[str, list[tuple[str, str]]]) -> list[Problem]:
    problems = []
    modes = {name: [(key, value) for key, cmd in cmds for var, value in _env_assignments(cmd)
                    if var == "RAY_AUTH_MODE"] for name, cmds in commands.items()}
    fix = "export RAY_AUTH_MODE=token in setup_commands (every node) before `ray start`"
    if not any(modes.values()):
        problems.append(Problem("setup_commands", f"Ray token authentication is off on every node; {fix}"))
    for name, found in modes.items():
        if not found and any(modes.values()):
            problems.append(Problem(f"available_node_types.{name}",
                                    f"Ray token authentication is off on these nodes; {fix}"))
        for key, value in found:
            if value != "token":
                problems.append(Problem(key, f"RAY_AUTH_MODE={value} turns Ray token authentication off; "
                                             "use RAY_AUTH_MODE=token"))
    mounts = config.get("file_mounts") or {}
    if not any(str(remote).rstrip("/").endswith(".ray/auth_token") for remote in mounts) and not any(
            var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
            for cmds in commands.values() for _, cmd in cmds for var, _ in _env_assignments(cmd)):
        problems.append(Problem("file_mounts", "no Ray auth token reaches the nodes; add file_mounts: "
                                               "{'~/.ray/auth_token': '~/.ray/auth_token'} (create it first with "
                                               "`ray get-auth-token --generate`)"))
    return problems


def _check_dashboard(config: dict) -> list[Problem]:
    problems = []
    for key, cmd in _keyed(config, "head_start_ray_commands"):
        host = re.search(r"--dashboard-host[= ]+['\"]?([^\s'\";]+)", cmd)
        if host and host.group(1) in ("0.0.0.0", "::", "[::]"):
            problems.append(Problem(key, f"--dashboard-host={host.group(1)} serves the dashboard and job API on "
                                         "every interface; use --dashboard-host=127.0.0.1 and reach it with "
                                         "`ray dashboard CONFIG` (an SSH tunnel)"))
    return problems


def _check_storage(commands: dict[str, list[tuple[str, str]]]) -> list[Problem]:
    problems, seen = [], set()
    for cmds in commands.values():
        for key, cmd in cmds:
            for var, value in _env_assignments(cmd):
                if _STORAGE_ENV.match(var) and (key, var) not in seen:
                    seen.add((key, var))
                    problems += _storage_problem(key, var, value)
    return problems


def _check_package_pin(commands: dict[str, list[tuple[str, str]]]) -> list[Problem]:
    """Nodes must run the elastic-train (and so the Ray) version of the laptop that submits to them."""
    from importlib.metadata import PackageNotFoundError, version

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
                    problems.append(Problem(key, f"installs elastic-train{spec} unpinned; pin the version you run "
                                                 f"here: elastic-train=={local or 'X.Y.Z'}"))
                elif local and pinned.group(1) != local:
                    problems.append(Problem(key, f"installs elastic-train=={pinned.group(1)} but this elastic is "
                                                 f"{local}; the nodes and the submitting machine must run the same "
                                                 f"version: elastic-train=={local}"))
    return problems


def _storage_problem(key: str, var: str, value: str) -> list[Problem]:
    scheme = value.split("://", 1)[0].lower() if "://" in value else ""
    if scheme in REMOTE_SCHEMES or value.startswith("$"):
        return []
    return [Problem(key, f"{var}={value or '(empty)'} is node-local storage: a reclaimed node takes its "
                         "checkpoints with it; use an object store URI such as s3://BUCKET/runs or gs://BUCKET/runs")]


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
                problems.append(Problem(f"{key}.InstanceMarketOptions.{field}",
                                        f"unknown field{_suggest(field, ('MarketType', 'SpotOptions'))}; "
                                        "InstanceMarketOptions takes MarketType and SpotOptions"))
        market = options.get("MarketType")
        if market not in AWS_MARKET_TYPES:
            problems.append(Problem(f"{key}.InstanceMarketOptions.MarketType",
                                    f"{market!r} is not a market type; use 'spot'"
                                    if market is not None else "missing; use MarketType: spot"))
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
            problems.append(Problem(f"{key}.{field}", f"unknown SpotOptions field{_suggest(field, AWS_SPOT_OPTIONS)};"
                                                      f" valid: {', '.join(AWS_SPOT_OPTIONS)}"))
    if "MaxPrice" in spot:
        price = spot["MaxPrice"]
        if not isinstance(price, str):
            problems.append(Problem(f"{key}.MaxPrice", f"{price!r} must be a quoted string (EC2 takes the price "
                                                       f"as text), e.g. MaxPrice: '{price}'"))
        elif not re.fullmatch(r"\d+(\.\d+)?", price) or float(price) <= 0:
            problems.append(Problem(f"{key}.MaxPrice", f"{price!r} is not a price; use USD per hour as a "
                                                       "numeric string such as '1.20'"))
    kind = spot.get("SpotInstanceType")
    if kind is not None and kind != "one-time":
        problems.append(Problem(f"{key}.SpotInstanceType",
                                f"{kind!r}: Ray's autoscaler replaces reclaimed nodes itself, a persistent request "
                                "would relaunch instances Ray no longer tracks; use 'one-time'"))
    behavior = spot.get("InstanceInterruptionBehavior")
    if behavior is not None and behavior != "terminate":
        problems.append(Problem(f"{key}.InstanceInterruptionBehavior",
                                f"{behavior!r} keeps reclaimed instances (and their EBS cost) around; "
                                "use 'terminate'"))
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
        ports = "all ports" if str(rule.get("IpProtocol")) == "-1" or low in (None, -1) else (
            f"port {low}" if low == high else f"ports {low}-{high}")
        problems.append(Problem(f"provider.security_group.IpPermissions[{i}]",
                                f"opens {ports} to the world ({world[0]}); remove the rule and reach the dashboard "
                                "and job API with `ray dashboard CONFIG` (an SSH tunnel), or restrict it to your "
                                "network's CIDR"))
    return problems


# GCP ---------------------------------------------------------------------------------------------------


def _check_gcp_node_config(key: str, node_config: dict) -> list[Problem]:
    problems = []
    scheduling = node_config.get("scheduling")
    accelerators = node_config.get("guestAccelerators") or []
    if scheduling is not None and not isinstance(scheduling, dict):
        return [Problem(f"{key}.scheduling", "must be a mapping (the Compute API's Scheduling object), e.g. "
                                             "{provisioningModel: SPOT, onHostMaintenance: TERMINATE}")]
    scheduling = scheduling or {}
    model = scheduling.get("provisioningModel")
    if model is not None and model not in GCP_PROVISIONING_MODELS:
        fix = str(model).upper() if str(model).upper() in GCP_PROVISIONING_MODELS else "SPOT or STANDARD"
        problems.append(Problem(f"{key}.scheduling.provisioningModel",
                                f"{model!r} is not a provisioning model; use {fix}"))
    preemptible = scheduling.get("preemptible")
    if preemptible is not None and not isinstance(preemptible, bool):
        problems.append(Problem(f"{key}.scheduling.preemptible", f"{preemptible!r} must be true or false "
                                                                 "(unquoted)"))
    elif model == "SPOT" and preemptible is False:
        problems.append(Problem(f"{key}.scheduling.preemptible", "false contradicts provisioningModel: SPOT; "
                                                                 "set preemptible: true or remove it"))
    action = scheduling.get("instanceTerminationAction")
    if action is not None:
        if action not in GCP_TERMINATION_ACTIONS:
            problems.append(Problem(f"{key}.scheduling.instanceTerminationAction",
                                    f"{action!r} is not a termination action; use DELETE"))
        elif action == "STOP":
            problems.append(Problem(f"{key}.scheduling.instanceTerminationAction",
                                    "STOP keeps reclaimed VMs (and their disks' cost) that Ray no longer uses; "
                                    "use DELETE"))
    if _gcp_is_spot(node_config) and scheduling.get("automaticRestart") is True:
        problems.append(Problem(f"{key}.scheduling.automaticRestart", "spot VMs cannot restart automatically; "
                                                                      "set automaticRestart: false"))
    if accelerators and scheduling.get("onHostMaintenance") != "TERMINATE":
        problems.append(Problem(f"{key}.scheduling.onHostMaintenance",
                                "VMs with GPUs cannot live-migrate; set scheduling.onHostMaintenance: TERMINATE"))
    for i, accel in enumerate(accelerators if isinstance(accelerators, list) else []):
        if not isinstance(accel, dict) or not accel.get("acceleratorType") or not accel.get("acceleratorCount"):
            problems.append(Problem(f"{key}.guestAccelerators[{i}]",
                                    "needs acceleratorType and acceleratorCount, e.g. "
                                    "{acceleratorType: nvidia-l4, acceleratorCount: 1}"))
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
        if not isinstance(scheduling, dict) or scheduling.get("provisioningModel", "SPOT") not in \
                GCP_PROVISIONING_MODELS or not isinstance(scheduling.get("preemptible", False), bool):
            return None
        return "spot" if _gcp_is_spot(node_config) else "on-demand"
    return "on-demand"


def _market_source(cloud: str) -> str:
    return "InstanceMarketOptions" if cloud == "aws" else "scheduling"


def _spot_hint(cloud: str) -> str:
    return ("node_config.InstanceMarketOptions: {MarketType: spot}" if cloud == "aws"
            else "node_config.scheduling: {provisioningModel: SPOT}")


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


# ---------------------------------------------------------------------------------------------------------
# KubeRay


def check_kuberay(manifest: dict) -> list[Problem]:
    import jsonschema

    from elastic.clusterconfig.kuberay_schema import RAYCLUSTER_SCHEMA

    validator = jsonschema.Draft7Validator(RAYCLUSTER_SCHEMA)
    errors = sorted(validator.iter_errors(manifest), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        return [Problem(_path(e.absolute_path) or "(top level)", f"{_one_line(e.message)} (RayCluster schema)")
                for e in errors]
    spec = manifest["spec"]
    problems: list[Problem] = []
    if spec.get("enableInTreeAutoscaling") is not True:
        problems.append(Problem("spec.enableInTreeAutoscaling", "autoscaling is off: reclaimed spot pods are not "
                                                                "replaced; set enableInTreeAutoscaling: true"))
    head = spec["headGroupSpec"]
    problems += _check_k8s_group("spec.headGroupSpec", head, is_head=True)
    if head.get("serviceType") in ("NodePort", "LoadBalancer") or head.get("enableIngress") is True:
        what = "enableIngress: true" if head.get("enableIngress") is True else f"serviceType: {head['serviceType']}"
        problems.append(Problem("spec.headGroupSpec", f"{what} exposes the dashboard and job API outside the "
                                                      "cluster; use serviceType: ClusterIP and `kubectl "
                                                      "port-forward svc/CLUSTER-head-svc 8265`"))
    params = head.get("rayStartParams") or {}
    resources = head.get("resources") or {}
    if str(resources.get("CPU", params.get("num-cpus"))) != "0":
        problems.append(Problem("spec.headGroupSpec.rayStartParams", "the head offers CPUs to training; set "
                                                                     "rayStartParams num-cpus: \"0\""))
    spot, on_demand = [], []
    for i, group in enumerate(spec.get("workerGroupSpecs") or []):
        key = f"spec.workerGroupSpecs[{i}]"
        problems += _check_k8s_group(key, group, is_head=False)
        selected = _k8s_market(group)
        if (group.get("labels") or {}).get(ROLE_LABEL) == WORKER_ROLE and _k8s_gpus(group) > 0:
            (spot if selected == "spot" else on_demand).append(group["groupName"])
        pod = group["template"]["spec"]
        grace = pod.get("terminationGracePeriodSeconds", 30)
        if grace <= DRAIN_DEADLINE_S:
            problems.append(Problem(f"{key}.template.spec.terminationGracePeriodSeconds",
                                    f"{grace} s does not outlive the {DRAIN_DEADLINE_S} s drain deadline: the pod "
                                    "would be killed before the just-in-time checkpoint is written; use at least "
                                    f"{DRAIN_DEADLINE_S + 30}"))
        if selected == "spot":
            problems += _check_k8s_spot_group(key, group)
    if not spot:
        problems.append(Problem("spec.workerGroupSpecs", "no spot GPU worker group; add one with a spot "
                                                         "nodeSelector (e.g. cloud.google.com/gke-spot: \"true\"), "
                                                         "its toleration, nvidia.com/gpu limits and labels "
                                                         f"{{{MARKET_LABEL}: spot, {ROLE_LABEL}: {WORKER_ROLE}}}"))
    if not on_demand:
        problems.append(Problem("spec.workerGroupSpecs", "no on-demand GPU worker group (the fallback when spot "
                                                         "capacity is short); add one with nvidia.com/gpu limits "
                                                         f"and labels {{{MARKET_LABEL}: on-demand, "
                                                         f"{ROLE_LABEL}: {WORKER_ROLE}}}"))
    return problems


def _check_k8s_group(key: str, group: dict, is_head: bool) -> list[Problem]:
    problems = []
    params = group.get("rayStartParams") or {}
    if "labels" in params:
        problems.append(Problem(f"{key}.rayStartParams.labels", "Ray's autoscaler ignores labels given in "
                                                                "rayStartParams; move them to the group's labels "
                                                                "field (KubeRay >= 1.5)"))
    problems += _check_labels(f"{key}.labels", group.get("labels") or {}, head=is_head)
    labels = group.get("labels") or {}
    selected = _k8s_market(group)
    tolerated = [t.get("key") or "(every taint)" for t in group["template"]["spec"].get("tolerations") or []
                 if t.get("key") in K8S_SPOT_SELECTORS or (t.get("operator") == "Exists" and not t.get("key"))]
    if is_head and tolerated:
        problems.append(Problem(f"{key}.template.spec.tolerations",
                                f"the head tolerates the spot taint ({tolerated[0]}) and may be scheduled on a "
                                "spot node; remove that toleration from the head"))
    if is_head and selected == "spot":
        problems.append(Problem(f"{key}.template.spec.nodeSelector",
                                "the head is scheduled on spot nodes: a reclaim ends every driver, the autoscaler "
                                "and the job API; select on-demand nodes for the head"))
    elif labels.get(MARKET_LABEL) in MARKETS and labels[MARKET_LABEL] != selected:
        problems.append(Problem(f"{key}.labels.{MARKET_LABEL}",
                                f"labeled '{labels[MARKET_LABEL]}' but the nodeSelector puts it on {selected} "
                                f"nodes; label it '{selected}' or change the nodeSelector"))
    ray_env = {env["name"] for env in group["template"]["spec"]["containers"][0].get("env") or []}
    if "RAY_AUTH_MODE" not in ray_env:
        problems.append(Problem(f"{key}.template.spec.containers[0].env",
                                "Ray token authentication is off in this group; set RAY_AUTH_MODE=token and "
                                "RAY_AUTH_TOKEN from a Secret in the Ray container"))
    for c, container in enumerate(group["template"]["spec"]["containers"]):
        for e, env in enumerate(container.get("env") or []):
            ckey = f"{key}.template.spec.containers[{c}].env[{e}]"
            if env["name"] == "RAY_AUTH_MODE" and env.get("value") != "token":
                problems.append(Problem(ckey, f"RAY_AUTH_MODE={env.get('value')} turns Ray token authentication "
                                              "off; use token (with RAY_AUTH_TOKEN from a Secret)"))
            if _STORAGE_ENV.match(env["name"]) and "value" in env:
                problems += _storage_problem(ckey, env["name"], env["value"])
    return problems


def _check_k8s_spot_group(key: str, group: dict) -> list[Problem]:
    problems = []
    pod = group["template"]["spec"]
    selector = _spot_selector_key(pod)
    tolerations = pod.get("tolerations") or []
    if not any(t.get("key") == selector or (t.get("operator") == "Exists" and "key" not in t) for t in tolerations):
        value = K8S_SPOT_SELECTORS.get(selector, "true")
        problems.append(Problem(f"{key}.template.spec.tolerations",
                                "no toleration for the spot taint (spot nodes are tainted so that nothing else "
                                f"lands there); add {{key: {selector}, operator: Equal, value: \"{value}\", "
                                "effect: NoSchedule}"))
    if not any(_WATCHER.search(" ".join(c.get("command", []) + c.get("args", [])))
               for c in pod["containers"] + pod.get("initContainers", [])):
        problems.append(Problem(f"{key}.template.spec.containers",
                                "spot pods do not start the preemption watcher; add a sidecar container running "
                                f"`{WATCHER_COMMAND} --provider auto`"))
    return problems


def _spot_selector_key(pod: dict) -> str | None:
    for k, v in (pod.get("nodeSelector") or {}).items():
        if k in K8S_SPOT_SELECTORS and str(v).lower() == K8S_SPOT_SELECTORS[k].lower():
            return k
    return None


def _k8s_market(group: dict) -> str:
    return "spot" if _spot_selector_key(group["template"]["spec"]) else "on-demand"


def _k8s_gpus(group: dict) -> float:
    resources = group.get("resources") or {}
    if "GPU" in resources:
        return float(resources["GPU"])
    if "num-gpus" in (group.get("rayStartParams") or {}):
        return float(group["rayStartParams"]["num-gpus"])
    container = group["template"]["spec"]["containers"][0].get("resources") or {}
    for section in ("limits", "requests"):
        for name, value in (container.get(section) or {}).items():
            if name.endswith("gpu"):
                return float(value)
    return 0.0


# ---------------------------------------------------------------------------------------------------------
# helpers


def _unique(problems: list[Problem]) -> list[Problem]:
    """Drop repeats (a command shared by several node types is reported once), keeping the order."""
    return list(dict.fromkeys(problems))


def _env_assignments(command: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2).strip("'\"")) for m in _ENV_ASSIGNMENT.finditer(command)]


def _path(parts: Iterable[Any]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _suggest(value: Any, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(value), list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
