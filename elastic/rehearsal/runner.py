"""`elastic cluster rehearse`: a `ray up` config's node life cycle, played on this host.

Phases (each timed and reported):
1. servers: the stand-ins for the cloud: an S3 endpoint (the local stack's SeaweedFS) and a metadata server
   speaking the config's cloud's protocol for the spot node;
2. file_mounts: copied to each node's HOME as `ray up` would (the laptop's ~/.ray/auth_token, the checkout);
3. head: setup_commands, head_setup_commands, head_start_ray_commands in a fresh HOME, with a fresh venv;
4. spot, on-demand: the worker commands of one spot type and one on-demand type, with their labels and
   resources, sharing the head's venv (one install per rehearsal); the spot node's watcher starts;
5. watcher: the spot node's watcher is killed and must come back (its unit restarts it);
6. submit: jobs/digits_ddp.yaml through the job API with the config's token auth (spot-first);
7. reclaim: once the run has committed a checkpoint, the spot node's metadata server announces a reclaim; the
   node is killed when the notice runs out;
8. finish: the run ends SUCCEEDED on the on-demand node; `lost_steps` and preemptions from its ledger.

Left out: `ray up` itself (the cloud's API; the moto test covers the AWS bootstrap) and the autoscaler.
Everything started carries one marker variable and is stopped at the end, after a failure or Ctrl-C too.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from elastic.local import processes, s3servers
from elastic.local.metadata_server import ADMIN_PREFIX, post_admin
from elastic.local.ports import free_port, port_is_free
from elastic.local.state import LOCAL_AWS_KEY
from elastic.rehearsal import nodes as node_ops
from elastic.rehearsal import shims
from elastic.rehearsal.plan import (
    HEAD,
    ON_DEMAND,
    SPOT,
    PlanError,
    PortMap,
    file_mounts,
    listener_flags,
    pick_node_types,
    plan_node,
    rsync_excludes,
)
from elastic.rehearsal.report import Phase, RehearsalFailed, Report

log = logging.getLogger("elastic.rehearsal")

BUCKET = "elastic"
JOB = "jobs/digits_ddp.yaml"
VENV = "elastic-venv"  # in each node's HOME: where the configs' setup commands install elastic
# The node dies this long after the notice. AWS's notice says when (a 2-minute notice is shortened here to keep
# the rehearsal short); GCP's `preempted` flag does not, and its ~30 s is what every watcher plans for.
RECLAIM_NOTICE_SECONDS = {"aws": 12.0, "gcp": 30.0}
JOB_TIMEOUT_SECONDS = 900.0


def rehearse(
    config_path: Path,
    keep: bool = False,
    s3: str = "seaweedfs",
    progress: Callable[[str], None] = log.info,
    venv: Path | None = None,
) -> Report:
    """Raises PlanError (before starting anything) for a config that cannot be rehearsed. `venv`: a
    virtualenv linked in as every node's ~/elastic-venv (a machine image with it baked in)."""
    import yaml

    config = yaml.safe_load(config_path.read_text())
    if not isinstance(config, dict):
        raise PlanError(f"{config_path} is not a `ray up` cluster config (a YAML mapping)")
    provider = str((config.get("provider") or {}).get("type", ""))
    if provider not in ("aws", "gcp"):
        raise PlanError(f"provider {provider!r}: a rehearsal plays `ray up` configs for aws and gcp")
    pick_node_types(config)
    if venv is not None and not (venv / "bin" / "python").exists():
        raise PlanError(f"--venv {venv}: no bin/python there; make one with `python3 -m venv {venv}`")
    report = Report(str(config_path), provider)
    work = Path(tempfile.mkdtemp(prefix="elastic-rehearsal-"))
    rehearsal = _Rehearsal(config, provider, work, report, s3, progress, venv)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        rehearsal.run()
    except (RehearsalFailed, node_ops.NodeCommandFailed) as err:
        report.error = str(err)
    except KeyboardInterrupt:
        report.error = "interrupted"
    except Exception as err:  # a bug or an unforeseen failure: reported, and everything still stopped
        trace = work / "logs" / "rehearsal-error.log"
        trace.parent.mkdir(parents=True, exist_ok=True)
        trace.write_text(traceback.format_exc())
        report.error = f"{type(err).__name__}: {err} (traceback: {trace})"
    finally:
        signal.signal(signal.SIGTERM, previous)
        stopped = rehearsal.stop_everything()
        progress(f"stopped the {stopped} processes it started")
        if keep or not report.ok:
            report.workdir = str(work)  # the nodes' Ray logs stay in their temp dirs, named in the node logs
        else:
            shutil.rmtree(work, ignore_errors=True)
            rehearsal.remove_temp_dirs()
    return report


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


