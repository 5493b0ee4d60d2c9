"""`elastic cluster validate`: every shipped config passes; each broken variant fails with exit 2 and one line
naming the key and the fix. Variants are made by mutating the loaded shipped YAML, so they stay in step with it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from elastic.cli import cli

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "cluster-configs"
AWS, GCP, KUBERAY = "aws-spot-gpu.yaml", "gcp-spot-gpu.yaml", "kuberay-spot-gpu.yaml"


def load(name: str) -> dict:
    # Through JSON: YAML anchors (<<: *spot_node_config) share nested dicts; a variant must change one place.
    return json.loads(json.dumps(yaml.safe_load((CONFIGS / name).read_text())))


def validate(path: Path, *args: str):
    return CliRunner().invoke(cli, ["cluster", "validate", str(path), *args])


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_shipped_config_validates(name):
    result = validate(CONFIGS / name)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().endswith("ok (" + ("kuberay" if "kuberay" in name else name.split("-")[0]) + ")")


def test_json_output(tmp_path):
    ok = validate(CONFIGS / AWS, "--json")
    assert ok.exit_code == 0
    assert json.loads(ok.stdout) == {"file": str(CONFIGS / AWS), "ok": True, "kind": "aws", "problems": []}
    config = load(AWS)
    config["available_node_types"]["gpu_spot_g5"]["node_config"]["InstanceMarketOptions"]["MarketType"] = "spott"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    bad = validate(path, "--json")
    assert bad.exit_code == 2
    report = json.loads(bad.stdout)
    assert report["ok"] is False
    assert {
        "key": "available_node_types.gpu_spot_g5.node_config.InstanceMarketOptions.MarketType",
        "message": "'spott' is not a market type; use 'spot'",
    } in report["problems"]


# ---------------------------------------------------------------------------------------------------------
# broken variants: (file, mutation, key, part of the message)


def _aws_types(c):
    return c["available_node_types"]


def _set(path: str, value) -> Callable[[dict], None]:
    """Mutation that sets a dotted path (list indices as numbers) in the config."""

    def mutate(config: dict) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        target = config
        for part in parents:
            target = target[part]
        target[last] = value

    return mutate


def _delete(path: str) -> Callable[[dict], None]:
    def mutate(config: dict) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        target = config
        for part in parents:
            target = target[part]
        del target[last]

    return mutate


def _replace_in(path: str, old: str, new: str) -> Callable[[dict], None]:
    def mutate(config: dict) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        target = config
        for part in parents:
            target = target[part]
        assert old in target[last], (old, target[last])
        target[last] = target[last].replace(old, new)

    return mutate


def _drop_spot_types(config):
    for name in [n for n, t in config["available_node_types"].items() if t["labels"]["market"] == "spot"]:
        del config["available_node_types"][name]


def _open_dashboard_port(config):
    config["provider"]["security_group"]["IpPermissions"] = [
        {"IpProtocol": "tcp", "FromPort": 8265, "ToPort": 8265, "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}
    ]


def _open_all_ipv6(config):
    config["provider"]["security_group"]["IpPermissions"] = [{"IpProtocol": "-1", "Ipv6Ranges": [{"CidrIpv6": "::/0"}]}]


def _ssh_from_world(config):  # allowed: Ray's own security group opens SSH; nodes accept keys only
    config["provider"]["security_group"]["IpPermissions"] = [
        {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}
    ]


SPOT_G5 = "available_node_types.gpu_spot_g5"
SPOT_OPTIONS = f"{SPOT_G5}.node_config.InstanceMarketOptions.SpotOptions"
GCP_SPOT = "available_node_types.gpu_spot_t4"
K_SPOT = "spec.workerGroupSpecs.0"
K_SPOT_KEY = "spec.workerGroupSpecs[0]"

BROKEN = [
    # --- AWS: Ray's schema
    (
        "aws-schema",
        AWS,
        _set("max_worker", 3),
        "(top level)",
        "Additional properties are not allowed ('max_worker' was unexpected) (Ray's schema)",
    ),
    ("aws-schema-node-type", AWS, _set(f"{SPOT_G5}.min_worker", 1), SPOT_G5, "('min_worker' was unexpected)"),
    # --- AWS: market fields Ray passes through unchecked
    (
        "spott",
        AWS,
        _set(f"{SPOT_G5}.node_config.InstanceMarketOptions.MarketType", "spott"),
        f"{SPOT_G5}.node_config.InstanceMarketOptions.MarketType",
        "'spott' is not a market type; use 'spot'",
    ),
    (
        "spot-options-typo",
        AWS,
        _set(f"{SPOT_OPTIONS}.MaxPirce", "0.5"),
        f"{SPOT_OPTIONS}.MaxPirce",
        "unknown SpotOptions field (did you mean 'MaxPrice'?)",
    ),
    (
        "max-price-number",
        AWS,
        _set(f"{SPOT_OPTIONS}.MaxPrice", 0.6),
        f"{SPOT_OPTIONS}.MaxPrice",
        "0.6 must be a quoted string",
    ),
    (
        "max-price-text",
        AWS,
        _set(f"{SPOT_OPTIONS}.MaxPrice", "cheap"),
        f"{SPOT_OPTIONS}.MaxPrice",
        "'cheap' is not a price; use USD per hour as a numeric string such as '1.20'",
    ),
    (
        "persistent-spot",
        AWS,
        _set(f"{SPOT_OPTIONS}.SpotInstanceType", "persistent"),
        f"{SPOT_OPTIONS}.SpotInstanceType",
        "use 'one-time'",
    ),
    (
        "market-options-typo",
        AWS,
        _set(f"{SPOT_G5}.node_config.InstanceMarketOptions.MarketTyp", "spot"),
        f"{SPOT_G5}.node_config.InstanceMarketOptions.MarketTyp",
        "(did you mean 'MarketType'?)",
    ),
    # --- AWS: the head
    (
        "spot-head",
        AWS,
        _set("available_node_types.head.node_config.InstanceMarketOptions", {"MarketType": "spot"}),
        "available_node_types.head.node_config",
        "the head is on spot",
    ),
    (
        "head-trains",
        AWS,
        _set("available_node_types.head.resources.CPU", 8),
        "available_node_types.head.resources.CPU",
        "the head offers CPUs to training; set resources.CPU: 0",
    ),
    (
        "head-role",
        AWS,
        _set("available_node_types.head.labels.elastic-role", "worker"),
        "available_node_types.head.labels.elastic-role",
        "'worker' is the wrong role (drivers and controllers select the head by it); set labels.elastic-role: head",
    ),
    # --- AWS: worker types and labels
    ("no-spot-type", AWS, _drop_spot_types, "available_node_types", "no spot GPU worker type"),
    (
        "no-on-demand-type",
        AWS,
        _delete("available_node_types.gpu_ondemand"),
        "available_node_types",
        "no on-demand GPU worker type",
    ),
    (
        "market-label-typo",
        AWS,
        _set(f"{SPOT_G5}.labels.market", "spto"),
        f"{SPOT_G5}.labels.market",
        "'spto' is not a market jobs request (did you mean 'spot'?); use one of spot, on-demand",
    ),
    (
        "market-label-wrong",
        AWS,
        _set("available_node_types.gpu_ondemand.labels.market", "spot"),
        "available_node_types.gpu_ondemand.labels.market",
        "labeled 'spot' but InstanceMarketOptions makes it on-demand",
    ),
    (
        "no-role-label",
        AWS,
        _delete(f"{SPOT_G5}.labels.elastic-role"),
        f"{SPOT_G5}.labels",
        "missing elastic-role label",
    ),
    # --- AWS: the watcher
    (
        "no-watcher",
        AWS,
        _delete("worker_start_ray_commands.2"),
        SPOT_G5,
        "spot nodes of this type do not start the preemption watcher",
    ),
    (
        "watcher-foreground",
        AWS,
        _replace_in("worker_start_ray_commands.2", "2>&1 &", "2>&1;"),
        "worker_start_ray_commands[2]",
        "the watcher runs in the foreground",
    ),
    (
        "watcher-provider",
        AWS,
        _replace_in("worker_start_ray_commands.2", "--provider aws", "--provider gcp"),
        "worker_start_ray_commands[2]",
        "use --provider aws",
    ),
    # --- AWS: exposure and auth
    (
        "open-8265",
        AWS,
        _open_dashboard_port,
        "provider.security_group.IpPermissions[0]",
        "opens port 8265 to the world (0.0.0.0/0)",
    ),
    (
        "open-all-ipv6",
        AWS,
        _open_all_ipv6,
        "provider.security_group.IpPermissions[0]",
        "opens all ports to the world (::/0)",
    ),
    (
        "dashboard-all-interfaces",
        AWS,
        _replace_in("head_start_ray_commands.1", "--dashboard-host=127.0.0.1", "--dashboard-host=0.0.0.0"),
        "head_start_ray_commands[1]",
        "use --dashboard-host=127.0.0.1",
    ),
    (
        "auth-disabled",
        AWS,
        _replace_in("setup_commands.2", "RAY_AUTH_MODE=token", "RAY_AUTH_MODE=disabled"),
        "setup_commands[2]",
        "RAY_AUTH_MODE=disabled turns Ray token authentication off",
    ),
    (
        "auth-missing",
        AWS,
        _replace_in("setup_commands.2", "'export RAY_AUTH_MODE=token'", ""),
        "setup_commands",
        "Ray token authentication is off on every node",
    ),
    (
        "auth-missing-one-type",
        AWS,
        _set("available_node_types.gpu_ondemand.worker_setup_commands", ["true"]),
        "available_node_types.gpu_ondemand",
        "Ray token authentication is off on these nodes",
    ),
    ("no-token-mount", AWS, _set("file_mounts", {}), "file_mounts", "no Ray auth token reaches the nodes"),
    # --- AWS: storage and versions
    (
        "local-checkpoints",
        AWS,
        _replace_in("setup_commands.2", "s3://my-elastic-checkpoints/runs", "/home/ubuntu/runs"),
        "setup_commands[2]",
        "ELASTIC_RUNS_URI=/home/ubuntu/runs is node-local storage",
    ),
    (
        "file-checkpoints",
        AWS,
        _replace_in("setup_commands.2", "s3://my-elastic-checkpoints/runs", "file:///mnt/runs"),
        "setup_commands[2]",
        "is node-local storage",
    ),
    (
        "unpinned",
        AWS,
        _replace_in("setup_commands.1", '"elastic-train==0.1.0"', "elastic-train"),
        "setup_commands[1]",
        "installs elastic-train unpinned",
    ),
    (
        "stale-pin",
        AWS,
        _replace_in("setup_commands.1", "elastic-train==0.1.0", "elastic-train==0.0.1"),
        "setup_commands[1]",
        "installs elastic-train==0.0.1 but this elastic is",
    ),
    # --- GCP
    (
        "gcp-model",
        GCP,
        _set(f"{GCP_SPOT}.node_config.scheduling.provisioningModel", "spot"),
        f"{GCP_SPOT}.node_config.scheduling.provisioningModel",
        "'spot' is not a provisioning model; use SPOT",
    ),
    (
        "gcp-preemptible-text",
        GCP,
        _set(f"{GCP_SPOT}.node_config.scheduling.preemptible", "yes"),
        f"{GCP_SPOT}.node_config.scheduling.preemptible",
        "'yes' must be true or false",
    ),
    (
        "gcp-gpu-migrate",
        GCP,
        _set(f"{GCP_SPOT}.node_config.scheduling.onHostMaintenance", "MIGRATE"),
        f"{GCP_SPOT}.node_config.scheduling.onHostMaintenance",
        "set scheduling.onHostMaintenance: TERMINATE",
    ),
    (
        "gcp-stop",
        GCP,
        _set(f"{GCP_SPOT}.node_config.scheduling.instanceTerminationAction", "STOP"),
        f"{GCP_SPOT}.node_config.scheduling.instanceTerminationAction",
        "use DELETE",
    ),
    (
        "gcp-scheduling-list",
        GCP,
        _set(f"{GCP_SPOT}.node_config.scheduling", [{"preemptible": True}]),
        f"{GCP_SPOT}.node_config.scheduling",
        "must be a mapping",
    ),
    (
        "gcp-spot-head",
        GCP,
        _set(
            "available_node_types.head.node_config.scheduling",
            {"provisioningModel": "SPOT", "onHostMaintenance": "TERMINATE"},
        ),
        "available_node_types.head.node_config",
        "the head is on spot",
    ),
    (
        "gcp-watcher-provider",
        GCP,
        _replace_in("worker_start_ray_commands.2", "--provider gcp", "--provider aws"),
        "worker_start_ray_commands[2]",
        "use --provider gcp",
    ),
    (
        "gcp-local-checkpoints",
        GCP,
        _replace_in("setup_commands.2", "gs://my-elastic-checkpoints/runs", "~/runs"),
        "setup_commands[2]",
        "ELASTIC_RUNS_URI=~/runs is node-local storage",
    ),
    # --- KubeRay
    (
        "k8s-schema-typo",
        KUBERAY,
        lambda c: c["spec"]["workerGroupSpecs"][0]["template"]["spec"].update(nodeSelecter={}),
        f"{K_SPOT_KEY}.template.spec",
        "Additional properties are not allowed ('nodeSelecter' was unexpected) (RayCluster schema)",
    ),
    (
        "k8s-schema-type",
        KUBERAY,
        _set(f"{K_SPOT}.maxReplicas", "four"),
        f"{K_SPOT_KEY}.maxReplicas",
        "'four' is not of type 'integer'",
    ),
    (
        "k8s-no-toleration",
        KUBERAY,
        _set(f"{K_SPOT}.template.spec.tolerations", []),
        f"{K_SPOT_KEY}.template.spec.tolerations",
        "no toleration for the spot taint",
    ),
    (
        "k8s-grace",
        KUBERAY,
        _set(f"{K_SPOT}.template.spec.terminationGracePeriodSeconds", 60),
        f"{K_SPOT_KEY}.template.spec.terminationGracePeriodSeconds",
        "60 s does not outlive the 120 s drain deadline",
    ),
    (
        "k8s-grace-default",
        KUBERAY,
        _delete(f"{K_SPOT}.template.spec.terminationGracePeriodSeconds"),
        f"{K_SPOT_KEY}.template.spec.terminationGracePeriodSeconds",
        "30 s does not outlive",
    ),
    (
        "k8s-no-autoscaling",
        KUBERAY,
        _set("spec.enableInTreeAutoscaling", False),
        "spec.enableInTreeAutoscaling",
        "set enableInTreeAutoscaling: true",
    ),
    (
        "k8s-spot-head",
        KUBERAY,
        _set("spec.headGroupSpec.template.spec.nodeSelector", {"cloud.google.com/gke-spot": "true"}),
        "spec.headGroupSpec.template.spec.nodeSelector",
        "the head is scheduled on spot nodes",
    ),
    (
        "k8s-head-tolerates-spot",
        KUBERAY,
        _set(
            "spec.headGroupSpec.template.spec.tolerations", [{"key": "cloud.google.com/gke-spot", "operator": "Exists"}]
        ),
        "spec.headGroupSpec.template.spec.tolerations",
        "the head tolerates the spot taint",
    ),
    (
        "k8s-load-balancer",
        KUBERAY,
        _set("spec.headGroupSpec.serviceType", "LoadBalancer"),
        "spec.headGroupSpec",
        "serviceType: LoadBalancer exposes the dashboard and job API",
    ),
    (
        "k8s-head-cpus",
        KUBERAY,
        _delete("spec.headGroupSpec.rayStartParams.num-cpus"),
        "spec.headGroupSpec.rayStartParams",
        "the head offers CPUs to training",
    ),
    (
        "k8s-no-spot-group",
        KUBERAY,
        lambda c: c["spec"]["workerGroupSpecs"].pop(0),
        "spec.workerGroupSpecs",
        "no spot GPU worker group",
    ),
    (
        "k8s-label-mismatch",
        KUBERAY,
        lambda c: c["spec"]["workerGroupSpecs"][0]["template"]["spec"]["nodeSelector"].pop("cloud.google.com/gke-spot"),
        f"{K_SPOT_KEY}.labels.market",
        "labeled 'spot' but the nodeSelector puts it on on-demand nodes",
    ),
    (
        "k8s-labels-in-start-params",
        KUBERAY,
        _set(f"{K_SPOT}.rayStartParams.labels", "market=spot"),
        f"{K_SPOT_KEY}.rayStartParams.labels",
        "move them to the group's labels field",
    ),
    (
        "k8s-no-watcher",
        KUBERAY,
        lambda c: c["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"].pop(),
        f"{K_SPOT_KEY}.template.spec.containers",
        "spot pods do not start the preemption watcher",
    ),
    (
        "k8s-no-auth",
        KUBERAY,
        lambda c: c["spec"]["workerGroupSpecs"][1]["template"]["spec"]["containers"][0].update(env=[]),
        "spec.workerGroupSpecs[1].template.spec.containers[0].env",
        "Ray token authentication is off in this group",
    ),
    (
        "k8s-local-checkpoints",
        KUBERAY,
        lambda c: c["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"].append(
            {"name": "ELASTIC_RUNS_URI", "value": "/data/runs"}
        ),
        "spec.headGroupSpec.template.spec.containers[0].env[6]",
        "is node-local storage",
    ),
]


@pytest.mark.parametrize("name, file, mutate, key, message", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_variant_fails_with_its_line(tmp_path, name, file, mutate, key, message):
    config = load(file)
    mutate(config)
    path = tmp_path / file
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    result = validate(path)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert lines, result.output
    prefix = f"{path}: {key}: "
    matching = [line for line in lines if line.startswith(prefix) and message in line]
    assert matching, f"no line starting {prefix!r} containing {message!r} in:\n" + "\n".join(lines)


def test_ssh_from_the_world_is_allowed(tmp_path):
    config = load(AWS)
    _ssh_from_world(config)
    path = tmp_path / "ssh.yaml"
    path.write_text(yaml.safe_dump(config))
    assert validate(path).exit_code == 0


def test_unreadable_inputs_exit_2_with_one_line(tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("provider: {type: aws\n")
    for path, text in [
        (tmp_path / "missing.yaml", "no such cluster config; check the path"),
        (bad_yaml, "not valid YAML"),
        (ROOT / "jobs" / "digits_ddp.yaml", "no provider.type and not a RayCluster manifest"),
    ]:
        result = CliRunner().invoke(cli, ["cluster", "validate", str(path)])
        assert result.exit_code != 0
        assert text in (result.output + str(result.exception)), (path, result.output, result.exception)
    # Through main(), as the `elastic` command runs: a UserError is one line on stderr and exit status 2.
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "elastic", "cluster", "validate", str(bad_yaml)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "not valid YAML" in proc.stderr, proc.stderr
