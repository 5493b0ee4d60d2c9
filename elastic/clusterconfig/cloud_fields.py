"""Cloud fields of `ray up` node configs that Ray passes to the cloud unchecked: AWS `InstanceMarketOptions`
(Ray accepts `MarketType: spott`) and the security group's open ports, GCP `scheduling` and accelerators; and
what a node config says about its market and GPUs."""

from __future__ import annotations

import re
from typing import Any

from elastic.clusterconfig.problems import Problem, suggest

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


# AWS ---------------------------------------------------------------------------------------------------


def check_cloud_node_config(cloud: str, base: str, node_config: dict) -> list[Problem]:
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


def check_aws_ingress(provider: dict) -> list[Problem]:
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


def market_of(cloud: str, node_config: dict) -> str | None:
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


def market_source(cloud: str) -> str:
    return "InstanceMarketOptions" if cloud == "aws" else "scheduling"


def spot_hint(cloud: str) -> str:
    return (
        "node_config.InstanceMarketOptions: {MarketType: spot}"
        if cloud == "aws"
        else "node_config.scheduling: {provisioningModel: SPOT}"
    )


def gpus(cloud: str, node_type: dict) -> float:
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
