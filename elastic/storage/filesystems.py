"""Checkpoint URIs -> filesystems.

fsspec (s3fs, gcsfs, adlfs) for our own reads and writes and torch DCP; pyarrow for Ray Train's storage. The S3
endpoint, region and credentials come from the standard AWS environment (AWS_ENDPOINT_URL, AWS_REGION, the
credential chain), so the same code talks to AWS, to MinIO or to the local moto endpoint. Google Cloud Storage
uses Google's default credentials; Azure Blob Storage takes its account from AZURE_STORAGE_ACCOUNT_NAME and its
credentials from the Azure environment (adlfs reads both).

Each object store's fsspec package is an extra (`elastic-train[gcp]`, `elastic-train[azure]`; s3fs is always
installed); a URI whose package is missing fails with one line naming the extra.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from urllib.parse import urlparse

import fsspec

from elastic.errors import StorageError

# Object-store scheme -> (the fsspec package that implements it, the extra that installs it).
FILESYSTEM_PACKAGES: dict[str, tuple[str, str]] = {
    "s3": ("s3fs", ""),  # a core dependency
    "gs": ("gcsfs", "gcp"),
    "gcs": ("gcsfs", "gcp"),
    "az": ("adlfs", "azure"),
    "abfs": ("adlfs", "azure"),
    "abfss": ("adlfs", "azure"),
}
_OBJECT_STORE_SCHEMES = set(FILESYSTEM_PACKAGES)
# pyarrow has no az:// and needs an explicit account for abfs://: Ray Train reaches Azure through adlfs.
_PYARROW_THROUGH_FSSPEC = {"az", "abfs", "abfss"}
# Every S3 request of ours and DCP's is retried by the AWS client on 500/503 SlowDown, throttling and
# dropped connections, in botocore's "standard" mode: up to this many attempts in all, with jittered
# exponential backoff (1, 2, 4, 8 s at most). (Ray Train's pyarrow client keeps pyarrow's own standard retries:
# a retry strategy does not survive the pickling that ships the filesystem to the workers.)
S3_ATTEMPTS = 5


@dataclass(frozen=True)
class StorageLocation:
    """A parsed storage URI: scheme ('' for a local path), bucket (netloc) and key/path below it."""

    uri: str
    scheme: str
    bucket: str
    key: str

    @property
    def is_object_store(self) -> bool:
        return self.scheme in _OBJECT_STORE_SCHEMES

    def child(self, *parts: str) -> StorageLocation:
        return parse_uri("/".join([self.uri.rstrip("/"), *[p.strip("/") for p in parts]]))

    @property
    def path(self) -> str:
        """Path without scheme, as fsspec and pyarrow filesystems take it."""
        if self.scheme in ("", "file"):
            return self.key
        return f"{self.bucket}/{self.key}".rstrip("/")


def parse_uri(uri: str) -> StorageLocation:
    if "://" not in uri:  # a plain path: never parsed as a URL ('#' and '?' are legal in file names)
        return StorageLocation(uri=uri, scheme="", bucket="", key=os.path.abspath(uri))
    parsed = urlparse(uri)
    scheme = parsed.scheme
    if scheme in ("", "file"):
        return StorageLocation(uri=uri, scheme=scheme, bucket="", key=os.path.abspath(parsed.path or uri))
    if not parsed.netloc:
        raise StorageError(f"{uri}: no bucket in the URI; use {scheme}://BUCKET/PREFIX")
    return StorageLocation(uri=uri, scheme=scheme, bucket=parsed.netloc, key=parsed.path.lstrip("/"))


def require_filesystem(uri: str) -> None:
    """One line naming the extra to install when the URI's filesystem package is missing."""
    location = parse_uri(uri)
    if location.scheme not in FILESYSTEM_PACKAGES:
        return  # local paths, and any other fsspec scheme, which fsspec itself resolves
    package, extra = FILESYSTEM_PACKAGES[location.scheme]
    if importlib.util.find_spec(package) is None:
        install = f"pip install 'elastic-train[{extra}]'" if extra else f"pip install {package}"
        raise StorageError(
            f"{uri}: {location.scheme}:// needs the {package} package, which is not installed; {install}"
        )


