"""The local stack's state: where it lives (ELASTIC_HOME), its Ray token, the plan of its nodes, and the state
file that records what `up` started (so `down` stops exactly that, and every verb finds the stack)."""

from __future__ import annotations

import fcntl
import json
import os
import secrets
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from elastic.errors import ClusterError
from elastic.local.processes import Launched
from elastic.placement.labels import (
    HEAD_ROLE,
    INSTANCE_TYPE_LABEL,
    MARKET_LABEL,
    NODE_NAME_LABEL,
    ROLE_LABEL,
    WORKER_ROLE,
)

DEFAULT_BUCKET = "elastic"
# Ray's default object store takes 30% of RAM per node; several nodes on one machine would ask for more
# shared memory than there is.
OBJECT_STORE_BYTES = 200 * 1024 * 1024
# Credentials of the local S3 endpoint (moto accepts any; SeaweedFS is started with these); real clusters use the AWS chain.
LOCAL_AWS_KEY = "elastic-local"
# Simulated nodes are labelled with the AWS config's instance types (cluster-configs/aws-spot-gpu.yaml), so
# `elastic report` prices a local run as it would that run on those nodes (the built-in price table).
LOCAL_WORKER_INSTANCE_TYPE = "g5.xlarge"
LOCAL_HEAD_INSTANCE_TYPE = "m6i.2xlarge"
# Ray's token auth (Ray's own default), or none. One mode for the stack, its drivers and every CLI call: a mix
# fails auth, so every process we start and every client call takes it from LocalState.auth_env().
AUTH_MODES = ("token", "none")
# `elastic local env` exports the marker of the stack whose variables it prints, so a later command can tell
# that a shell's exports are of a stack that is gone (a `down` and a new `up` since the `eval`).
ENV_MARKER_VARIABLE = "ELASTIC_LOCAL_ENV"
# Every variable `elastic local env` exports (LocalState.env()), plus the token that would override them.
STACK_VARIABLES = (
    "RAY_ADDRESS",
    "RAY_API_SERVER_ADDRESS",
    "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN_PATH",
    "RAY_AUTH_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "ELASTIC_BUCKET",
    "ELASTIC_LOGICAL_GPUS",
    ENV_MARKER_VARIABLE,
)
# Those that point a client at a cluster or endpoint: what a stale export would steer somewhere dead.
ADDRESS_VARIABLES = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "AWS_ENDPOINT_URL")


def home_dir() -> Path:
    return Path(os.environ.get("ELASTIC_HOME") or Path.home() / ".elastic")


def state_path() -> Path:
    return home_dir() / "local" / "state.json"


def token_path() -> Path:
    """The stack's Ray token, as Ray keeps ~/.ray/auth_token: made once, kept across `down` and `up`."""
    return home_dir() / "local" / "auth_token"


def ensure_token() -> Path:
    path = token_path()
    if not path.exists() or not path.read_text().strip():
        path.parent.mkdir(parents=True, exist_ok=True)
        # 256 bits, as `ray get-auth-token --generate`; readable by this user only.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(32))
    return path


@dataclass(frozen=True)
class NodePlan:
    name: str
    market: str
    role: str
    cpus: int
    gpus: int
    instance_type: str = LOCAL_WORKER_INSTANCE_TYPE

    def labels(self) -> dict[str, str]:
        return {
            MARKET_LABEL: self.market,
            ROLE_LABEL: self.role,
            NODE_NAME_LABEL: self.name,
            INSTANCE_TYPE_LABEL: self.instance_type,
        }


def plan_nodes(spot: int, on_demand: int, cpus_per_node: int, gpus_per_node: int) -> list[NodePlan]:
    """Head (on-demand, no CPUs for training: it hosts drivers only), then on-demand and spot workers."""
    if spot < 0 or on_demand < 0 or spot + on_demand == 0:
        raise ClusterError("a local cluster needs at least one worker node; use --spot N and/or --on-demand M")
    nodes = [NodePlan("head", "on-demand", HEAD_ROLE, 0, 0, LOCAL_HEAD_INSTANCE_TYPE)]
    nodes += [
        NodePlan(f"on-demand-{i}", "on-demand", WORKER_ROLE, cpus_per_node, gpus_per_node) for i in range(on_demand)
    ]
    nodes += [NodePlan(f"spot-{i}", "spot", WORKER_ROLE, cpus_per_node, gpus_per_node) for i in range(spot)]
    return nodes


