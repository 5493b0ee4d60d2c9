"""torch.distributed.checkpoint storage for object stores: whole-object PUTs and concurrent whole-object GETs.

torch's FsspecWriter/Reader treat S3 like a disk, which costs most of the bandwidth there:
- a write streams into an s3fs file (a multipart upload in 5 MB parts, one request at a time per file), then
  "fsyncs": an fsspec file has no fileno, so torch falls back to `os.sync()` of the whole machine;
- a read opens the files one after another and fetches each item with its own ranged requests.

Here each file DCP writes is built in memory, one file at a time, and sent with one `pipe_file` in the
background while the next is built (s3fs switches to a concurrent multipart upload for large objects), with
no fsync: an object exists only once its PUT has succeeded. A load
starts fetching every file this rank's plan needs, concurrently, and serves DCP's reads of each file from
memory as soon as that file has arrived. Local
paths keep torch's stock writer and reader, fsync included.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import logging
import os
import pickle
import threading
import time
import warnings
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from fsspec.asyn import sync
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter  # private: below
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.serialization import get_crc32_options, set_crc32_options

from elastic.checkpoint.store import DCP_METADATA, file_ends

log = logging.getLogger(__name__)

# torch.distributed.checkpoint._fsspec_filesystem is private: torch 2.13 exports neither FileSystem nor
# FsspecWriter/Reader from torch.distributed.checkpoint (dcp.save(checkpoint_id="s3://...") reaches them, but
# without storage options or a FileSystem to subclass). See docs/architecture.md, "Private APIs we use".

# Files up to this size go up in one PUT straight from the buffer DCP wrote them into; larger ones through
# s3fs's concurrent multipart upload (its threshold: two 50 MB parts).
SINGLE_PUT_BYTES = 100 * 2**20
# Each whole-object PUT and GET is retried this many times in all, on top of the AWS client's own retries of
# each request (elastic.storage.S3_ATTEMPTS): an outage longer than those costs one file's retry, logged, and
# not the whole save's or load's. Backoff doubles from OBJECT_BACKOFF_SECONDS, so the total wait is bounded.
OBJECT_ATTEMPTS = 3
OBJECT_BACKOFF_SECONDS = 1.0


class _UploadOnClose(io.BytesIO):
    """A shard file DCP writes into. When DCP closes it, the buffer itself is handed to `send`, which owns it
    from then on: the upload reads the bytes in place, where `getvalue()` would hand over bytes that the
    HTTP client copies once more (aiohttp unshares a BytesIO built on them)."""

    def __init__(self, send: Callable[[io.BytesIO], None]):
        super().__init__()
        self._send, self._handed = send, False

    def close(self) -> None:
        if not self._handed:
            self._handed = True
            self.seek(0)
            self._send(self)


_crc_lock = threading.Lock()
_crc_writers = 0


@contextmanager
def _without_zip_crc() -> Generator[None, None, None]:
    """torch.save's zip CRC32 per record costs a pass over every byte, and torch.load never checks it. The
    transfer is checked anyway: botocore sends a CRC32 of each PUT, which S3 verifies. The setting is global,
    so it is off while any save of this process writes, and a concurrent torch.save elsewhere in the
    process writes zero CRCs too (harmless for torch.load)."""
    global _crc_writers
    with _crc_lock:
        if _crc_writers == 0:
            _without_zip_crc.saved = get_crc32_options()
            set_crc32_options(False)
        _crc_writers += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_writers -= 1
            if _crc_writers == 0:
                set_crc32_options(_without_zip_crc.saved)


class ObjectStoreFileSystem(FileSystem):
    """DCP's fsspec FileSystem with whole-object writes and reads served from a prefetched cache."""

    def __init__(self) -> None:
        super().__init__()
        # path, as concat_path(self.path, name) spells it (DCP's reads use the same call) -> the bytes, arriving
        self.prefetched: dict[str, Future] = {}
        self.uploads: list[Future] = []
        self._upload_pool: ThreadPoolExecutor | None = None
        # DCP serializes its files on parallel threads that all finish together, and only then does any
        # upload start. One at a time, each file is built at full speed and goes up the moment it is done,
        # so uploads start after the first file and the threads no longer fight over the GIL.
        self._serializing = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        path = os.fspath(path)
        if "w" in mode:
            with self._serializing:
                stream = _UploadOnClose(lambda data: self._upload(path, data))
                yield stream
                stream.close()  # DCP closes it already; a second close is a no-op
            return
        arriving = self.prefetched.pop(path, None)
        if arriving is not None:
            yield io.BytesIO(arriving.result())
            return
        with super().create_stream(path, mode) as stream:
            yield stream

    def fetch(self, path: str) -> bytes:
        """One whole object, in one request (s3fs splits a large one into concurrent ranged reads)."""
        return retrying(f"GET {path}", lambda: self.fs.cat_file(path))

    def put(self, path: str, stream: io.BytesIO) -> None:
        retrying(f"PUT {path}", lambda: self._put_once(path, stream))

    def _put_once(self, path: str, stream: io.BytesIO) -> None:
        """One object from a buffer: on S3 a PUT that reads the buffer in place, through s3fs's own request
        path (its retries and extra arguments such as server-side encryption apply)."""
        size = stream.seek(0, io.SEEK_END)
        stream.seek(0)
        if size < SINGLE_PUT_BYTES and _is_s3(self.fs):
            # s3fs's private _call_s3: the request its public pipe_file sends, which takes bytes only (getvalue:
            # one more copy of every file). No public call sends a buffer as it is.
            bucket, key, _ = self.fs.split_path(path)
            sync(self.fs.loop, self.fs._call_s3, "put_object", Bucket=bucket, Key=key, Body=stream)
            self.fs.invalidate_cache(path)
        else:
            self.fs.pipe_file(path, stream.getvalue())

    def _upload(self, path: str, stream: io.BytesIO) -> None:
        if self._upload_pool is None:
            self.put(path, stream)
        else:
            self.uploads.append(self._upload_pool.submit(self.put, path, stream))

    @contextmanager
    def uploading(self, threads: int) -> Generator[None, None, None]:
        """Send the files DCP closes in the background, `threads` at a time; on leaving, every upload has
        succeeded (or the first failure is raised)."""
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="elastic-put") as pool:
            self._upload_pool, self.uploads = pool, []
            try:
                yield
                for upload in self.uploads:
                    upload.result()
            finally:
                for upload in self.uploads:
                    upload.cancel()
                self._upload_pool = None


