"""torch.distributed.checkpoint storage for object stores: whole-object PUTs and concurrent whole-object GETs.

torch's FsspecWriter/Reader treat S3 like a disk, which costs most of the bandwidth there:
- a write streams into an s3fs file (a multipart upload in 5 MB parts, one request at a time per file), then
  "fsyncs": an fsspec file has no fileno, so torch falls back to `os.sync()` of the whole machine;
- a read opens the files one after another and fetches each item with its own ranged requests.

Here each file DCP writes is built in memory and sent with one `pipe_file` (s3fs switches to a concurrent
multipart upload for large objects), with no fsync: an object exists only once its PUT has succeeded. A load
starts fetching every file this rank's plan needs, concurrently, and serves DCP's reads of each file from
memory as soon as that file has arrived. Local
paths keep torch's stock writer and reader, fsync included.
"""

from __future__ import annotations

import io
import os
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Generator

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter


class _UploadOnClose(io.BytesIO):
    """A file DCP writes into; its bytes go up in one request when DCP closes it (or, for a temporary file,
    are handed to `keep` for the rename that follows)."""

    def __init__(self, fs, path: str, keep: dict[str, bytes] | None = None):
        super().__init__()
        self._fs, self._path, self._keep, self._sent = fs, path, keep, False

    def close(self) -> None:
        if not self._sent and not self.closed:
            self._sent = True
            if self._keep is not None:
                self._keep[self._path] = self.getvalue()
            else:
                self._fs.pipe_file(self._path, self.getvalue())
        super().close()


class ObjectStoreFileSystem(FileSystem):
    """DCP's fsspec FileSystem with whole-object writes and reads served from a prefetched cache."""

    def __init__(self) -> None:
        super().__init__()
        self.prefetched: dict[str, Future] = {}  # path (no scheme) -> the object's bytes, arriving
        self.held: dict[str, bytes] = {}  # temporary files, written for real under their final name


    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        path = os.fspath(path)
        if "w" in mode:
            # DCP writes `.metadata.tmp` and renames it: atomic on a disk, a copy plus a delete on S3, where a
            # PUT is atomic already. Hold it and PUT it once, under the name the rename gives it.
            stream = _UploadOnClose(self.fs, path, self.held if path.endswith(".tmp") else None)
            yield stream
            stream.close()  # DCP closes it already; a second close is a no-op
            return
        arriving = self.prefetched.pop(self.fs._strip_protocol(path), None)
        if arriving is not None:
            yield io.BytesIO(arriving.result())
            return
        with super().create_stream(path, mode) as stream:
            yield stream

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        held = self.held.pop(os.fspath(path), None)
        if held is None:
            super().rename(path, new_path)
        else:
            self.fs.pipe_file(os.fspath(new_path), held)

    def prefetch(self, paths: list[str], pool: ThreadPoolExecutor) -> None:
        """Start fetching whole objects, all at once; DCP then reads each as soon as it has arrived, so
        deserializing one file overlaps the download of the others."""
        for path in paths:
            self.prefetched[self.fs._strip_protocol(path)] = pool.submit(self.fs.cat_file, path)


class ObjectStoreWriter(FsspecWriter):
    def __init__(self, path: str, thread_count: int = 4, **storage_options: Any) -> None:
        super().__init__(path, overwrite=True, thread_count=thread_count, sync_files=False, **storage_options)
        self.fs = ObjectStoreFileSystem()
        self.path = self.fs.init_path(path, **storage_options)


class ObjectStoreReader(FsspecReader):
    def __init__(self, path: str, **storage_options: Any) -> None:
        super().__init__(path, **storage_options)
        self.fs = ObjectStoreFileSystem()
        self.path = self.fs.init_path(path, **storage_options)

    def read_data(self, plan, planner):
        needed = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(needed))), thread_name_prefix="elastic-load") as pool:
            self.fs.prefetch([os.fspath(self.fs.concat_path(self.path, name)) for name in needed], pool)
            try:
                return super().read_data(plan, planner)
            finally:
                for arriving in self.fs.prefetched.values():
                    arriving.cancel()
                self.fs.prefetched.clear()


def storage_writer(uri: str, is_object_store: bool, thread_count: int, **storage_options: Any):
    if is_object_store:
        return ObjectStoreWriter(uri, thread_count=thread_count, **storage_options)
    return FsspecWriter(uri, overwrite=True, thread_count=thread_count, **storage_options)


def storage_reader(uri: str, is_object_store: bool, **storage_options: Any):
    if is_object_store:
        return ObjectStoreReader(uri, **storage_options)
    return FsspecReader(uri, **storage_options)