class _Rehearsal:
    def __init__(
        self, config: dict, provider: str, work: Path, report: Report, s3: str, progress, venv: Path | None = None
    ):
        self.config, self.provider, self.work, self.report, self.s3 = config, provider, work, report, s3
        self.progress, self.venv = progress, venv
        self.marker = f"rehearsal-{uuid.uuid4().hex[:12]}"
        self.roots: list[processes.Launched] = []
        self.laptop_home = work / "laptop"
        self.state_dir = work / "state"
        self.ports = PortMap(free_port)
        self.nodes: dict[str, node_ops.RehearsedNode] = {}
        self.token = ""
        self.s3_endpoint = ""
        self.metadata_url = ""

    @contextmanager
    def phase(self, name: str) -> Iterator[Phase]:
        phase = Phase(name)
        self.report.phases.append(phase)
        started = time.monotonic()
        self.progress(f"{name}...")
        try:
            yield phase
            phase.ok = True
        finally:
            phase.seconds = time.monotonic() - started
            self.progress(f"{name}: {'ok' if phase.ok else 'FAILED'} in {phase.seconds:.1f} s")

    def run(self) -> None:
        head_type, spot_type, on_demand_type = pick_node_types(self.config)
        with self.phase("servers") as phase:
            self._start_servers(phase)
        with self.phase("file_mounts") as phase:
            self._make_nodes(head_type, spot_type, on_demand_type)
            mounts = {}
            for role, node in self.nodes.items():
                mounts[role] = node_ops.copy_file_mounts(
                    file_mounts(self.config),
                    node.home,
                    self.laptop_home,
                    Path.cwd(),
                    rsync_excludes(self.config),
                )
            phase.detail["copied"] = mounts[HEAD]
        head = self.nodes[HEAD]
        if self.venv is not None:  # baked into the image: the config's `test -x ~/elastic-venv/bin/python` finds it
            (head.home / VENV).symlink_to(self.venv.resolve())
        with self.phase("head") as phase:
            phase.detail["commands"] = self._run_node(head)
            self._wait_for_job_api()
            self._wait_for_node(head)
            # The head's session keeps a raised share, as a head with cores of its own (the local stack's too).
            node_ops.back_to_normal_priority(HEAD, self.marker, processes.HEAD_NICENESS)
        self._share_venv()
        for role in (SPOT, ON_DEMAND):
            with self.phase(role) as phase:
                phase.detail["commands"] = self._run_node(self.nodes[role])
                phase.detail["labels"] = self._wait_for_node(self.nodes[role])
                node_ops.back_to_normal_priority(role, self.marker)
        with self.phase("watcher") as phase:
            phase.detail.update(self._kill_the_watcher())
        with self.phase("submit") as phase:
            submission = self._submit()
            phase.detail["run"] = self.report.run
        with self.phase("reclaim") as phase:
            phase.detail.update(self._reclaim_the_spot_node(submission))
        with self.phase("finish") as phase:
            phase.detail.update(self._finish(submission))
        self.report.rewrites = {
            role: list(dict.fromkeys(r for c in node.commands for r in c.rewrites)) for role, node in self.nodes.items()
        }

    # -- servers and nodes ------------------------------------------------------------------------------

    def _launch(self, args: list[str], role: str, env: dict | None = None) -> processes.Launched:
        launched = processes.launch(args, role, self.marker, env or {}, self.work / "logs" / f"{role}.log")
        self.roots.append(launched)
        return launched

    def _start_servers(self, phase: Phase) -> None:
        port = free_port()
        server = s3servers.server(self.s3)
        binary = processes.binary(server.binary, server.package)
        # `weed mini` takes its one identity from these at start (as the local stack's does): without it,
        # signed multipart uploads are refused even though its auth is off.
        keys = {"AWS_ACCESS_KEY_ID": LOCAL_AWS_KEY, "AWS_SECRET_ACCESS_KEY": LOCAL_AWS_KEY}
        self._launch(s3servers.command(self.s3, port, self.work / "s3", free_port), "s3", keys)
        self.s3_endpoint = f"http://127.0.0.1:{port}"
        s3servers.create_bucket(self.s3_endpoint, BUCKET, LOCAL_AWS_KEY, timeout=60)
        metadata_port = free_port()
        self._launch(
            [
                sys.executable,
                "-m",
                "elastic.local.metadata_server",
                "--provider",
                self.provider,
                "--port",
                str(metadata_port),
            ],
            "metadata-spot",
        )
        self.metadata_url = f"http://127.0.0.1:{metadata_port}"
        _wait_for_http(f"{self.metadata_url}{ADMIN_PREFIX}state", 30)
        phase.detail.update(s3=f"{self.s3} ({binary})", metadata=self.provider)

    def _make_nodes(self, *types) -> None:
        # The laptop: its Ray token, as `ray get-auth-token --generate` writes it (file_mounts ship it).
        token_path = self.laptop_home / ".ray" / "auth_token"
        token_path.parent.mkdir(parents=True)
        self.token = secrets.token_hex(32)  # 256 bits, as `ray get-auth-token --generate`
        token_path.write_text(self.token)
        token_path.chmod(0o600)
        for node_type in types:
            role = node_type.role
            home = self.work / "nodes" / role
            bin_dir = shims.install(home / node_ops.SHIM_DIR)
            node_ops.fresh_home(home)
            # Ray's unix sockets live under the temp dir: keep its path short.
            temp_dir = Path(tempfile.mkdtemp(prefix=f"el-rh-{role[:4]}-", dir="/tmp"))
            node_ports = {flag: free_port() for flag in listener_flags(role)}
            env = {
                "HOME": str(home),
                "USER": os.environ.get("USER", "root"),
                "LANG": "C.UTF-8",
                "PATH": os.pathsep.join([str(bin_dir), shims.SYSTEM_PATH]),
                "AWS_ENDPOINT_URL": self.s3_endpoint,
                "AWS_ACCESS_KEY_ID": LOCAL_AWS_KEY,
                "AWS_SECRET_ACCESS_KEY": LOCAL_AWS_KEY,
                "AWS_REGION": "us-east-1",
                "AWS_DEFAULT_REGION": "us-east-1",
                "ELASTIC_LOGICAL_GPUS": "1",
                **node_ops.pip_settings(),
                # Each node's units are its own: one node's `systemctl stop elastic-watcher` is not another's.
                shims.STATE_VARIABLE: str(self.state_dir / role),
                processes.MARKER_VARIABLE: self.marker,
                node_ops.NODE_VARIABLE: role,
            }
            if role != HEAD:
                env["RAY_ADDRESS"] = f"127.0.0.1:{self.ports.map(6379)}"
            if role == SPOT:
                env["ELASTIC_METADATA_URL"] = self.metadata_url
            node = node_ops.RehearsedNode(
                node_type, home, temp_dir, self.work / "logs" / f"node-{role}.log", env, node_ports
            )
            node.log_path.parent.mkdir(parents=True, exist_ok=True)
            node.commands = plan_node(self.config, node_type, self.ports, node_ports, str(temp_dir), "127.0.0.1")
            self.nodes[role] = node
        for role in self.nodes:
            (self.state_dir / role).mkdir(parents=True, exist_ok=True)

    def _run_node(self, node: node_ops.RehearsedNode) -> list[dict]:
        """Setup commands, then the start commands with every port they bind still free: the ports were
        picked before the setup commands ran (minutes of pip installs), and any other process of this host may
        have bound one since (a CI machine runs other Ray clusters beside the rehearsal)."""
        results = node_ops.run_commands(node, "setup")
        self._reclaim_taken_ports(node)
        return results + node_ops.run_commands(node, "start")

    def _reclaim_taken_ports(self, node: node_ops.RehearsedNode) -> None:
        taken = [flag for flag, port in node.ports.items() if not port_is_free(port)]
        for flag in taken:
            log.info("%s node: port %d (--%s) was taken meanwhile; using another", node.role, node.ports[flag], flag)
            node.ports[flag] = free_port()
        shared = []
        if node.role == HEAD:  # the config's fixed ports (the GCS port among them) are bound by the head
            shared = [fixed for fixed, mapped in self.ports.fixed.items() if not port_is_free(mapped)]
            for fixed in shared:
                log.info(
                    "port %d (for the config's %d) was taken meanwhile; using another", self.ports.fixed[fixed], fixed
                )
                self.ports.fixed[fixed] = free_port()
        if not taken and not shared:
            return
        for other in self.nodes.values() if shared else (node,):
            if other.role != HEAD:
                other.env["RAY_ADDRESS"] = f"127.0.0.1:{self.ports.map(6379)}"
            other.commands = plan_node(
                self.config, other.node_type, self.ports, other.ports, str(other.temp_dir), "127.0.0.1"
            )

    def _share_venv(self) -> None:
        """Workers use the head's venv (one install per rehearsal): their `test -x ~/elastic-venv/bin/python`
        finds it, and their pip install of the checkout finds its requirements met."""
        venv = self.nodes[HEAD].home / VENV
        for role in (SPOT, ON_DEMAND):
            link = self.nodes[role].home / VENV
            if venv.exists() and not link.exists():
                link.symlink_to(venv)

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.nodes[HEAD].ports['dashboard-port']}"

    def _wait_for_job_api(self, timeout: float = 120.0) -> None:
        if not _wait_for_http(f"{self.dashboard_url}/api/version", timeout, self.token):
            raise RehearsalFailed(f"the head's job API did not answer within {timeout:.0f} s")

    def _wait_for_node(self, node: node_ops.RehearsedNode, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            node.node_id = node.node_id or node_ops.find_node_id(node.temp_dir)
            try:
                alive = node_ops.alive_nodes(self.dashboard_url, self.token)
            except OSError:
                alive = []
            for seen in alive:
                if seen.get("node_id") == node.node_id:
                    labels = seen.get("labels") or {}
                    missing = {k: v for k, v in node.node_type.labels.items() if labels.get(k) != v}
                    if missing:
                        raise RehearsalFailed(f"{node.role} node joined without its labels {missing}")
                    return {k: labels[k] for k in node.node_type.labels}
            time.sleep(1)
        raise RehearsalFailed(f"the {node.role} node did not join the cluster within {timeout:.0f} s")

    # -- the watcher, the run, the reclaim --------------------------------------------------------------

    def _kill_the_watcher(self, timeout: float = 30.0) -> dict:
        """SIGKILL the spot node's watcher: its unit (Restart=always) must start it again."""
        units = self.state_dir / SPOT
        state = _wait_for(lambda: node_ops.unit_state(units, "elastic-watcher"), 30)
        if not state or not state.get("pid"):
            raise RehearsalFailed("the spot node's commands started no elastic-watcher unit")
        try:
            os.kill(state["pid"], signal.SIGKILL)
        except ProcessLookupError:
            raise RehearsalFailed(
                f"the spot node's watcher had already exited (log: {self.nodes[SPOT].temp_dir}/session_latest/logs)"
            ) from None
        killed_at = time.monotonic()
        again = _wait_for(
            lambda: (s := node_ops.unit_state(units, "elastic-watcher")) and s["starts"] > state["starts"], timeout
        )
        if not again:
            raise RehearsalFailed(f"the killed watcher was not restarted within {timeout:.0f} s")
        return {"killed_pid": state["pid"], "restarted_after_s": round(time.monotonic() - killed_at, 1)}

    def _laptop_env(self) -> dict:
        """The laptop's side: its HOME (the token Ray's SDK reads), token auth, the bucket's endpoint; no local
        stack of its own (ELASTIC_HOME is empty)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_"))}
        env.update(
            HOME=str(self.laptop_home),
            ELASTIC_HOME=str(self.laptop_home / ".elastic"),
            RAY_AUTH_MODE="token",
            AWS_ENDPOINT_URL=self.s3_endpoint,
            AWS_ACCESS_KEY_ID=LOCAL_AWS_KEY,
            AWS_SECRET_ACCESS_KEY=LOCAL_AWS_KEY,
            AWS_REGION="us-east-1",
        )
        env[processes.MARKER_VARIABLE] = self.marker  # the submit it follows is stopped with the rest
        return env

    def _submit(self) -> subprocess.Popen:
        suffix = f"rehearsal-{uuid.uuid4().hex[:6]}"
        self.report.run = f"digits-ddp-{suffix}"
        args = [
            sys.executable, "-m", "elastic", "submit", JOB, "--address", self.dashboard_url, "--suffix", suffix,
            "--set", f"checkpoint.uri=s3://{BUCKET}/runs", "--set", "config.epochs=120",
            "--set", "workers.market=spot-first", "--set", "workers.spot_wait_seconds=5",
            "--follow", "--json",
        ]  # fmt: skip
        out = open(self.work / "logs" / "job.log", "w")
        return subprocess.Popen(args, env=self._laptop_env(), stdout=out, stderr=subprocess.STDOUT)

    def _committed_step(self) -> int | None:
        from elastic.checkpoint.store import CheckpointStore

        with _environment(self._laptop_env()):
            latest = CheckpointStore(f"s3://{BUCKET}/runs/{self.report.run}").latest_committed()
        return latest.step if latest else None

    def _reclaim_the_spot_node(self, submission: subprocess.Popen, timeout: float = 300.0) -> dict:
        step = _wait_for(lambda: submission.poll() is None and self._committed_step(), timeout, poll=2.0)
        if not step:
            raise RehearsalFailed(f"the run committed no checkpoint within {timeout:.0f} s (log: {self._job_log()})")
        notice = RECLAIM_NOTICE_SECONDS[self.provider]
        post_admin(self.metadata_url, "reclaim", notice=f"{notice:g}")
        time.sleep(notice)
        killed = node_ops.kill_node(SPOT, self.marker)
        return {"after_step": step, "notice_s": notice, "processes_killed": killed}

    def _job_log(self) -> Path:
        return self.work / "logs" / "job.log"

    def _finish(self, submission: subprocess.Popen) -> dict:
        try:
            submission.wait(timeout=JOB_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            submission.kill()
            raise RehearsalFailed(f"the run did not end within {JOB_TIMEOUT_SECONDS:.0f} s") from None
        lines = self._job_log().read_text().strip().splitlines()
        ended = _last_json(lines)
        if not ended or ended.get("status") != "SUCCEEDED":
            raise RehearsalFailed(
                f"the run ended {ended.get('status') if ended else 'without a status'} (log: {self._job_log()})"
            )
        proc = subprocess.run(
            [sys.executable, "-m", "elastic", "report", self.report.run, "--root", f"s3://{BUCKET}/runs", "--json"],
            env=self._laptop_env(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RehearsalFailed(f"elastic report failed: {proc.stderr.strip()[-300:]}")
        summary = json.loads(proc.stdout)
        self.report.lost_steps = int(summary["lost_steps"])
        self.report.preemptions = int(summary["preemptions"])
        if self.report.preemptions != 1:
            raise RehearsalFailed(f"the run saw {self.report.preemptions} preemptions; the reclaim should make one")
        return {"status": ended["status"], "goodput": summary.get("goodput")}

    def stop_everything(self) -> int:
        """Every process carrying the rehearsal's marker (nodes, units, servers), and the nodes' temp dirs."""
        return processes.stop(self.marker, self.roots)

    def remove_temp_dirs(self) -> None:
        for node in self.nodes.values():
            shutil.rmtree(node.temp_dir, ignore_errors=True)


def _wait_for(check, timeout: float, poll: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(poll)


def _wait_for_http(url: str, timeout: float, token: str | None = None) -> bool:
    def answers() -> bool:
        try:
            node_ops.http_json(url, token or "", timeout=5)
            return True
        except (OSError, ValueError):
            return False

    return bool(_wait_for(answers, timeout))


def _last_json(lines: list[str]) -> dict | None:
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


@contextmanager
def _environment(env: dict) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
