"""The embedded local cluster: a Ray head, simulated spot and on-demand worker nodes, and an S3 endpoint.

Each node is its own raylet (`ray start --block`), labeled exactly as the cloud cluster configs label real
nodes (`market`, `elastic-role`), so jobs select nodes the same way here and on a cloud. The S3 endpoint is
SeaweedFS (on disk under the stack's home, so objects outlive `down`) or moto's server (local.s3servers).
Ray's token auth is on, with a token kept in the stack's home. Everything outlives the command that started it; the state file records what was started so
`down` stops exactly that.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from elastic.errors import ClusterError
from elastic.local import processes, s3servers
from elastic.local.exports import forget_stale
from elastic.local.ports import free_port
from elastic.local.processes import Launched
from elastic.local.readiness import (
    ExitedAtStart,
    NodeStartTimedOut,
    logs_dir,
    wait_for_job_api,
    wait_for_nodes,
    wait_for_port,
)
from elastic.local.state import (
    AUTH_MODES,
    DEFAULT_BUCKET,
    LOCAL_AWS_KEY,
    LOCAL_HEAD_INSTANCE_TYPE,
    LOCAL_WORKER_INSTANCE_TYPE,
    OBJECT_STORE_BYTES,
    LocalState,
    NodePlan,
    ensure_token,
    head_alive,
    home_dir,
    is_running,
    load_state,
    plan_nodes,
    running_state,
    save_state,
    state_lock,
    state_path,
    token_path,
)

# The stack's facade: callers use `stack.running_state()`, `stack.LocalState` and the like from here.
__all__ = [
    "AUTH_MODES",
    "DEFAULT_BUCKET",
    "LOCAL_AWS_KEY",
    "LOCAL_HEAD_INSTANCE_TYPE",
    "LOCAL_WORKER_INSTANCE_TYPE",
    "OBJECT_STORE_BYTES",
    "LocalState",
    "NodePlan",
    "add_node",
    "down",
    "ensure_token",
    "free_port",
    "home_dir",
    "is_running",
    "load_state",
    "plan_nodes",
    "running_state",
    "save_state",
    "state_lock",
    "state_path",
    "status",
    "token_path",
    "up",
]
from elastic.placement.labels import (
    HEAD_ROLE,
    MARKETS,
    WORKER_ROLE,
)

_log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------------
# up

METRICS_REPORT_MS = 2000
# Every simulated node runs Ray's per-node daemons, and here they all share one machine's cores with the runs:
# each node's dashboard agent walks the processes of the machine every 5 s for its node stats, and the head's
# autoscaler monitor recomputes the cluster's status every 5 s for an autoscaler the local stack does not have.
# In a CI run of the test suite (two stacks of 4-7 nodes at once on 2 cores), the agents took 13% of all CPU and
# the monitors 8%: slowed to every 15 s here (node stats and `ray status` up to 15 s old; the runs' own metrics
# keep METRICS_REPORT_MS).
QUIETER_NODE_DAEMONS = {"REPORTER_UPDATE_INTERVAL_MS": "15000", "AUTOSCALER_UPDATE_INTERVAL_S": "15"}
# `ray start` gives a raylet a fixed 30 s to register; under load it can miss it, and a second start usually joins.
# On a saturated machine (a CI run at a load of ~18 on 2 cores) three starts in a row were seen to miss it.
NODE_START_ATTEMPTS = 5
S3_START_ATTEMPTS = 3


def up(
    spot: int = 3,
    on_demand: int = 1,
    gpus_per_node: int = 0,
    cpus_per_node: int = 1,
    bucket: str = DEFAULT_BUCKET,
    timeout: float = 120.0,
    auth: str = "token",
    s3: str = s3servers.DEFAULT_SERVER,
    s3_faults: bool = False,
    s3_fault_seed: int = 0,
    progress: Callable[[str], None] = lambda step: None,
) -> LocalState:
    """Start the stack, or return it if it is already up. `progress` hears each step as it starts. With
    `s3_faults`, the stack's S3 endpoint is a fault-injecting proxy (elastic.local.s3_faults, seeded with
    `s3_fault_seed`) in front of the S3 server; it injects nothing until told to over its admin routes."""
    with _up_lock():  # a second `up` waits for the first, then finds its stack
        existing = load_state()
        if existing is not None:
            if is_running(existing):
                return existing
            # A stale state file (machine rebooted, head killed) or an `up` killed half-way: clean it first.
            down()
        if auth not in AUTH_MODES:
            raise ClusterError(f"--auth {auth!r}: use one of {', '.join(AUTH_MODES)}")
        # `up` starts a stack of its own: a shell's exports of an earlier one must not steer its starts and polls.
        forget_stale(None, 'after `up`, run eval "$(elastic local env)" in this shell again')
        plan = plan_nodes(spot, on_demand, cpus_per_node, gpus_per_node)
        options = {"bucket": bucket, "timeout": timeout, "auth": auth, "s3": s3, "progress": progress}
        return _start(plan, gpus_per_node > 0, s3_faults, s3_fault_seed, **options)


def _start(
    plan: list[NodePlan],
    gpus: bool,
    s3_faults: bool,
    s3_fault_seed: int,
    *,
    bucket: str,
    timeout: float,
    auth: str,
    s3: str,
    progress: Callable[[str], None],
) -> LocalState:
    """Start every process of a new stack in order, recording each in the state file as it starts."""
    ray_bin = processes.binary("ray", "ray[default]")
    marker = uuid.uuid4().hex[:12]
    # Short path: Ray's unix sockets live under the temp dir and sockets paths are limited to ~107 bytes.
    temp_dir = tempfile.mkdtemp(prefix=f"elastic-{marker[:6]}-", dir="/tmp")
    logs = logs_dir()
    if logs.exists():
        shutil.rmtree(logs, ignore_errors=True)
    ports = {"gcs": free_port(), "dashboard": free_port(), "s3": free_port(), "client": free_port()}
    if s3_faults:
        ports["s3_faults"] = free_port()
    server_url = f"http://127.0.0.1:{ports['s3']}"
    state = LocalState(
        marker=marker,
        temp_dir=temp_dir,
        ray_address=f"127.0.0.1:{ports['gcs']}",
        dashboard_url=f"http://127.0.0.1:{ports['dashboard']}",
        s3_endpoint=f"http://127.0.0.1:{ports['s3_faults']}" if s3_faults else server_url,
        bucket=bucket,
        logical_gpus=gpus and not _cuda_available(),
        ports=ports,
        s3_upstream=server_url if s3_faults else "",
        auth=auth,
        auth_token_path=str(ensure_token()) if auth == "token" else "",
        s3_server=s3,
        complete=False,
    )
    state.use_ray()  # this process polls the stack's dashboard and state API too
    # Job entrypoints run `python -m elastic`: the stack's processes must find this interpreter first.
    env = {**state.env(), "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    save_state(state)  # first, so `down` can clean up a half-started stack
    try:
        progress(f"S3 endpoint ({s3})")
        _start_s3(state, env, logs, timeout)
        if s3_faults:
            proxy = [sys.executable, "-m", "elastic.local.s3_faults", "--upstream", server_url]
            proxy += ["--port", str(ports["s3_faults"]), "--seed", str(s3_fault_seed)]
            state.roots.append(processes.launch(proxy, "s3-faults", marker, env, logs / "s3-faults.log").to_dict())
            save_state(state)
        head, workers = plan[0], plan[1:]
        progress("Ray head")
        head_root = _start_node(ray_bin, head, state, env, logs)
        state.roots.append(head_root.to_dict())
        save_state(state)
        wait_for_port(ports["gcs"], timeout, "the Ray head's GCS", logs / "head.log")
        wait_for_job_api(state, timeout)
        # Back to normal priority once its raylet has registered (after the agents' start), not before.
        wait_for_nodes(state, [head], timeout)
        processes.normal_priority(head_root, processes.HEAD_NICENESS)
        # One node at a time: on a 2-core machine, raylets started together time out registering.
        for joined, node in enumerate(workers, start=2):
            progress(f"node {node.name} ({node.market})")
            extras = {n["name"]: n for n in state.nodes}  # keep what was added to the nodes joined earlier
            for attempt in range(1, NODE_START_ATTEMPTS + 1):
                launched = _start_node(ray_bin, node, state, env, logs)
                state.roots.append(launched.to_dict())
                save_state(state)
                try:
                    joined_nodes = wait_for_nodes(state, plan[:joined], timeout)
                    processes.normal_priority(launched)
                    break
                except NodeStartTimedOut as err:
                    if attempt == NODE_START_ATTEMPTS:
                        raise
                    _log.warning("%s; starting it again (attempt %d)", err, attempt + 1)
                    _forget_attempt(state, launched, logs / f"{node.name}.log", attempt)
            state.nodes = [{**extras.get(n["name"], {}), **n} for n in joined_nodes]
            if node.market == "spot":
                _start_spot_daemons(state.nodes[-1], state, env, logs, timeout)
                save_state(state)
        progress(f"bucket {bucket}")
        if s3_faults:
            wait_for_port(ports["s3_faults"], timeout, "the S3 fault proxy", logs / "s3-faults.log")
        _create_bucket(state, timeout)
        state.complete = True
        save_state(state)
        return state
    except BaseException:
        down()
        raise


def _start_s3(state: LocalState, env: dict, logs: Path, timeout: float) -> None:
    """The S3 server, listening before anything that uses it starts. One that exits first (a port of its own
    taken between our probe and its bind) is started again on other ports, its S3 port kept: the stack's
    environment names it already."""
    data = home_dir() / "local" / "s3" / state.s3_server
    for attempt in range(1, S3_START_ATTEMPTS + 1):
        argv = s3servers.command(state.s3_server, state.ports["s3"], data, free_port)
        launched = processes.launch(argv, "s3", state.marker, env, logs / "s3.log")
        state.roots.append(launched.to_dict())
        save_state(state)
        try:
            wait_for_port(state.ports["s3"], timeout, "the local S3 server", logs / "s3.log", launched)
            return
        except ExitedAtStart as err:
            if attempt == S3_START_ATTEMPTS:
                raise
            _log.warning("%s; starting it again (attempt %d)", err, attempt + 1)
            _forget_attempt(state, launched, logs / "s3.log", attempt)


def _forget_attempt(state: LocalState, launched: Launched, log: Path, attempt: int) -> None:
    """A start that failed: its processes gone, out of the state; its log kept beside as LOG.N, so the next
    attempt's wait does not read it again."""
    processes.kill_trees([launched])
    state.roots = [r for r in state.roots if r["pid"] != launched.pid]
    log.replace(log.with_name(f"{log.name}.{attempt}"))


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
        f"--node-manager-port={free_port()}",
        f"--object-manager-port={free_port()}",
        f"--metrics-export-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}",
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
    # Ray's processes export metrics every 10 s by default; a local run lives seconds, and a worker's series
    # would often leave with it unseen. Every 2 s here (Ray's floor is 1 s), what a test's Prometheus scrapes.
    env = {**env, "RAY_metrics_report_interval_ms": str(METRICS_REPORT_MS), **QUIETER_NODE_DAEMONS}
    return processes.launch(args, node.name, state.marker, env, logs / f"{node.name}.log", raised_priority=True)


