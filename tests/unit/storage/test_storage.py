"""Unit tests for elastic/storage/filesystems.py: URI parsing and filesystem construction, without any I/O."""

from __future__ import annotations

import os

import pyarrow.fs as pafs
import pytest

from elastic.errors import StorageError
from elastic.storage import StorageLocation, check_storage, fsspec_options, parse_uri, pyarrow_filesystem
from elastic.storage import filesystems as storage
from elastic.storage.filesystems import S3_ATTEMPTS

_AWS_VARIABLES = [
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
]


@pytest.fixture(autouse=True)
def clean_aws_environment(monkeypatch):
    for name in _AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    # never let a credential lookup wander off to an instance metadata endpoint
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


# ---------------------------------------------------------------------------------------------------------
# parse_uri


def test_parse_s3_uri():
    location = parse_uri("s3://bucket/a/b")
    assert location == StorageLocation(uri="s3://bucket/a/b", scheme="s3", bucket="bucket", key="a/b")
    assert location.is_object_store
    assert location.path == "bucket/a/b"


def test_parse_s3_bucket_only():
    location = parse_uri("s3://bucket")
    assert (location.bucket, location.key, location.path) == ("bucket", "", "bucket")
    assert parse_uri("s3://bucket/").path == "bucket"


def test_parse_local_absolute_path(tmp_path):
    location = parse_uri(str(tmp_path / "runs"))
    assert location.scheme == ""
    assert location.bucket == ""
    assert location.key == str(tmp_path / "runs")
    assert location.path == str(tmp_path / "runs")
    assert not location.is_object_store


def test_parse_local_relative_path_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    location = parse_uri("runs/x")
    assert location.scheme == ""
    assert location.path == os.path.join(str(tmp_path), "runs", "x")


def test_parse_file_uri(tmp_path):
    location = parse_uri(f"file://{tmp_path}/runs")
    assert location.scheme == "file"
    assert location.bucket == ""
    assert location.key == f"{tmp_path}/runs"
    assert location.path == f"{tmp_path}/runs"
    assert not location.is_object_store


@pytest.mark.parametrize("uri", ["s3://", "s3:///prefix/only", "gs:///x"])
def test_object_store_uri_without_bucket_is_an_error(uri):
    with pytest.raises(StorageError) as info:
        parse_uri(uri)
    message = str(info.value)
    assert message.startswith(f"{uri}: no bucket")
    assert "://BUCKET/PREFIX" in message
    assert "\n" not in message


# ---------------------------------------------------------------------------------------------------------
# StorageLocation.child / .path


def test_child_of_s3_location():
    child = parse_uri("s3://bucket/runs").child("digits-ddp")
    assert child.uri == "s3://bucket/runs/digits-ddp"
    assert (child.bucket, child.key, child.path) == ("bucket", "runs/digits-ddp", "bucket/runs/digits-ddp")


def test_child_strips_extra_slashes_and_takes_several_parts():
    child = parse_uri("s3://bucket/runs/").child("/a/", "b/")
    assert child.uri == "s3://bucket/runs/a/b"
    assert child.path == "bucket/runs/a/b"


def test_child_of_bucket_root():
    assert parse_uri("s3://bucket").child("run").path == "bucket/run"


def test_child_of_local_path(tmp_path):
    child = parse_uri(str(tmp_path)).child("run", "step-1")
    assert child.scheme == ""
    assert child.path == f"{tmp_path}/run/step-1"


def test_child_of_file_uri(tmp_path):
    child = parse_uri(f"file://{tmp_path}").child("run")
    assert child.uri == f"file://{tmp_path}/run"
    assert child.path == f"{tmp_path}/run"


# ---------------------------------------------------------------------------------------------------------
# fsspec options


def test_fsspec_options_default_to_aws_region_without_endpoint():
    assert fsspec_options(parse_uri("s3://bucket/x")) == {
        "client_kwargs": {"region_name": "us-east-1"},
        "config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": S3_ATTEMPTS}},
    }


