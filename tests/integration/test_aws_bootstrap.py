"""cluster-configs/aws-spot-gpu.yaml through Ray's own AWS bootstrap and node provider, against moto's server.

What `ray up` does before SSH, step by step, on the shipped file: prepare and schema-check it, fill node resources
from DescribeInstanceTypes, bootstrap (key pair, subnets across zones, security group, IAM profiles), then launch
the head, a spot and an on-demand worker the way the autoscaler does, and terminate them. Every result is read
back from moto with boto3, not from Ray's return values.

Not covered here (moto cannot, or the test does not): AWS resolving `ImageId: resolve:ssm:...` to an AMI (moto
stores the string as given and validates no AMI), spot capacity, prices, MaxPrice and interruptions (moto marks any
InstanceMarketOptions launch as spot), IAM policy evaluation (moto does not enforce policies, so the profiles'
scoping is checked as documents, not as denied calls), and everything after launch (SSH, file mounts, setup and
start commands, the watcher). Ray's default-IAM step runs on a variant without the head's profile, with its
propagation waits skipped.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from moto_helpers import running_moto

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "cluster-configs" / "aws-spot-gpu.yaml"
IAM = ROOT / "cluster-configs" / "aws-iam"
REGION = "us-west-2"
BUCKET = "my-elastic-checkpoints"


@pytest.fixture(scope="module")
def moto_aws(tmp_path_factory):
    """moto's server (EC2, IAM, S3...) for the module, with the AWS environment and a temporary HOME (Ray writes
    the generated SSH key to ~/.ssh) in os.environ, restored afterwards."""
    home = tmp_path_factory.mktemp("home")
    with running_moto(
        tmp_path_factory.mktemp("moto"),
        region=REGION,
        server_env={"MOTO_IAM_LOAD_MANAGED_POLICIES": "true"},
        extra={"AWS_DEFAULT_REGION": REGION, "HOME": str(home)},
    ) as settings:
        yield settings


def _create_instance_profiles() -> None:
    """What cluster-configs/README.md tells a user to do once: the two roles and profiles the config names."""
    import boto3

    iam = boto3.client("iam", region_name=REGION)
    trust = (IAM / "trust-policy.json").read_text()
    for name in ("elastic-head", "elastic-worker"):
        iam.create_role(RoleName=name, AssumeRolePolicyDocument=trust)
        iam.put_role_policy(
            RoleName=name,
            PolicyName=f"{name}-policy",
            PolicyDocument=(IAM / f"{name.split('-')[1]}-policy.json").read_text(),
        )
        iam.create_instance_profile(InstanceProfileName=name)
        iam.add_role_to_instance_profile(InstanceProfileName=name, RoleName=name)
    boto3.client("s3", region_name=REGION).create_bucket(
        Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": REGION}
    )


@pytest.fixture(scope="module")
def bootstrapped(moto_aws):
    """The shipped config as `ray up` resolves it before the first SSH (ray.autoscaler._private.commands.
    _bootstrap_config, without its on-disk cache)."""
    from ray.autoscaler._private.aws.config import bootstrap_aws
    from ray.autoscaler._private.aws.node_provider import AWSNodeProvider
    from ray.autoscaler._private.util import prepare_config, validate_config

    _create_instance_profiles()
    config = prepare_config(yaml.safe_load(CONFIG.read_text()))
    validate_config(config)
    config = AWSNodeProvider.fillout_available_node_types_resources(config)
    validate_config(config)
    return bootstrap_aws(config)


def test_bootstrap_creates_key_pair_subnets_and_ssh_only_security_group(bootstrapped, moto_aws):
    import boto3

    ec2 = boto3.client("ec2", region_name=REGION)
    types = bootstrapped["available_node_types"]

    # Key pair: created in EC2, private key saved under the (temporary) HOME, named in every node config.
    key_name = f"ray-autoscaler_{REGION}"
    assert [k["KeyName"] for k in ec2.describe_key_pairs(KeyNames=[key_name])["KeyPairs"]] == [key_name]
    assert bootstrapped["auth"]["ssh_private_key"] == str(Path(moto_aws["HOME"]) / ".ssh" / f"{key_name}.pem")
    assert Path(bootstrapped["auth"]["ssh_private_key"]).stat().st_mode & 0o077 == 0
    assert {t["node_config"]["KeyName"] for t in types.values()} == {key_name}

    # Subnets: the default VPC's, in the four configured zones, first zone first; one VPC for the cluster.
    subnet_ids = {tuple(t["node_config"]["SubnetIds"]) for t in types.values()}
    assert len(subnet_ids) == 1
    subnets = ec2.describe_subnets(SubnetIds=list(next(iter(subnet_ids))))["Subnets"]
    by_id = {s["SubnetId"]: s for s in subnets}
    zones = [by_id[s]["AvailabilityZone"] for s in next(iter(subnet_ids))]
    assert zones == [f"{REGION}{z}" for z in "abcd"]
    vpcs = {s["VpcId"] for s in subnets}
    default_vpc = ec2.describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"][0]["VpcId"]
    assert vpcs == {default_vpc}

    # Security group: the configured name, in that VPC, used by every node type; inbound only from the group
    # itself (Ray, NCCL between nodes) and SSH; nothing else open to anyone.
    groups = ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": ["elastic-spot-gpu"]}])[
        "SecurityGroups"
    ]
    assert len(groups) == 1
    group = groups[0]
    assert group["VpcId"] == default_vpc
    assert {tuple(t["node_config"]["SecurityGroupIds"]) for t in types.values()} == {(group["GroupId"],)}
    rules = group["IpPermissions"]
    world = [r for r in rules if r.get("IpRanges") or r.get("Ipv6Ranges")]
    assert [(r["IpProtocol"], r["FromPort"], r["ToPort"]) for r in world] == [("tcp", 22, 22)]
    internal = [r for r in rules if r.get("UserIdGroupPairs")]
    assert len(internal) == 1 and internal[0]["IpProtocol"] == "-1"
    assert [p["GroupId"] for p in internal[0]["UserIdGroupPairs"]] == [group["GroupId"]]
    assert len(rules) == 2


def test_bootstrap_keeps_scoped_instance_profiles_and_detected_gpus(bootstrapped):
    import boto3

    iam = boto3.client("iam", region_name=REGION)
    types = bootstrapped["available_node_types"]
    # The config names its own profiles, so Ray adds none (its default would attach EC2/S3 full access).
    assert types["head"]["node_config"]["IamInstanceProfile"] == {"Name": "elastic-head"}
    assert bootstrapped["head_node"] == {}
    for name, node_type in types.items():
        profile_name = node_type["node_config"]["IamInstanceProfile"]["Name"]
        assert profile_name == ("elastic-head" if name == "head" else "elastic-worker")
        profile = iam.get_instance_profile(InstanceProfileName=profile_name)["InstanceProfile"]
        assert [r["RoleName"] for r in profile["Roles"]] == [profile_name]
    # Workers may touch the checkpoint bucket and nothing else.
    document = iam.get_role_policy(RoleName="elastic-worker", PolicyName="elastic-worker-policy")["PolicyDocument"]
    document = json.loads(document) if isinstance(document, str) else document
    resources = {
        r for s in document["Statement"] for r in ([s["Resource"]] if isinstance(s["Resource"], str) else s["Resource"])
    }
    assert resources == {f"arn:aws:s3:::{BUCKET}", f"arn:aws:s3:::{BUCKET}/*"}
    assert all(a.startswith("s3:") for s in document["Statement"] for a in s["Action"])
    # Ray filled resources from DescribeInstanceTypes: the instance types exist in the region and have the GPU the
    # config declares.
    assert (
        types["gpu_spot_g5"]["resources"]["GPU"] == 1 and "accelerator_type:A10G" in types["gpu_spot_g5"]["resources"]
    )
    assert "accelerator_type:L4" in types["gpu_spot_g6"]["resources"]
    assert types["head"]["resources"]["CPU"] == 0


def _launch(provider, config: dict, node_type: str, kind: str) -> str:
    """Launch one node as the autoscaler (workers) or `ray up` (head) does: the type's bootstrapped node_config
    (plus config["head_node"] for the head) and Ray's tags."""
    from ray.autoscaler.tags import (
        TAG_RAY_LAUNCH_CONFIG,
        TAG_RAY_NODE_KIND,
        TAG_RAY_NODE_NAME,
        TAG_RAY_NODE_STATUS,
        TAG_RAY_USER_NODE_TYPE,
    )

    node_config = copy.deepcopy(config["available_node_types"][node_type]["node_config"])
    if kind == "head":
        node_config.update(config["head_node"])
    tags = {
        TAG_RAY_NODE_NAME: f"ray-{config['cluster_name']}-{kind}",
        TAG_RAY_NODE_KIND: kind,
        TAG_RAY_NODE_STATUS: "uninitialized",
        TAG_RAY_LAUNCH_CONFIG: "test",
        TAG_RAY_USER_NODE_TYPE: node_type,
    }
    created = provider.create_node(node_config, tags, 1)
    assert len(created) == 1
    return next(iter(created))


