"""`elastic bench s3`: the local stack's S3 servers side by side, each started fresh on loopback in a temp dir.

For each server: seconds from launch to a bucket created; put and get throughput of the same objects through
s3fs (as checkpoints go up and come back); the server's CPU seconds per GB moved (its process tree's user +
system time over the puts and gets); its peak resident memory; a pyarrow S3FileSystem round trip (Ray Train's
storage path); and, for a server that keeps data on disk, whether an object survives a restart.
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from elastic.environment import overridden
from elastic.local import s3servers
from elastic.local.ports import free_port
from elastic.local.stack import LOCAL_AWS_KEY
from elastic.storage import pyarrow_filesystem

logger = logging.getLogger(__name__)

MB = 1024 * 1024
BUCKET = "bench"


@dataclass
class ServerFigures:
    server: str
    persistent: bool
    start_seconds: float
    put_mb_s: float
    get_mb_s: float
    cpu_seconds_per_gb: float  # the server's, puts and gets together
    peak_rss_mb: float
    pyarrow_round_trip: bool
    kept_across_restart: bool | None  # None: an in-memory server, not tried


class _Server:
    """One S3 server process we started, with its CPU and memory readable from its process tree."""

    def __init__(self, name: str, data: Path, log: Path):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        argv = s3servers.command(name, self.port, data, free_port)
        env = {**os.environ, "AWS_ACCESS_KEY_ID": LOCAL_AWS_KEY, "AWS_SECRET_ACCESS_KEY": LOCAL_AWS_KEY}
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.peak_rss = 0

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def cpu_seconds(self) -> float:
        total = 0.0
        for proc in self.tree():
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.NoSuchProcess:
                continue
        return total

    def sample_memory(self) -> None:
        rss = 0
        for proc in self.tree():
            try:
                rss += proc.memory_info().rss
            except psutil.NoSuchProcess:
                continue
        self.peak_rss = max(self.peak_rss, rss)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


def _client(endpoint: str):
    import boto3  # as everywhere in the CLI: only once a benchmark runs

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=LOCAL_AWS_KEY,
        aws_secret_access_key=LOCAL_AWS_KEY,
    )


def _wait_for_bucket(endpoint: str, timeout: float) -> None:
    s3servers.create_bucket(endpoint, BUCKET, LOCAL_AWS_KEY, timeout, poll_seconds=0.05)


def _filesystem(endpoint: str):
    import s3fs  # as above

    return s3fs.S3FileSystem(
        key=LOCAL_AWS_KEY,
        secret=LOCAL_AWS_KEY,
        endpoint_url=endpoint,
        client_kwargs={"region_name": "us-east-1"},
        skip_instance_cache=True,
    )


def _timed_transfer(server: _Server, action, objects: int, threads: int) -> tuple[float, float]:
    """Run action(i) for every object on `threads` threads; (seconds, server CPU seconds)."""
    cpu = server.cpu_seconds()
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(action, range(objects)):
            server.sample_memory()
    return time.perf_counter() - start, server.cpu_seconds() - cpu


def _pyarrow_round_trip(endpoint: str) -> bool:
    keys = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": LOCAL_AWS_KEY, "AWS_SECRET_ACCESS_KEY": LOCAL_AWS_KEY}
    with overridden(keys):
        fs, root = pyarrow_filesystem(f"s3://{BUCKET}/pyarrow")
        with fs.open_output_stream(f"{root}/probe.bin") as out:
            out.write(b"elastic" * 1000)
        with fs.open_input_stream(f"{root}/probe.bin") as src:
            return src.read() == b"elastic" * 1000


def measure(name: str, size_mb: float, objects: int, threads: int, folder: Path) -> ServerFigures:
    chosen = s3servers.server(name)
    data, log = folder / name / "data", folder / f"{name}.log"
    data.parent.mkdir(parents=True, exist_ok=True)
    launched = time.perf_counter()
    server = _Server(name, data, log)
    try:
        _wait_for_bucket(server.endpoint, timeout=60)
        start_seconds = time.perf_counter() - launched
        fs = _filesystem(server.endpoint)
        payload = os.urandom(int(size_mb * MB))
        key = lambda i: f"{BUCKET}/objects/{i:04d}"
        put_s, put_cpu = _timed_transfer(server, lambda i: fs.pipe_file(key(i), payload), objects, threads)
        got: list[int] = []
        get_s, get_cpu = _timed_transfer(server, lambda i: got.append(len(fs.cat_file(key(i)))), objects, threads)
        if got != [len(payload)] * objects:
            raise RuntimeError(f"{name}: read back {sorted(set(got))} bytes per object, wrote {len(payload)}")
        total_gb = 2 * objects * size_mb / 1024  # every byte up and down once
        round_trip = _pyarrow_round_trip(server.endpoint)
        peak_rss = server.peak_rss
        kept = None
        if chosen.persistent:
            server.stop()
            server = _Server(name, data, log)
            _wait_for_bucket(server.endpoint, timeout=60)
            kept = len(_filesystem(server.endpoint).cat_file(key(objects - 1))) == len(payload)
        return ServerFigures(
            server=name,
            persistent=chosen.persistent,
            start_seconds=round(start_seconds, 2),
            put_mb_s=round(objects * size_mb / put_s, 1),
            get_mb_s=round(objects * size_mb / get_s, 1),
            cpu_seconds_per_gb=round((put_cpu + get_cpu) / total_gb, 2),
            peak_rss_mb=round(peak_rss / MB, 1),
            pyarrow_round_trip=round_trip,
            kept_across_restart=kept,
        )
    finally:
        server.stop()


def bench_s3(servers: list[str], size_mb: float = 16, objects: int = 32, threads: int = 4) -> dict:
    with tempfile.TemporaryDirectory(prefix="elastic-bench-s3-") as folder:
        figures = []
        for name in servers:
            logger.debug("bench s3: %s", name)
            figures.append(asdict(measure(name, size_mb, objects, threads, Path(folder))))
    return {"size_mb": size_mb, "objects": objects, "threads": threads, "servers": figures}