def test_fsspec_options_from_environment(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    assert fsspec_options(parse_uri("s3://bucket/x"))["client_kwargs"] == {
        "region_name": "eu-west-3",
        "endpoint_url": "http://127.0.0.1:9000",
    }


def test_fsspec_options_prefer_s3_specific_endpoint_and_fall_back_to_default_region(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://general:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3-only:2")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "ap-south-1")
    options = fsspec_options(parse_uri("s3://bucket/x"))
    assert options["client_kwargs"] == {"region_name": "ap-south-1", "endpoint_url": "http://s3-only:2"}


@pytest.mark.parametrize("uri", ["/tmp/x", "file:///tmp/x", "gs://bucket/x"])
def test_fsspec_options_empty_for_other_schemes(uri, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    assert fsspec_options(parse_uri(uri)) == {}


# ---------------------------------------------------------------------------------------------------------
# pyarrow filesystems (constructed only; no I/O)


def _s3_arguments(fs: pafs.S3FileSystem) -> dict:
    # pyarrow pickles an S3FileSystem as its constructor arguments
    return fs.__reduce__()[1][0]


def test_pyarrow_filesystem_for_s3_with_endpoint(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-secret")
    fs, path = pyarrow_filesystem("s3://bucket/prefix")
    assert isinstance(fs, pafs.S3FileSystem)
    assert path == "bucket/prefix"
    arguments = _s3_arguments(fs)
    assert arguments["endpoint_override"] == "127.0.0.1:9"
    assert arguments["scheme"] == "http"
    assert arguments["region"] == "eu-west-1"
    assert arguments["access_key"] == "test-key"


def test_pyarrow_filesystem_for_s3_without_endpoint_uses_https_default(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-secret")
    fs, path = pyarrow_filesystem("s3://bucket/a/b")
    assert isinstance(fs, pafs.S3FileSystem)
    assert path == "bucket/a/b"
    arguments = _s3_arguments(fs)
    assert arguments["endpoint_override"] == ""
    assert arguments["region"] == "us-east-1"


@pytest.mark.parametrize("make_uri", [lambda p: str(p), lambda p: f"file://{p}"], ids=["path", "file-uri"])
def test_pyarrow_filesystem_for_local_path(tmp_path, make_uri):
    fs, path = pyarrow_filesystem(make_uri(tmp_path / "runs"))
    assert isinstance(fs, pafs.LocalFileSystem)
    assert path == str(tmp_path / "runs")
    assert not (tmp_path / "runs").exists()  # nothing created


# ---------------------------------------------------------------------------------------------------------
# check_storage


def test_check_storage_on_local_path_is_a_no_op(tmp_path, monkeypatch):
    def no_filesystem(uri):  # a local path must not even build a filesystem
        raise AssertionError(f"check_storage built a filesystem for {uri}")

    monkeypatch.setattr(storage, "fsspec_filesystem", no_filesystem)
    target = tmp_path / "does-not-exist" / "runs"
    assert check_storage(str(target)) is None
    assert check_storage(f"file://{target}") is None
    assert not target.parent.exists()


def test_check_storage_on_s3_does_consult_the_store(monkeypatch):
    """Contrast to the no-op above: for s3:// the bucket is checked (through a fake filesystem here)."""

    class FakeFS:
        def __init__(self):
            self.asked = []

        def exists(self, path):
            self.asked.append(path)
            return False

    fake = FakeFS()
    monkeypatch.setattr(storage, "fsspec_filesystem", lambda uri: (fake, parse_uri(uri).path))
    with pytest.raises(StorageError, match=r"bucket 'bucket' does not exist"):
        check_storage("s3://bucket/runs")
    assert fake.asked == ["bucket"]


# ---------------------------------------------------------------------------------------------------------
# the object stores' fsspec packages (extras)


@pytest.mark.parametrize(
    ("uri", "package", "extra"),
    [
        ("gs://bucket/runs", "gcsfs", "gcp"),
        ("gcs://bucket/runs", "gcsfs", "gcp"),
        ("az://container/runs", "adlfs", "azure"),
        ("abfs://container/runs", "adlfs", "azure"),
    ],
)
def test_missing_filesystem_package_names_the_extra(uri, package, extra, monkeypatch):
    real_find_spec = storage.importlib.util.find_spec
    monkeypatch.setattr(
        storage.importlib.util, "find_spec", lambda name: None if name == package else real_find_spec(name)
    )
    expected = f"{uri}: {uri.split(':')[0]}:// needs the {package} package, which is not installed; pip install 'elastic-train[{extra}]'"
    for call in (storage.require_filesystem, storage.fsspec_filesystem, storage.pyarrow_filesystem, check_storage):
        with pytest.raises(StorageError) as err:
            call(uri)
        assert str(err.value) == expected


def test_local_paths_and_s3_need_no_extra(tmp_path):
    storage.require_filesystem(str(tmp_path))
    storage.require_filesystem("s3://bucket/runs")


def test_gs_uri_gets_gcsfs(monkeypatch):
    # Anonymous: no credential lookup, so nothing leaves this machine.
    monkeypatch.setattr(storage, "fsspec_options", lambda location: {"token": "anon"})
    fs, path = storage.fsspec_filesystem("gs://bucket/runs/x")
    assert type(fs).__module__.startswith("gcsfs") and fs.protocol[0] == "gs"
    assert path == "bucket/runs/x"


@pytest.mark.parametrize("uri", ["az://container/runs", "abfs://container/runs"])
def test_azure_uris_get_adlfs_for_fsspec_and_pyarrow(uri, monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "elasticaccount")
    fs, path = storage.fsspec_filesystem(uri)
    assert type(fs).__name__ == "AzureBlobFileSystem" and fs.account_name == "elasticaccount"
    assert path == "container/runs"
    arrow_fs, arrow_path = pyarrow_filesystem(uri)
    # pyarrow has no az://: Ray Train's storage goes through the same adlfs filesystem.
    assert isinstance(arrow_fs, pafs.PyFileSystem) and arrow_fs.handler.fs is fs
    assert arrow_path == "container/runs"
