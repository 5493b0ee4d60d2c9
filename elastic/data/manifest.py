"""A dataset's manifest: what a sharded Parquet dataset in a bucket holds, written last (a dataset is
committed when its manifest is, as a checkpoint is by its marker).

`_elastic_dataset.json` at the dataset's root lists every file (path relative to the root, bytes, ETag or
checksum, rows, the rows of each row group), the rows and bytes in all, the Arrow schema, and a fingerprint
(a hash of every file's path, size and ETag): a reader compares the files it opens against it, and a
checkpoint records it, so a dataset changed under a run is caught instead of read as if it were the same.

`index(uri)` builds the manifest of Parquet written by anyone (Spark, pandas, Ray Data, `elastic data
prepare`) from the files' footers alone, in parallel; `load(uri)` reads it, or builds it (and writes it,
once) where there is none yet.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from elastic.errors import UserError
from elastic.storage import fsspec_filesystem

_log = logging.getLogger(__name__)

MANIFEST_NAME = "_elastic_dataset.json"
PREPARING_NAME = "_elastic_preparing"  # `elastic data prepare` is writing the files: not a dataset yet
FORMAT = "elastic-dataset"
VERSION = 1
PARQUET_SUFFIXES = (".parquet", ".parq")


class DatasetError(UserError):
    """A dataset cannot be used as it is: missing, empty, inconsistent or changed (one line and the fix)."""


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the dataset's root
    bytes: int
    etag: str
    rows: int
    row_groups: list[int]  # rows of each row group, in file order


@dataclass
class Manifest:
    root: str
    files: list[FileEntry]
    schema: str  # the Arrow schema, IPC-serialized, base64
    created: float = field(default_factory=time.time)
    format: str = FORMAT
    version: int = VERSION

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    @property
    def num_row_groups(self) -> int:
        return sum(len(f.row_groups) for f in self.files)

    @property
    def fingerprint(self) -> str:
        text = "\n".join(f"{f.path}\t{f.bytes}\t{f.etag}" for f in self.files)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def arrow_schema(self) -> pa.Schema:
        return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(self.schema)))

    def row_group_rows(self) -> list[int]:
        """Rows of every row group of the dataset, files in manifest order."""
        return [rows for f in self.files for rows in f.row_groups]

    def to_json(self) -> dict:
        return {
            "format": self.format,
            "version": self.version,
            "created": self.created,
            "rows": self.rows,
            "bytes": self.bytes,
            "row_groups": self.num_row_groups,
            "fingerprint": self.fingerprint,
            "schema": self.schema,
            "files": [asdict(f) for f in self.files],
        }

    def summary(self) -> dict:
        """What `elastic data inspect` shows."""
        return {
            "uri": self.root,
            "rows": self.rows,
            "files": len(self.files),
            "row_groups": self.num_row_groups,
            "bytes": self.bytes,
            "fingerprint": self.fingerprint,
            "columns": {f.name: str(f.type) for f in self.arrow_schema()},
        }

    @classmethod
    def from_json(cls, root: str, data: dict) -> Manifest:
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise DatasetError(
                f"{root}/{MANIFEST_NAME} is not an elastic dataset manifest of version {VERSION}; rebuild it with "
                f"`elastic data index {root}`"
            )
        files = [FileEntry(**f) for f in data["files"]]
        return cls(root=root, files=files, schema=data["schema"], created=data.get("created", 0.0))


def serialize_schema(schema: pa.Schema) -> str:
    return base64.b64encode(schema.remove_metadata().serialize().to_pybytes()).decode()


def index(uri: str, write: bool = True, threads: int = 16) -> Manifest:
    """Build the manifest of the Parquet files under `uri` from their footers; write it last (unless not
    `write`). Every file must have the same schema."""
    root = uri.rstrip("/")
    fs, path = fsspec_filesystem(root)
    if not fs.exists(path):
        raise DatasetError(f"{root}: no such dataset (nothing at that path or prefix); check the URI")
    if fs.isfile(path):
        raise DatasetError(f"{root} is a file; a dataset is the folder or prefix that holds its Parquet files")
    if fs.exists(f"{path}/{PREPARING_NAME}"):
        raise DatasetError(f"{root} is being written by `elastic data prepare` (or one was cut short); run it again")
    found = sorted(p for p in fs.find(path) if p.lower().endswith(PARQUET_SUFFIXES))
    if not found:
        raise DatasetError(f"{root}: no Parquet files (*.parquet) under it; write some with `elastic data prepare`")
    infos = {info["name"]: info for info in (fs.info(p) for p in found)}
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(found)))) as pool:
        footers = list(pool.map(lambda p: _footer(fs, p), found))
    schemas = [meta.schema.to_arrow_schema().remove_metadata() for meta in footers]
    for name, schema in zip(found, schemas):
        if not schema.equals(schemas[0]):
            raise DatasetError(
                f"{root}: {_relative(path, name)} has columns {_columns(schema)} but {_relative(path, found[0])} has "
                f"{_columns(schemas[0])}; every file of a dataset needs one schema (rewrite it with `elastic data "
                "prepare`)"
            )
    files = [
        FileEntry(
            path=_relative(path, name),
            bytes=int(infos[name]["size"]),
            etag=etag_of(fs, infos[name]),
            rows=meta.num_rows,
            row_groups=[meta.row_group(i).num_rows for i in range(meta.num_row_groups)],
        )
        for name, meta in zip(found, footers)
    ]
    manifest = Manifest(root=root, files=files, schema=serialize_schema(schemas[0]))
    if manifest.rows == 0:
        raise DatasetError(f"{root}: the dataset has no rows; point at a dataset with data")
    if write:
        write_manifest(fs, path, manifest)
    return manifest


def write_manifest(fs, path: str, manifest: Manifest) -> None:
    with fs.open(f"{path}/{MANIFEST_NAME}", "w") as handle:
        json.dump(manifest.to_json(), handle, indent=1)


def load(uri: str, build: bool = True) -> Manifest:
    """The dataset's manifest; where there is none yet and `build`, index the files once (and write it)."""
    root = uri.rstrip("/")
    fs, path = fsspec_filesystem(root)
    location = f"{path}/{MANIFEST_NAME}"
    if fs.exists(f"{path}/{PREPARING_NAME}"):
        raise DatasetError(f"{root} is being written by `elastic data prepare` (or one was cut short); run it again")
    if fs.exists(location):
        with fs.open(location, "r") as handle:
            return Manifest.from_json(root, json.load(handle))
    if not build:
        raise DatasetError(f"{root}: no {MANIFEST_NAME}; build it with `elastic data index {root}`")
    if not fs.exists(path):
        raise DatasetError(f"{root}: no such dataset (nothing at that path or prefix); check the URI")
    _log.info(f"{root}: no manifest yet; indexing its Parquet footers once")
    return index(root)