class ObjectStoreWriter(FsspecWriter):
    """Round trips a disk needs and an object store does not are left out: no folder is made and no existing
    `.metadata` is looked for (each save writes a fresh step folder), and `.metadata` goes up in one PUT
    under its final name. `file_sizes` (after finish, on the coordinator) holds every file's size as DCP
    wrote it, so the commit marker needs no listing."""

    def __init__(self, path: str, thread_count: int = 4, **storage_options: Any) -> None:
        super().__init__(path, overwrite=True, thread_count=thread_count, sync_files=False, **storage_options)
        self.fs = ObjectStoreFileSystem()
        self.path = self.fs.init_path(path, **storage_options)
        self.file_sizes: dict[str, int] | None = None

    def write_data(self, plan, planner):
        with self.fs.uploading(self.thread_count), _without_zip_crc():
            return super().write_data(plan, planner)

    def prepare_local_plan(self, plan):
        return plan  # every rank writes under the global plan's per-rank prefix (prepare_global_plan)

    def finish(self, metadata, results) -> None:
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for wr_list in results for wr in wr_list}
        metadata.storage_meta = self.storage_meta()
        encoded = pickle.dumps(metadata)
        where = os.fspath(self.fs.concat_path(self.path, DCP_METADATA))
        retrying(f"PUT {where}", lambda: self.fs.fs.pipe_file(where, encoded))
        self.file_sizes = {**file_ends(metadata.storage_data), DCP_METADATA: len(encoded)}


@dataclass(frozen=True)
class SharedFile:
    """A checkpoint file that several ranks need: `owner` (a rank of the load's process group) fetches it."""

    name: str
    owner: int
    size: int