@dataclass
class LocalState:
    """What `up` started, persisted to ~/.elastic/local/state.json."""

    marker: str
    temp_dir: str
    ray_address: str
    dashboard_url: str
    s3_endpoint: str
    bucket: str
    logical_gpus: bool
    nodes: list[dict] = field(default_factory=list)
    roots: list[dict] = field(default_factory=list)
    ports: dict = field(default_factory=dict)
    retired: list[str] = field(default_factory=list)  # names of nodes that were reclaimed (elastic preempt)
    node_temp_dirs: list[str] = field(default_factory=list)  # each worker node's own Ray temp dir
    # With --s3-faults: moto's own address. s3_endpoint then names the fault proxy in front of it, so every
    # client of the stack goes through the proxy; its admin routes are at s3_endpoint + /_elastic/faults.
    s3_upstream: str = ""
    auth: str = "token"  # token | none (AUTH_MODES)
    auth_token_path: str = ""
    s3_server: str = "moto"  # a name in s3servers.SERVERS (state files from before the choice ran moto)
    # False from the start of `up` until every node joined and the bucket exists: a stack whose `up` was killed
    # half-way is not a stack to hand out (the next `up` cleans it and starts again). True in older state files.
    complete: bool = True

    @contextmanager
    def environment(self):
        """This stack's environment (env()) in os.environ for a block; the caller's comes back after it."""
        saved = dict(os.environ)
        os.environ.update(self.env())
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def use_storage(self) -> None:
        """From now on this process reads and writes this stack's bucket, unless another S3 endpoint is set."""
        if not os.environ.get("AWS_ENDPOINT_URL"):
            os.environ.update(self.env())
        self.use_ray()

    def auth_env(self) -> dict[str, str]:
        """What Ray's CLI, SDK and processes need to pass this stack's auth: the mode and where the token is."""
        if self.auth == "none":
            return {"RAY_AUTH_MODE": "disabled"}
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": self.auth_token_path}

    def auth_headers(self) -> dict[str, str]:
        """HTTP headers that pass the job API's token check (what Ray's SDK sends)."""
        if self.auth == "none":
            return {}
        return {"Authorization": f"Bearer {Path(self.auth_token_path).read_text().strip()}"}

    def use_ray(self) -> None:
        """From now on this process (and what it starts) talks to this stack's Ray with its auth. Call it before
        this process imports Ray: Ray reads RAY_AUTH_MODE once, at import (seen with Ray 2.60's state API)."""
        # RAY_AUTH_TOKEN takes precedence over the token path in Ray: a token for another cluster would be sent.
        os.environ.pop("RAY_AUTH_TOKEN", None)
        os.environ.update(self.auth_env())

    def env(self) -> dict[str, str]:
        """Environment under which Ray's CLI, boto3, s3fs and our drivers talk to this stack."""
        env = {
            # GCS address for `ray status` and ray.init(); the job API address for `ray job` and `ray list`.
            "RAY_ADDRESS": self.ray_address,
            "RAY_API_SERVER_ADDRESS": self.dashboard_url,
            **self.auth_env(),
            "AWS_ENDPOINT_URL": self.s3_endpoint,
            "AWS_ACCESS_KEY_ID": LOCAL_AWS_KEY,
            "AWS_SECRET_ACCESS_KEY": LOCAL_AWS_KEY,
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "ELASTIC_BUCKET": self.bucket,
            ENV_MARKER_VARIABLE: self.marker,
        }
        if self.logical_gpus:
            env["ELASTIC_LOGICAL_GPUS"] = "1"
        return env

    def launched(self) -> list[Launched]:
        return [Launched.from_dict(r) for r in self.roots]

    def to_json(self) -> dict:
        return asdict(self)

    def summary(self) -> dict:
        faults = {"s3_upstream": self.s3_upstream} if self.s3_upstream else {}
        return {
            "ray_address": self.ray_address,
            "gcs_address": self.ray_address,
            "dashboard_url": self.dashboard_url,
            "auth": self.auth,
            "auth_token_path": self.auth_token_path,
            "s3_endpoint": self.s3_endpoint,
            **faults,
            "s3_server": self.s3_server,
            "bucket": self.bucket,
            # Ray's head session lives here: <temp_dir>/session_latest/prom_metrics_service_discovery.json lists
            # every node's metrics endpoint for Prometheus (README: Metrics, dashboards, alerts).
            "temp_dir": self.temp_dir,
            "nodes": [{k: n[k] for k in ("node_id", "name", "market", "role", "cpus", "gpus")} for n in self.nodes],
            "env": self.env(),
        }


def load_state() -> LocalState | None:
    path = state_path()
    if not path.exists():
        return None
    return LocalState(**json.loads(path.read_text()))


def save_state(state: LocalState) -> None:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state.to_json(), indent=2))
    tmp.replace(path)


@contextmanager
def state_lock():
    """Serialises read-modify-write of the state file (a node added while another is being killed)."""
    path = state_path().with_suffix(".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def is_running(state: LocalState) -> bool:
    return state.complete and head_alive(state)


def head_alive(state: LocalState) -> bool:
    return any(root.process() is not None for root in state.launched() if root.role == "head")


def running_state() -> LocalState | None:
    """The local stack's state if it is up, else None."""
    state = load_state()
    return state if state is not None and is_running(state) else None


def use_stack_auth(targets_elsewhere: bool = False) -> LocalState | None:
    """Before this process imports Ray: when the running local stack is the cluster it will talk to (no
    RAY_ADDRESS, or the stack's, and no other target given), take the stack's auth mode and token. Ray reads
    RAY_AUTH_MODE once, when it is imported, so setting it later is too late."""
    state = running_state()
    if state is None or targets_elsewhere:
        return state
    if os.environ.get("RAY_ADDRESS") in (None, "", state.ray_address):
        state.use_ray()
    return state