def test_launch_spot_and_on_demand_nodes_then_terminate(bootstrapped):
    import boto3
    from ray.autoscaler._private.aws.node_provider import AWSNodeProvider

    ec2 = boto3.client("ec2", region_name=REGION)
    provider = AWSNodeProvider(bootstrapped["provider"], bootstrapped["cluster_name"])
    ids = {
        "head": _launch(provider, bootstrapped, "head", "head"),
        "gpu_spot_g5": _launch(provider, bootstrapped, "gpu_spot_g5", "worker"),
        "gpu_spot_g6": _launch(provider, bootstrapped, "gpu_spot_g6", "worker"),
        "gpu_ondemand": _launch(provider, bootstrapped, "gpu_ondemand", "worker"),
    }
    reservations = ec2.describe_instances(InstanceIds=list(ids.values()))["Reservations"]
    instances = {i["InstanceId"]: i for r in reservations for i in r["Instances"]}
    group_id = bootstrapped["available_node_types"]["head"]["node_config"]["SecurityGroupIds"][0]
    subnets = set(bootstrapped["available_node_types"]["head"]["node_config"]["SubnetIds"])
    expect = {  # node type: (instance type, lifecycle, market tag, role tag, profile)
        "head": ("m6i.2xlarge", None, "on-demand", "head", "elastic-head"),
        "gpu_spot_g5": ("g5.xlarge", "spot", "spot", "worker", "elastic-worker"),
        "gpu_spot_g6": ("g6.xlarge", "spot", "spot", "worker", "elastic-worker"),
        "gpu_ondemand": ("g5.xlarge", None, "on-demand", "worker", "elastic-worker"),
    }
    for node_type, instance_id in ids.items():
        instance = instances[instance_id]
        instance_type, lifecycle, market, role, profile = expect[node_type]
        tags = {t["Key"]: t["Value"] for t in instance["Tags"]}
        assert instance["InstanceType"] == instance_type
        assert instance.get("InstanceLifecycle") == lifecycle, node_type
        assert tags["elastic-market"] == market and tags["elastic-role"] == role
        assert tags["ray-cluster-name"] == "elastic-spot-gpu" and tags["ray-user-node-type"] == node_type
        assert instance["IamInstanceProfile"]["Arn"].endswith(f"instance-profile/{profile}")
        assert [g["GroupId"] for g in instance["SecurityGroups"]] == [group_id]
        assert instance["SubnetId"] in subnets
        assert instance["KeyName"] == f"ray-autoscaler_{REGION}"
        assert instance["ImageId"].startswith("resolve:ssm:/aws/service/deeplearning/")  # moto keeps it as given

    # The provider sees them by its tag filters, and terminates them (one-time spot cannot be stopped).
    from ray.autoscaler.tags import TAG_RAY_NODE_KIND, TAG_RAY_USER_NODE_TYPE

    workers = provider.non_terminated_nodes({TAG_RAY_NODE_KIND: "worker"})
    assert set(workers) == {ids["gpu_spot_g5"], ids["gpu_spot_g6"], ids["gpu_ondemand"]}
    assert provider.node_tags(ids["gpu_spot_g5"])[TAG_RAY_USER_NODE_TYPE] == "gpu_spot_g5"
    provider.terminate_nodes(list(ids.values()))
    states = {
        i["InstanceId"]: i["State"]["Name"]
        for r in ec2.describe_instances(InstanceIds=list(ids.values()))["Reservations"]
        for i in r["Instances"]
    }
    assert set(states.values()) <= {"shutting-down", "terminated"}, states
    assert provider.non_terminated_nodes({}) == []