def s3_endpoint() -> str | None:
    """The S3 endpoint from the standard AWS variables (None means AWS itself)."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def s3_region() -> str:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


def fsspec_options(location: StorageLocation) -> dict:
    """Keyword options for fsspec/s3fs; credentials are left to botocore's standard chain."""
    if location.scheme != "s3":
        return {}
    client_kwargs: dict = {"region_name": s3_region()}
    if s3_endpoint():
        client_kwargs["endpoint_url"] = s3_endpoint()
    retries = {"mode": "standard", "total_max_attempts": S3_ATTEMPTS}
    return {"client_kwargs": client_kwargs, "config_kwargs": {"retries": retries}}


def fsspec_filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """An fsspec filesystem for the URI and the path inside it."""
    location = parse_uri(uri)
    require_filesystem(uri)
    protocol = location.scheme if location.scheme not in ("", "file") else "file"
    return fsspec.filesystem(protocol, **fsspec_options(location)), location.path


def pyarrow_filesystem(uri: str):
    """A pyarrow filesystem and path: for Ray Train's RunConfig(storage_filesystem=..., storage_path=...) and
    the streaming reader's row-group reads (for S3, pyarrow's C++ client, which reads outside the GIL)."""
    # Imported here: the CLI's storage checks should start fast.
    import pyarrow.fs as pafs

    location = parse_uri(uri)
    if location.scheme in ("", "file"):
        return pafs.LocalFileSystem(), location.path
    require_filesystem(uri)
    if location.scheme in _PYARROW_THROUGH_FSSPEC:
        fs, path = fsspec_filesystem(uri)
        return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path
    if location.scheme != "s3":
        # gs:// and others: pyarrow resolves them from the URI with its own credential chain.
        fs, path = pafs.FileSystem.from_uri(uri)
        return fs, path
    kwargs: dict = {"region": s3_region()}
    endpoint = s3_endpoint()
    if endpoint:
        parsed = urlparse(endpoint)
        kwargs["endpoint_override"] = parsed.netloc or parsed.path
        kwargs["scheme"] = parsed.scheme or "https"
    # Explicit keys only when the environment holds them; otherwise pyarrow uses the AWS default chain
    # (instance profile on a cloud node), so no secret ever passes through our code or logs.
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        kwargs["access_key"] = os.environ["AWS_ACCESS_KEY_ID"]
        kwargs["secret_key"] = os.environ["AWS_SECRET_ACCESS_KEY"]
        if os.environ.get("AWS_SESSION_TOKEN"):
            kwargs["session_token"] = os.environ["AWS_SESSION_TOKEN"]
    return pafs.S3FileSystem(**kwargs), location.path


def check_storage(uri: str) -> None:
    """Fail early, with one line and the fix, when the checkpoint URI cannot be used."""
    location = parse_uri(uri)
    if not location.is_object_store:
        return
    require_filesystem(uri)
    if location.scheme != "s3":
        return  # other stores are checked by their first write
    fs, _ = fsspec_filesystem(uri)
    where = f" at {s3_endpoint()}" if s3_endpoint() else ""
    try:
        exists = fs.exists(location.bucket)
    except PermissionError:
        raise StorageError(
            f"{uri}: access to bucket '{location.bucket}'{where} is denied; grant the node role s3 access to it"
        ) from None
    except Exception as err:  # botocore/aiohttp errors vary by transport; all mean "cannot reach the store"
        name = type(err).__name__
        if "Credentials" in name:
            raise StorageError(
                f"{uri}: no AWS credentials found; set AWS_PROFILE or AWS_ACCESS_KEY_ID, or run on a node with a role"
            ) from None
        raise StorageError(
            f"{uri}: cannot reach the object store{where} ({name}); check AWS_ENDPOINT_URL and the network"
        ) from None
    if not exists:
        raise StorageError(
            f"{uri}: bucket '{location.bucket}' does not exist{where}; create it "
            f"(aws s3 mb s3://{location.bucket}) or fix checkpoint.uri"
        )
