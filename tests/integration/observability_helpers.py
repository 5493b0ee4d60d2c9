"""Real Prometheus and MLflow servers for integration tests, on 127.0.0.1 at free ports with temporary storage.

Prometheus is Debian's `prometheus` package (`make install` installs it): it scrapes a local Ray cluster through
the service-discovery file Ray's head writes into its session folder, with every target's host rewritten to
127.0.0.1 (Ray lists its nodes' metrics agents at the node address). MLflow is `mlflow server` with a sqlite
backend. Both are queried over their HTTP APIs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moto_helpers import free_port, wait_for_port

SERVICE_DISCOVERY_FILE = "prom_metrics_service_discovery.json"
SCRAPE_SECONDS = 2


def service_discovery_file(ray_temp_dir: str, timeout: float = 60.0) -> Path:
    """Ray's head writes it into its session folder (<temp dir>/session_latest/) once the cluster is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(Path(ray_temp_dir).glob(f"session_*/{SERVICE_DISCOVERY_FILE}"))
        if found:
            return found[-1]
        time.sleep(0.5)
    raise RuntimeError(f"Ray wrote no {SERVICE_DISCOVERY_FILE} under {ray_temp_dir} within {timeout:.0f} s")


def prometheus_config(sd_file: Path, rules: list[Path]) -> dict:
    return {
        "global": {"scrape_interval": f"{SCRAPE_SECONDS}s", "evaluation_interval": f"{SCRAPE_SECONDS}s"},
        "rule_files": [str(rule) for rule in rules],
        "scrape_configs": [
            {
                "job_name": "ray",
                "file_sd_configs": [{"files": [str(sd_file)], "refresh_interval": "5s"}],
                # Ray lists each node's agent at the node's address: scrape it on the loopback, same port.
                "relabel_configs": [
                    {
                        "source_labels": ["__address__"],
                        "regex": r"[^:]+:(\d+)",
                        "target_label": "__address__",
                        "replacement": "127.0.0.1:$1",
                    }
                ],
            }
        ],
    }


class Prometheus:
    def __init__(self, url: str):
        self.url = url

    def _get(self, path: str, **params) -> dict:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=30) as response:
            body = json.load(response)
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self._get("/api/v1/query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = SCRAPE_SECONDS) -> list[dict]:
        return self._get("/api/v1/query_range", query=expr, start=start, end=end, step=step)["result"]

    def metric_names(self) -> list[str]:
        return self._get("/api/v1/label/__name__/values")

    def targets_up(self) -> int:
        return sum(1 for t in self._get("/api/v1/targets")["activeTargets"] if t["health"] == "up")

    def rules(self) -> list[dict]:
        return [rule for group in self._get("/api/v1/rules")["groups"] for rule in group["rules"]]


@contextmanager
def running_prometheus(workdir: Path, ray_temp_dir: str, rules: list[Path] = ()) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("prometheus is not installed: `make install` installs Debian's package")
    config = workdir / "prometheus.yml"
    config.write_text(json.dumps(prometheus_config(service_discovery_file(ray_temp_dir), list(rules))))
    port = free_port()
    with open(workdir / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for_port(port, proc)
            yield Prometheus(f"http://127.0.0.1:{port}")
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


class MlflowServer:
    def __init__(self, url: str):
        self.url = url

    def call(self, method: str, path: str, body: dict | None = None, **params) -> dict:
        url = f"{self.url}/api/2.0/mlflow/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.load(response)

    def runs(self, experiment_name: str, filter_string: str = "") -> list[dict]:
        experiment = self.call("GET", "experiments/get-by-name", experiment_name=experiment_name)["experiment"]
        body = {"experiment_ids": [experiment["experiment_id"]], "filter": filter_string, "max_results": 1000}
        return self.call("POST", "runs/search", body).get("runs", [])

    def metric_history(self, run_id: str, key: str) -> list[dict]:
        return self.call("GET", "metrics/get-history", run_id=run_id, metric_key=key, max_results=100000).get(
            "metrics", []
        )


@contextmanager
def running_mlflow(workdir: Path) -> Iterator[MlflowServer]:
    port = free_port()
    binary = Path(sys.executable).parent / "mlflow"
    with open(workdir / "mlflow.log", "wb") as log:
        proc = subprocess.Popen(
            [
                str(binary),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--backend-store-uri",
                f"sqlite:///{workdir / 'mlflow.db'}",
                "--default-artifact-root",
                str(workdir / "artifacts"),
                "--workers",
                "1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for_port(port, proc, timeout=120)
            yield MlflowServer(f"http://127.0.0.1:{port}")
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
