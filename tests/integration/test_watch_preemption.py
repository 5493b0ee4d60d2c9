"""The real `elastic watch-preemption` process, reading our AWS metadata server, drains a real Ray node.

A two-node `ray.cluster_utils.Cluster` of its own (head with no CPUs, one worker) in a private temp dir, stopped
through the object that started it. After a spot notice the worker must be draining in Ray, as Ray Train's
preemption poller sees it (`get_draining_nodes`, which `ray.train.get_preemption_info` is built on), with the
notice's deadline less the margin, requested once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray
from auth_helpers import write_token

from elastic.local.metadata_server import MetadataServer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
MARGIN_S = 5
AUTH = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")


@ray.remote(num_cpus=1)
class Busy:
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    # Everything of this cluster (sessions, sockets, and the address file Cluster writes for ray.init("auto"))
    # under a temp dir of its own: never the /tmp/ray of other clusters on the machine.
    temp_dir = tempfile.mkdtemp(prefix="rwatch-", dir="/tmp")
    os.makedirs(os.path.join(temp_dir, "ray"))
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", *AUTH)}
    # Token auth, as the local stack, with the session's token (the watcher, a subprocess, gets the same).
    token = write_token(Path(temp_dir) / "auth_token")
    os.environ.update(RAY_TMPDIR=temp_dir, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    node_args = {"object_store_memory": 80 * 1024 * 1024}
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 0, **node_args})
    try:
        worker = cluster.add_node(num_cpus=1, **node_args)
        cluster.wait_for_nodes()
        # Ray ends an idle node at once when it is drained; a busy one stays DRAINING until its deadline, which
        # is what a training node is. So: an actor holding the worker's CPU (the head has none).
        ray.init(address=cluster.address)
        busy = Busy.remote()
        assert ray.get(busy.node.remote()) == worker.node_id
        yield cluster, worker
    finally:
        ray.shutdown()
        cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(temp_dir, ignore_errors=True)


def watcher_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update({k: os.environ[k] for k in AUTH})  # the cluster fixture's token auth
    return env


def test_without_node_id_several_nodes_on_this_host_is_a_clear_error(cluster):
    # First in the module: both nodes alive. (The local stack passes --node-id for each simulated node.)
    cluster, _ = cluster
    with MetadataServer("aws") as imds:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "elastic",
                "watch-preemption",
                "--provider",
                "aws",
                "--metadata-url",
                imds.url,
                "--address",
                cluster.address,
                "--once",
            ],
            cwd=ROOT,
            env=watcher_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "pass --node-id" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_watcher_drains_the_real_node_once_with_the_notice_deadline_less_the_margin(cluster, tmp_path):
    from ray._raylet import GcsClient

    cluster, worker = cluster
    gcs = GcsClient(address=cluster.address)
    log_path = tmp_path / "watch.log"
    with MetadataServer("aws") as imds, open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "elastic",
                "watch-preemption",
                "--provider",
                "aws",
                "--metadata-url",
                imds.url,
                "--address",
                cluster.address,
                "--node-id",
                worker.node_id,
                "--poll-seconds",
                "0.5",
                "--margin-seconds",
                str(MARGIN_S),
            ],
            cwd=ROOT,
            env=watcher_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for(lambda: "watching aws spot notices" in log_path.read_text(), 20, log_path)
            time.sleep(1.0)
            assert gcs.get_draining_nodes() == {}  # no notice, no drain
            imds.announce_reclaim(30)
            wait_for(lambda: worker.node_id in gcs.get_draining_nodes(), 10, log_path)
            draining = gcs.get_draining_nodes()
            # The notice's time has whole seconds; Ray keeps the deadline in ms.
            assert draining == {worker.node_id: (int(imds.reclaim_at) - MARGIN_S) * 1000}
            time.sleep(2.0)  # four more polls: the notice is still there, the drain is not repeated
            assert proc.poll() is None
            text = log_path.read_text()
            assert text.count("drain accepted by Ray") == 1 and text.count("reclaim notice (aws)") == 1, text
            assert imds.requests["GET /latest/meta-data/spot/instance-action"] >= 6
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def wait_for(condition, timeout: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; watcher log:\n{log_path.read_text() if log_path.exists() else ''}")
        time.sleep(0.1)