def test_ray_default_iam_role_when_the_head_names_no_profile(moto_aws, monkeypatch):
    """Ray's own IAM step, for a user who deletes the head's IamInstanceProfile: Ray creates ray-autoscaler-v1
    with AmazonEC2FullAccess and AmazonS3FullAccess (moto loads AWS managed policies with
    MOTO_IAM_LOAD_MANAGED_POLICIES=true). The shipped config avoids it: those grants are account-wide."""
    import types

    import boto3
    from ray.autoscaler._private.aws import config as aws_config
    from ray.autoscaler._private.util import prepare_config

    # Ray waits 2 x 15 s for IAM propagation; moto needs none. The clock is an edge: skip the waits.
    monkeypatch.setattr(aws_config, "time", types.SimpleNamespace(sleep=lambda seconds: None))
    config = prepare_config(yaml.safe_load(CONFIG.read_text()))
    del config["available_node_types"]["head"]["node_config"]["IamInstanceProfile"]
    config["head_node"] = {}
    config = aws_config._configure_iam_role(config)

    iam = boto3.client("iam", region_name=REGION)
    profile = iam.get_instance_profile(InstanceProfileName="ray-autoscaler-v1")["InstanceProfile"]
    assert config["head_node"]["IamInstanceProfile"] == {"Arn": profile["Arn"]}
    assert [r["RoleName"] for r in profile["Roles"]] == ["ray-autoscaler-v1"]
    attached = {
        p["PolicyName"] for p in iam.list_attached_role_policies(RoleName="ray-autoscaler-v1")["AttachedPolicies"]
    }
    assert attached == {"AmazonEC2FullAccess", "AmazonS3FullAccess"}
