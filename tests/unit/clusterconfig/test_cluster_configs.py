"""`elastic cluster validate`: every shipped config passes; each broken variant fails with exit 2 and one line
naming the key and the fix. Variants are made by mutating the loaded shipped YAML, so they stay in step with it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
import yaml
from click.testing import CliRunner

from elastic.cli import cli
from elastic.clusterconfig import crd_schema

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
        lambda c: c["worker_start_ray_commands"].__setitem__(
            2, "source ~/.elastic-env; elastic watch-preemption --provider aws >/tmp/w.log 2>&1"
        ),
        "worker_start_ray_commands[2]",
        "the watcher runs in the foreground and would block node setup; start it as a systemd unit: `sudo systemd-run",
    ),
    (
        "watcher-nohup",
        AWS,
        lambda c: c["worker_start_ray_commands"].__setitem__(
            2, "source ~/.elastic-env; nohup elastic watch-preemption --provider aws >/tmp/w.log 2>&1 &"
        ),
        "worker_start_ray_commands[2]",
        "the watcher is not supervised: nothing restarts it when it exits; start it as a systemd unit",
    ),
    (
        "watcher-unit-not-restarted",
        GCP,
        _replace_in("worker_start_ray_commands.2", "-p Restart=always", ""),
        "worker_start_ray_commands[2]",
        "the watcher's systemd unit is never restarted; add -p Restart=always",
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
        _replace_in("setup_commands.1", '"$HOME/elastic-src"', "elastic-train"),
        "setup_commands[1]",
        "installs elastic-train unpinned",
    ),
    (
        "stale-pin",
        AWS,
        _replace_in("setup_commands.1", '"$HOME/elastic-src"', "elastic-train==0.0.1"),
        "setup_commands[1]",
        "installs elastic-train==0.0.1 but this elastic is",
    ),
    (
        "install-unshipped-tree",
        AWS,
        _replace_in("setup_commands.1", '"$HOME/elastic-src"', "~/elastic-checkout"),
        "setup_commands[1]",
        "installs ~/elastic-checkout, which no file_mounts entry copies to the nodes; add file_mounts",
    ),
    (
        "checkout-not-shipped",
        GCP,
        lambda c: [c["file_mounts"].pop(k) for k in list(c["file_mounts"]) if k.startswith("~/elastic-src")],
        "setup_commands[1]",
        "installs ~/elastic-src, which no file_mounts entry copies to the nodes",
    ),
    (
        "install-nothing",
        GCP,
        _delete("setup_commands.1"),
        "available_node_types.head",
        "no setup command installs elastic on these nodes",
    ),
    (
        "checkout-not-mounted",
        GCP,
        lambda c: c["file_mounts"].pop("~/elastic-src/pyproject.toml"),
        "setup_commands[1]",
        "installs ~/elastic-src, but file_mounts copy no ~/elastic-src/pyproject.toml; add file_mounts",
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
        "Additional properties are not allowed ('nodeSelecter' was unexpected) (KubeRay v1.7.0 RayCluster CRD); did you mean 'nodeSelector'?",
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
        lambda c: c["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0].pop("lifecycle"),
        f"{K_SPOT_KEY}.template.spec.containers[0].lifecycle",
        "spot pods never drain their Ray node before they stop; add lifecycle: {preStop: {exec: {command: "
        "[elastic, watch-preemption, --drain-now, '13']}}}",
    ),
    (
        "k8s-drain-outlives-grace",
        KUBERAY,
        lambda c: c["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0].update(
            lifecycle={"preStop": {"exec": {"command": ["elastic", "watch-preemption", "--drain-now", "160"]}}}
        ),
        f"{K_SPOT_KEY}.template.spec.containers[0].lifecycle.preStop",
        "--drain-now 160 holds the pod past its terminationGracePeriodSeconds (150)",
    ),
    (
        "k8s-no-containers",
        KUBERAY,
        lambda c: c["spec"]["workerGroupSpecs"][1]["template"]["spec"].update(containers=[]),
        "spec.workerGroupSpecs[1].template.spec.containers",
        "no containers; the first one runs Ray",
    ),
    (
        "k8s-upscaling-default",
        KUBERAY,
        _set("spec.autoscalerOptions.upscalingMode", "Default"),
        "spec.autoscalerOptions.upscalingMode",
        "Default scales up without a rate limit (Ray's upscaling_speed 1000)",
    ),
    (
        "k8s-shared-account",
        KUBERAY,
        _set("spec.headGroupSpec.template.spec.serviceAccountName", "elastic-worker"),
        "spec.workerGroupSpecs[0].template.spec.serviceAccountName",
        "shares the head's service account elastic-worker, to which KubeRay binds the autoscaler's Role",
    ),
    (
        "k8s-head-may-land-on-spot",
        KUBERAY,
        lambda c: c["spec"]["headGroupSpec"]["template"]["spec"].pop("affinity"),
        "spec.headGroupSpec.template.spec.affinity",
        "nothing keeps the head off spot nodes of a pool created without the spot taint",
    ),
    (
        "k8s-no-auth",
        KUBERAY,
        lambda c: c["spec"].pop("authOptions"),
        "spec.workerGroupSpecs[1].template.spec.containers[0].env",
        "Ray token authentication is off in this group; set spec.authOptions: {mode: token",
    ),
    (
        "k8s-auth-disabled",
        KUBERAY,
        _set("spec.authOptions.mode", "disabled"),
        "spec.authOptions.mode",
        "disabled: KubeRay turns token authentication on only with mode: token",
    ),
    (
        "k8s-auth-mode-enum",
        KUBERAY,
        _set("spec.authOptions.mode", "tokens"),
        "spec.authOptions.mode",
        "'tokens' is not one of ['disabled', 'token'] (KubeRay v1.7.0 RayCluster CRD)",
    ),
    (
        "k8s-container-typo",
        KUBERAY,
        lambda c: c["spec"]["workerGroupSpecs"][1]["template"]["spec"]["containers"][0].update(
            imagePullPolicyy="Always"
        ),
        "spec.workerGroupSpecs[1].template.spec.containers[0]",
        "('imagePullPolicyy' was unexpected) (KubeRay v1.7.0 RayCluster CRD); did you mean 'imagePullPolicy'?",
    ),
    (
        "k8s-deep-typo",
        KUBERAY,
        lambda c: c["spec"]["workerGroupSpecs"][0]["template"]["spec"]["tolerations"][0].update(efect="NoSchedule"),
        "spec.workerGroupSpecs[0].template.spec.tolerations[0]",
        "('efect' was unexpected) (KubeRay v1.7.0 RayCluster CRD); did you mean 'effect'?",
    ),
    (
        "k8s-wrong-kind",
        KUBERAY,
        _set("apiVersion", "ray.io/v1alpha1"),
        "apiVersion",
        "'ray.io/v1' was expected",
    ),
    (
        "k8s-local-checkpoints",
        KUBERAY,
        lambda c: c["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"].append(
            {"name": "ELASTIC_RUNS_URI", "value": "/data/runs"}
        ),
        "spec.headGroupSpec.template.spec.containers[0].env[4]",
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


# ---------------------------------------------------------------------------------------------------------
# what the nodes install


def _uncommented(text: str) -> str:
    return "\n".join(line.split("#", 1)[0] for line in text.splitlines())


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")) + [ROOT / "Dockerfile"], ids=lambda p: p.name)
def test_nothing_installs_an_unpublished_release(path):
    """elastic-train is on no index yet: every node and image installs the checkout, never `elastic-train==...`."""
    assert "elastic-train==" not in _uncommented(path.read_text())


@pytest.mark.parametrize("name", [AWS, GCP])
def test_ray_up_configs_ship_the_package_sources(name):
    config = load(name)
    mounts = config["file_mounts"]
    for local in ("pyproject.toml", "README.md", "elastic"):
        assert mounts[f"~/elastic-src/{local}"] == local and (ROOT / local).exists()
    extra = "[gcp]" if name == GCP else ""
    assert f'pip install -q "$HOME/elastic-src{extra}"' in " ".join(config["setup_commands"])


def test_dockerfile_installs_the_checkout_on_rays_image():
    text = _uncommented((ROOT / "Dockerfile").read_text())
    assert "FROM rayproject/ray:2.60.0-py311-gpu" in text
    assert "COPY --chown=ray:users elastic /tmp/elastic-src/elastic" in text
    assert 'pip install --no-cache-dir "/tmp/elastic-src${EXTRAS:+[$EXTRAS]}"' in text
    # .dockerignore keeps the context to what the COPY lines need (no .venv, no .git)
    assert (ROOT / ".dockerignore").read_text().splitlines()[1:4] == ["*", "!pyproject.toml", "!README.md"]


# ---------------------------------------------------------------------------------------------------------
# KubeRay's CRD schema


def test_vendored_crd_says_where_it_came_from():
    vendored = crd_schema.vendored()
    assert vendored["release"] == "v1.7.0" and len(vendored["commit"]) == 40
    assert vendored["source"].endswith("/v1.7.0/ray-operator/config/crd/bases/ray.io_rayclusters.yaml")
    assert "authOptions" in vendored["openAPIV3Schema"]["properties"]["spec"]["properties"]


def test_crd_conversion_rejects_unknown_fields_unless_preserved():
    crd = {
        "type": "object",
        "properties": {
            "strict": {"type": "object", "properties": {"a": {"type": "string"}}},
            "open": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {"a": {}}},
            "bare": {"type": "object"},
            "port": {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]},
            "maybe": {"type": "string", "nullable": True},
            # a field named like a keyword is still a field
            "type": {"type": "object", "properties": {"type": {"type": "string"}}},
        },
    }
    validator = jsonschema.Draft7Validator(crd_schema.as_json_schema(crd))
    assert validator.is_valid({"strict": {"a": "x"}, "open": {"b": 1}, "bare": {"c": 2}, "port": 80, "maybe": None})
    assert validator.is_valid({"port": "http", "type": {"type": "x"}})
    assert not validator.is_valid({"strict": {"b": "x"}})
    assert not validator.is_valid({"type": {"kind": "x"}})
    assert not validator.is_valid({"extra": 1})
    assert not validator.is_valid({"port": 1.5})


def test_kuberay_manifest_with_every_optional_block_still_validates(tmp_path):
    """Fields of the real CRD that the old hand-kept subset rejected pass now."""
    config = load(KUBERAY)
    config["spec"]["authOptions"]["enableK8sTokenAuth"] = False
    config["spec"]["headGroupSpec"]["headService"] = {"metadata": {"annotations": {"a": "b"}}}
    config["spec"]["workerGroupSpecs"][0]["idleTimeoutSeconds"] = 120
    pod = config["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    pod["affinity"] = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}
    pod["containers"][0]["volumeMounts"] = [{"name": "shm", "mountPath": "/dev/shm"}]
    pod["volumes"] = [{"name": "shm", "emptyDir": {"medium": "Memory"}}]
    path = tmp_path / "k.yaml"
    path.write_text(yaml.safe_dump(config))
    result = validate(path)
    assert result.exit_code == 0, result.output


# ---------------------------------------------------------------------------------------------------------
# AWS IAM policies


def _statements(name: str) -> list[dict]:
    return json.loads((CONFIGS / "aws-iam" / name).read_text())["Statement"]


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def test_head_policy_scopes_every_instance_action_to_this_clusters_tag():
    """Launch, terminate, stop, start and tag only instances tagged with the config's cluster_name."""
    cluster = load(AWS)["cluster_name"]
    mutating = {"ec2:RunInstances", "ec2:TerminateInstances", "ec2:StopInstances", "ec2:StartInstances"}
    seen = set()
    for statement in _statements("head-policy.json"):
        actions = set(_as_list(statement["Action"]))
        on_instances = [r for r in _as_list(statement["Resource"]) if r in ("*", "arn:aws:ec2:*:*:instance/*")]
        if not (actions & (mutating | {"ec2:CreateTags"})) or not on_instances:
            continue
        assert on_instances == ["arn:aws:ec2:*:*:instance/*"], statement["Sid"]  # never Resource "*"
        condition = statement["Condition"]["StringEquals"]
        if "ec2:CreateAction" in condition:  # tags written by the launch itself
            assert actions == {"ec2:CreateTags"} and condition["ec2:CreateAction"] == "RunInstances"
            continue
        tag = (
            "aws:RequestTag/ray-cluster-name" if actions == {"ec2:RunInstances"} else "ec2:ResourceTag/ray-cluster-name"
        )
        assert condition == {tag: cluster}, statement["Sid"]
        seen |= actions
    assert mutating <= seen


def test_head_policy_resolves_the_ssm_image_parameter():
    image = load(AWS)["available_node_types"]["gpu_spot_g5"]["node_config"]["ImageId"]
    parameter = image.removeprefix("resolve:ssm:")
    [statement] = [s for s in _statements("head-policy.json") if "ssm:GetParameters" in _as_list(s["Action"])]
    prefix = statement["Resource"].split(":parameter", 1)[1].rstrip("*")
    assert parameter.startswith(prefix)


def test_worker_policy_has_no_ec2_rights():
    assert not [
        s for s in _statements("worker-policy.json") if any(a.startswith("ec2:") for a in _as_list(s["Action"]))
    ]