class ObjectStoreReader(FsspecReader):
    """Whole-object, concurrent reads; files that several ranks need are read from storage once.

    DDP's state is replicated, so every rank needs every file. The coordinator gives each such file one owner
    among the ranks that need it (balanced by bytes); owners fetch their files and broadcast them over the
    load's process group (the checkpoint's gloo group) while DCP decodes what has arrived. Each rank reads
    1/W of a replicated checkpoint from storage, as Megatron's fully parallel load does; a broadcast between
    nodes is far faster than a second read of the same bytes from an object store."""

    def __init__(self, path: str, process_group=None, **storage_options: Any) -> None:
        super().__init__(path, **storage_options)
        self.fs = ObjectStoreFileSystem()
        self.path = self.fs.init_path(path, **storage_options)
        self.group = process_group

    def _exchanging(self) -> bool:
        return self.group is not None and dist.is_initialized() and dist.get_world_size(self.group) > 1

    def prepare_global_plan(self, plans):
        plans = super().prepare_global_plan(plans)
        if len(plans) < 2:
            return plans
        sizes = file_ends(self.storage_data)
        needed_by: dict[str, list[int]] = {}
        for rank, plan in enumerate(plans):
            for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
                needed_by.setdefault(name, []).append(rank)
        fetching = [0] * len(plans)
        owned: list[list[SharedFile]] = [[] for _ in plans]
        for name in sorted(needed_by, key=lambda n: (-sizes[n], n)):  # biggest first: an even split of bytes
            ranks = needed_by[name]
            if len(ranks) > 1:
                owner = min(ranks, key=lambda r: (fetching[r], r))
                fetching[owner] += sizes[name]
                owned[owner].append(SharedFile(name, owner, sizes[name]))
        # Broadcast order: each owner's first file, then each owner's second...: every owner's downloads,
        # started in this order, arrive about when their turn comes.
        order = [f for turn in itertools.zip_longest(*owned) for f in turn if f is not None]
        return [dataclasses.replace(plan, storage_data=order) for plan in plans]

    def read_data(self, plan, planner):
        shared: list[SharedFile] = list(plan.storage_data or []) if self._exchanging() else []
        rank = dist.get_rank(self.group) if shared else 0
        needed = {self.storage_data[item.storage_index].relative_path for item in plan.items}
        received = {f.name for f in shared if f.owner != rank}
        fetch = [f.name for f in shared if f.owner == rank] + sorted(needed - {f.name for f in shared})
        full = lambda name: os.fspath(self.fs.concat_path(self.path, name))  # noqa: E731
        with (
            ThreadPoolExecutor(max_workers=max(1, min(16, len(fetch))), thread_name_prefix="elastic-load") as pool,
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastic-decode") as decoder,
        ):
            downloads = {name: pool.submit(self.fs.fetch, full(name)) for name in fetch}
            arrivals = {name: downloads.get(name) or Future() for name in needed}
            for name, arriving in arrivals.items():
                self.fs.prefetched[full(name)] = arriving
            # DCP decodes each file as soon as it is here, on its own thread, while the broadcasts go on.
            decoding = decoder.submit(super().read_data, plan, planner)
            try:
                self._exchange(shared, rank, downloads, arrivals)
            finally:
                for name in received & needed:
                    if not arrivals[name].done():  # the exchange failed: let the decoding thread end
                        arrivals[name].set_exception(RuntimeError(f"{name} was not received"))
                for arriving in downloads.values():
                    arriving.cancel()
            try:
                return decoding.result()
            finally:
                self.fs.prefetched.clear()

    def _exchange(
        self, shared: list[SharedFile], rank: int, downloads: dict[str, Future], arrivals: dict[str, Future]
    ) -> None:
        """Every rank walks the same list: the owner broadcasts a flag (did its read succeed?) and then the
        file's bytes; a failed read fails the load on every rank instead of leaving them waiting."""
        for shared_file in shared:
            source = dist.get_global_rank(self.group, shared_file.owner)
            flag = torch.zeros(1, dtype=torch.int64)
            if rank == shared_file.owner:
                try:
                    data, failure = downloads[shared_file.name].result(), None
                    if len(data) != shared_file.size:
                        failure = RuntimeError(
                            f"{shared_file.name}: {len(data)} bytes, the metadata says {shared_file.size}"
                        )
                except Exception as err:  # any read error: the other ranks must hear of it
                    data, failure = b"", err
                flag[0] = 0 if failure else 1
                dist.broadcast(flag, src=source, group=self.group)
                if failure:
                    raise failure
                with warnings.catch_warnings():  # read-only bytes: a broadcast's source is only read
                    warnings.simplefilter("ignore", UserWarning)
                    dist.broadcast(torch.frombuffer(data, dtype=torch.uint8), src=source, group=self.group)
                continue
            dist.broadcast(flag, src=source, group=self.group)
            if not flag.item():
                raise RuntimeError(f"rank {shared_file.owner} could not read {shared_file.name}")
            buffer = torch.empty(shared_file.size, dtype=torch.uint8)
            dist.broadcast(buffer, src=source, group=self.group)
            if shared_file.name in arrivals:
                arrivals[shared_file.name].set_result(memoryview(buffer.numpy()))


def retrying(what: str, call: Callable[[], Any], attempts: int = OBJECT_ATTEMPTS) -> Any:
    """`call()`, tried up to `attempts` times with doubling backoff; each failure is logged. A missing object
    or a refused permission is not transient: raised at once."""
    for attempt in range(1, attempts):
        try:
            return call()
        except (FileNotFoundError, PermissionError):
            raise
        except Exception as err:  # s3fs, botocore and aiohttp raise many types for one transient fault
            delay = OBJECT_BACKOFF_SECONDS * 2 ** (attempt - 1)
            first_line = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
            log.warning(
                "%s failed (%s: %s); retry %d of %d in %.1f s",
                what,
                type(err).__name__,
                first_line,
                attempt,
                attempts - 1,
                delay,
            )
            time.sleep(delay)
    return call()


def _is_s3(fs) -> bool:
    try:
        # s3fs is optional: a local-only install has no S3 client.
        from s3fs import S3FileSystem
    except ImportError:
        return False
    return isinstance(fs, S3FileSystem)


def storage_writer(uri: str, is_object_store: bool, thread_count: int, **storage_options: Any):
    if is_object_store:
        return ObjectStoreWriter(uri, thread_count=thread_count, **storage_options)
    return FsspecWriter(uri, overwrite=True, thread_count=thread_count, **storage_options)


def storage_reader(uri: str, is_object_store: bool, process_group=None, **storage_options: Any):
    if is_object_store:
        return ObjectStoreReader(uri, process_group=process_group, **storage_options)
    return FsspecReader(uri, **storage_options)