def _start_spot_daemons(node: dict, state: LocalState, env: dict, logs: Path, timeout: float) -> None:
    """What a spot VM on a cloud has beside Ray: a metadata endpoint that announces reclaims (AWS's IMDSv2
    protocol, served by elastic.local.metadata_server) and the `elastic watch-preemption` daemon polling it, which
    drains this node when `elastic preempt` announces a reclaim. Recorded on the node and in the roots, so
    `preempt` kills them with the node and `down` stops them."""
    port = free_port()
    name = node["name"]
    metadata = processes.launch(
        [sys.executable, "-m", "elastic.local.metadata_server", "--provider", "aws", "--port", str(port)],
        f"metadata-{name}",
        state.marker,
        env,
        logs / f"metadata-{name}.log",
    )
    state.roots.append(metadata.to_dict())
    wait_for_port(port, timeout, f"the metadata endpoint of {name}", logs / f"metadata-{name}.log")
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


def _create_bucket(state: LocalState, timeout: float) -> None:
    """Create the bucket unless a persistent endpoint kept it from the last `up`; straight on the server, since
    a fault proxy in front of it may be injecting."""
    s3servers.create_bucket(state.s3_upstream or state.s3_endpoint, state.bucket, LOCAL_AWS_KEY, timeout)


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
    state.use_ray()  # this process polls the stack's dashboard
    env = {**state.env(), "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    for attempt in range(1, NODE_START_ATTEMPTS + 1):
        try:
            joined, node = _add_one_node(state, market, cpus, gpus, env, timeout)
            break
        except NodeStartTimedOut as err:
            if attempt == NODE_START_ATTEMPTS:
                raise
            _log.warning("%s; starting another (attempt %d)", err, attempt + 1)
            state = load_state() or state
    daemons = LocalState(**{**asdict(state), "roots": []})
    if market == "spot":
        _start_spot_daemons(joined, daemons, env, logs_dir(), timeout)
    with state_lock():
        state = load_state() or state
        state.nodes.append(joined)
        state.roots.extend(daemons.roots)
        save_state(state)
    return joined


def _add_one_node(state: LocalState, market: str, cpus: int, gpus: int, env: dict, timeout: float):
    """Start a node under a fresh name and wait for it; one that never joins is taken back out (its name retired),
    so later add-node calls do not trip over its dead root."""
    # A reclaimed node's name is never reused: Ray may still list the dead node under it for a while.
    taken = {n["name"] for n in state.nodes} | {r["role"] for r in state.roots} | set(state.retired)
    index = next(i for i in range(len(taken) + 1) if f"{market}-{i}" not in taken)
    node = NodePlan(f"{market}-{index}", market, WORKER_ROLE, cpus, gpus)
    launched = _start_node(processes.binary("ray", "ray[default]"), node, state, env, logs_dir())
    node_temp = state.node_temp_dirs[-1]
    with state_lock():  # first, so `down` stops it even if it never joins
        state = load_state() or state
        state.roots.append(launched.to_dict())
        state.node_temp_dirs.append(node_temp)
        save_state(state)
    try:
        joined = wait_for_nodes(state, [node], timeout)[0]
        processes.normal_priority(launched)
        return joined, node
    except ClusterError:
        processes.kill_trees([launched])
        with state_lock():
            state = load_state() or state
            state.roots = [r for r in state.roots if r["role"] != node.name]
            state.retired = [*state.retired, node.name]
            save_state(state)
        raise


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
    if not state.complete:
        return {"running": False, "starting": head_alive(state)}
    alive = {root.role: root.process() is not None for root in state.launched()}
    return {"running": is_running(state), "processes": alive, **state.summary()}


# ---------------------------------------------------------------------------------------------------------
# helpers


@contextmanager
def _up_lock():
    path = home_dir() / "local" / "up.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released by the kernel if this process is killed
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cuda_available() -> bool:
    try:
        import torch  # optional here, and slow to import: only to tell whether CUDA is there

        return torch.cuda.is_available()
    except ImportError:
        return False