def verify(manifest: Manifest, threads: int = 16) -> None:
    """Every file of the manifest is there with the size and ETag it had; else one line naming the first."""
    fs, path = fsspec_filesystem(manifest.root)

    def check(entry: FileEntry) -> str | None:
        name = f"{path}/{entry.path}"
        try:
            info = fs.info(name)
        except FileNotFoundError:
            return f"{manifest.root}: {entry.path} is missing"
        if int(info["size"]) != entry.bytes or etag_of(fs, info) != entry.etag:
            return f"{manifest.root}: {entry.path} changed since the manifest was written"
        return None

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(manifest.files)))) as pool:
        problems = [p for p in pool.map(check, manifest.files) if p]
    if problems:
        raise DatasetError(
            f"{problems[0]}{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}; restore the files or "
            f"rebuild the manifest with `elastic data index {manifest.root}` (a run that trained on the old files "
            "cannot resume on new ones)"
        )


def _footer(fs, path: str) -> pq.FileMetaData:
    with fs.open(path, "rb", cache_type="none") as handle:
        try:
            return pq.ParquetFile(handle).metadata
        except (pa.ArrowInvalid, OSError) as err:
            raise DatasetError(f"{path}: not a readable Parquet file ({err}); remove it or rewrite it") from None


def etag_of(fs, info: dict) -> str:
    """The object store's ETag; for local files, the modification time (a rewrite changes it)."""
    if isinstance(fs, LocalFileSystem):
        return f"mtime:{info.get('mtime', info.get('created', 0))}"
    return str(info.get("ETag") or info.get("etag") or info.get("md5") or "").strip('"')


def _relative(root: str, name: str) -> str:
    return name[len(root.rstrip("/")) + 1 :] if name.startswith(root.rstrip("/") + "/") else name


def _columns(schema: pa.Schema) -> str:
    return "(" + ", ".join(f"{f.name}: {f.type}" for f in schema) + ")"
