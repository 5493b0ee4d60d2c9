"""A node-local disk cache of decoded row groups, shared by the ranks of one node.

Every rank of a node reads the same windows of row groups (each rank takes its slice of every global batch,
and a batch mixes the rows of a whole window), so without sharing, a node with R ranks fetches each row group
R times. With the cache, the first rank to need a row group fetches and decodes it and writes it as an Arrow
IPC file; the others wait for it (a file lock per row group) and map it from disk. Bounded by `limit_bytes`:
the least recently used files go first. Keyed by the dataset's fingerprint, so a rewritten dataset never reads
another's row groups.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

_log = logging.getLogger(__name__)

CACHE_DIR_VARIABLE = "ELASTIC_DATA_CACHE"


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_VARIABLE) or Path(tempfile.gettempdir()) / "elastic-data-cache")


def parse_size(value: int | str) -> int:
    """10737418240, "10GB", "512MB", "1.5GiB" -> bytes."""
    if isinstance(value, int):
        return value
    text = value.strip().upper().replace("IB", "B")
    for suffix, factor in (("TB", 2**40), ("GB", 2**30), ("MB", 2**20), ("KB", 2**10), ("B", 1)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(float(text))


class RowGroupCache:
    """`get(key, fetch)`: the table under `key`, from disk, or from `fetch()` (then kept) by exactly one rank of
    the node while the others wait."""

    def __init__(self, fingerprint: str, limit_bytes: int, root: Path | None = None):
        self.folder = (root or default_cache_dir()) / fingerprint
        self.folder.mkdir(parents=True, exist_ok=True)
        self.limit_bytes = limit_bytes
        self.hits = 0
        self.misses = 0
        self._evict()  # a limit lower than the last run's holds from the start

    def get(self, key: str, fetch: Callable[[], pa.Table]) -> pa.Table:
        path = self.folder / f"{key}.arrow"
        with open(self.folder / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one fetch per node; the other ranks wait, then read the file
            try:
                if path.exists():
                    self.hits += 1
                    os.utime(path)  # recently used
                    with pa.memory_map(str(path)) as source:
                        return pa.ipc.open_file(source).read_all()
                self.misses += 1
                table = fetch()
                partial = path.with_suffix(f".tmp{os.getpid()}")
                with pa.OSFile(str(partial), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
                    writer.write_table(table)
                partial.replace(path)  # complete files only: a rank killed mid-write leaves a .tmp, not a table
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        self._evict()
        return table

    def _evict(self) -> None:
        files = []
        for entry in os.scandir(self.folder):
            if entry.name.endswith(".arrow"):
                try:
                    stat = entry.stat()
                except FileNotFoundError:  # another rank evicted it meanwhile
                    continue
                files.append((stat.st_mtime, stat.st_size, entry.path))
        total = sum(size for _, size, _ in files)
        for _, size, name in sorted(files):
            if total <= self.limit_bytes:
                break
            try:
                os.unlink(name)
                total -= size
            except FileNotFoundError:
                pass
