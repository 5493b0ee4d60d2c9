"""`elastic data prepare SRC DEST`: a dataset in a bucket from Parquet, CSV, JSON lines, NumPy (.npy/.npz) or
a Python generator, as Parquet shards of about `shard_mb` with row groups of about `row_group_mb`, optionally
shuffled once globally (`shuffle_seed`), written in parallel, committed by its manifest (elastic.data.manifest).

Files (Parquet, CSV, JSON lines) are planned, then converted a group at a time: `plan_source` lists the source
files and takes one schema from the first (as pyarrow.dataset reads a folder), `SourcePlan.groups` cuts them
into runs of consecutive files of at least `shard_mb` each (a big file is a group by itself), and
`convert_files` streams one group into shards `part-<first source index>-<n>.parquet` (one shard's rows in
memory at a time). Here the groups run in threads; with `--address` (elastic.data.prepare_ray) each is a Ray
task on a cluster, through the same function, and `commit` writes the manifest from what the writers report
either way. A shuffle, a NumPy file and a generator are read whole into memory and cut into
`part-<n>.parquet`.

Safe to re-run: a marker says the dataset is being written (readers refuse it meanwhile), the old manifest goes
first, shards are written under fixed names, shards a previous run left that the new one did not write are
removed, and the new manifest is written last.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from elastic.data.manifest import (
    MANIFEST_NAME,
    PARQUET_SUFFIXES,
    PREPARING_NAME,
    DatasetError,
    FileEntry,
    Manifest,
    etag_of,
    serialize_schema,
    write_manifest,
)
from elastic.storage import fsspec_filesystem

_log = logging.getLogger(__name__)

SHARD_NAME = "part-{:05d}.parquet"  # a table read whole (shuffle, NumPy, generator): its n-th shard
FILE_SHARD_NAME = "part-{:05d}-{:05d}.parquet"  # a group of source files: its first file's index, its n-th shard
READAHEAD_BATCHES = 4
FORMATS = {".parquet": "parquet", ".parq": "parquet", ".csv": "csv", ".jsonl": "json", ".json": "json"}


@dataclass(frozen=True)
class Written:
    """A shard as its writer saw it: what `commit` builds the manifest from (no footer is read back)."""

    path: str  # relative to the dataset's root
    bytes: int
    row_groups: tuple[int, ...]  # rows of each row group, in file order
    schema: str  # the Arrow schema of its footer, as the manifest stores it

    @property
    def rows(self) -> int:
        return sum(self.row_groups)


@dataclass(frozen=True)
class SourcePlan:
    """The source files of a dataset, in order, and the one schema every file is read with."""

    source: str
    kind: str  # a pyarrow.dataset format: parquet, csv or json
    files: tuple[str, ...]  # paths inside the source's filesystem (fsspec_filesystem(source))
    sizes: tuple[int, ...]  # bytes of each file
    schema: pa.Schema

    def groups(self, shard_mb: float) -> list[list[int]]:
        """Runs of consecutive file indices of at least `shard_mb` of source bytes each (the last may be less):
        a file that big is a group by itself, small files go together so that a group writes whole shards. It
        depends on the files and `shard_mb` only, so a re-run names its shards as the last one did."""
        target = shard_mb * 2**20
        groups: list[list[int]] = []
        current: list[int] = []
        size = 0
        for i, file_size in enumerate(self.sizes):
            current.append(i)
            size += file_size
            if size >= target:
                groups.append(current)
                current, size = [], 0
        if current:
            groups.append(current)
        return groups

    def convert_args(self, group: list[int], dest: str, shard_mb: float, row_group_mb: float) -> tuple:
        """`convert_files`'s arguments for one group (a thread here, a Ray task with --address)."""
        return (
            self.source,
            self.kind,
            [self.files[i] for i in group],
            self.schema,
            dest,
            group[0],
            shard_mb,
            row_group_mb,
        )


def is_generator(source: str) -> bool:
    return ":" in source and "://" not in source and not Path(source).exists()


def is_numpy(source: str) -> bool:
    return Path(source.rstrip("/")).suffix.lower() in (".npy", ".npz")


def list_source(source: str):
    """The filesystem, kind and sorted files of a file or folder of Parquet/CSV/JSON lines; one line if none."""
    fs, path = fsspec_filesystem(source)
    if not fs.exists(path):
        raise DatasetError(f"{source}: no such file or folder; check the path")
    if fs.isdir(path):
        found = fs.find(path, detail=True)
        files = sorted(found)
        kinds = {FORMATS.get(Path(f).suffix.lower()) for f in files} - {None}
        if len(kinds) != 1:
            raise DatasetError(
                f"{source}: expected one kind of file ({', '.join(sorted(FORMATS))}), found {sorted(kinds) or 'none'}"
            )
        kind = kinds.pop()
        files = [f for f in files if FORMATS.get(Path(f).suffix.lower()) == kind]
        sizes = [int(found[f].get("size") or 0) for f in files]
    else:
        kind = FORMATS.get(Path(source.rstrip("/")).suffix.lower())
        if kind is None:
            raise DatasetError(f"{source}: unknown kind of file; use Parquet, CSV, JSON lines, .npy/.npz or module:fn")
        files = [path]
        sizes = [int(fs.info(path).get("size") or 0)]
    return fs, kind, files, sizes


def plan_source(source: str) -> SourcePlan:
    """List the source files (fsspec) and read the schema of the first, which every file is then read with
    (what pyarrow.dataset does for a folder, so a plan reads the same rows as `read_source`)."""
    fs, kind, files, sizes = list_source(source)
    try:
        schema = pads.dataset(files[0], format=kind, filesystem=fs).schema
    except (pa.ArrowInvalid, OSError) as err:
        raise DatasetError(f"{source}: {files[0]} cannot be read as {kind} ({_first_line(err)})") from None
    return SourcePlan(source=source, kind=kind, files=tuple(files), sizes=tuple(sizes), schema=schema)


def read_source(source: str) -> pa.Table:
    """The rows of `source`: a file or folder of Parquet/CSV/JSON lines, a .npy/.npz file, or `module:function`
    (a generator of dicts; `path/to/file.py:function` works too)."""
    if is_generator(source):
        return _from_generator(source)
    if is_numpy(source):
        return _from_numpy(source)
    fs, kind, files, _ = list_source(source)
    try:
        return pads.dataset(files, format=kind, filesystem=fs).to_table()
    except (pa.ArrowInvalid, OSError) as err:
        raise DatasetError(f"{source}: cannot be read as {kind} ({_first_line(err)})") from None


def prepare(
    source: str,
    dest: str,
    shard_mb: float = 128.0,
    row_group_mb: float = 4.0,
    shuffle_seed: int | None = None,
    threads: int = 8,
) -> Manifest:
    """Convert `source` to `dest` on this machine: files a group at a time in `threads` threads (one shard of
    each in memory); a shuffle, a NumPy file or a generator read whole."""
    if shuffle_seed is not None or is_generator(source) or is_numpy(source):
        return _prepare_table(source, dest, shard_mb, row_group_mb, shuffle_seed, threads)
    plan = plan_source(source)
    groups = plan.groups(shard_mb)
    begin(dest)
    _log.info(f"{dest}: {len(plan.files)} source file(s) in {len(groups)} group(s)")
    workers = max(1, min(threads, len(groups)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        done = pool.map(
            lambda group: convert_files(
                *plan.convert_args(group, dest, shard_mb, row_group_mb), writers=max(1, threads // workers)
            ),
            groups,
        )
        written = [shard for shards in done for shard in shards]
    return commit(dest, written, source)


def convert_files(
    source: str,
    kind: str,
    files: list[str],
    schema: pa.Schema,
    dest: str,
    part: int,
    shard_mb: float,
    row_group_mb: float,
    writers: int = 1,
) -> list[Written]:
    """Read `files` (a group of consecutive source files; `part` is the first's index) with `schema`, in order,
    and write them to `dest` as shards `part-<part>-<n>.parquet` of about `shard_mb` with row groups of about
    `row_group_mb` (sizes from the first batch's bytes a row, in memory). One shard's rows are in memory at a
    time (`writers` shards while they are written in parallel). The unit of work of both paths: a thread here,
    a Ray task with `--address`."""
    fs, _ = fsspec_filesystem(source)
    dest_fs, root = fsspec_filesystem(dest.rstrip("/"))
    dest_fs.makedirs(root, exist_ok=True)  # on a node: begin() made it where the client runs
    names = (FILE_SHARD_NAME.format(part, n) for n in range(10**9))
    return _write_all(
        dest_fs, root, names, _cut(_read(fs, kind, files, schema, source), shard_mb, row_group_mb), writers
    )


def begin(dest: str) -> None:
    """Mark `dest` as being written (readers refuse it) and remove its manifest: what a re-run starts with."""
    fs, path = fsspec_filesystem(dest.rstrip("/"))
    fs.makedirs(path, exist_ok=True)
    with fs.open(f"{path}/{PREPARING_NAME}", "w") as handle:
        handle.write("elastic data prepare is writing this dataset\n")
    if fs.exists(f"{path}/{MANIFEST_NAME}"):
        fs.rm(f"{path}/{MANIFEST_NAME}")


def commit(dest: str, written: list[Written], source: str = "") -> Manifest:
    """Finish a dataset from what its writers (threads or Ray tasks) report, in the source's order (the
    manifest's): check that every shard is there as written (as this machine sees DEST), remove the Parquet
    files a previous run left that this one did not write, then the marker, and write the manifest last."""
    root = dest.rstrip("/")
    fs, path = fsspec_filesystem(root)
    if sum(w.rows for w in written) == 0:
        raise DatasetError(f"{source or root}: no rows to write")
    schemas = {w.schema for w in written}
    if len(schemas) > 1:  # every file is read with the plan's schema: a writer that differs is a bug
        raise DatasetError(f"{root}: the shards were written with {len(schemas)} different schemas; run it again")
    fs.invalidate_cache(path)  # other processes (Ray tasks) wrote here
    listing = {
        name: info
        for name, info in fs.find(path, detail=True).items()
        if name.lower().endswith(PARQUET_SUFFIXES) and info.get("type", "file") == "file"
    }
    entries = []
    for shard in written:
        info = listing.pop(f"{path}/{shard.path}", None)
        if info is None:
            raise DatasetError(
                f"{root}: {shard.path} was written but is not there as this machine sees {root}; the writers and "
                "this machine need one storage (s3://, gs://, or a folder every node mounts)"
            )
        if int(info["size"]) != shard.bytes:
            raise DatasetError(f"{root}: {shard.path} changed while it was prepared (another writer?); run it again")
        etag = etag_of(fs, info) or etag_of(fs, fs.info(f"{path}/{shard.path}"))
        entries.append(
            FileEntry(path=shard.path, bytes=shard.bytes, etag=etag, rows=shard.rows, row_groups=list(shard.row_groups))
        )
    for leftover in listing:  # shards of a previous run under names this run did not write
        fs.rm(leftover)
    manifest = Manifest(root=root, files=entries, schema=schemas.pop())
    _log.info(f"{root}: {manifest.rows} rows in {len(entries)} shard(s), {manifest.num_row_groups} row group(s)")
    fs.rm(f"{path}/{PREPARING_NAME}")
    write_manifest(fs, path, manifest)
    return manifest


def shard_sizes(row_bytes: float, shard_mb: float, row_group_mb: float) -> tuple[int, int]:
    """Rows of a row group and of a shard (a whole number of row groups) for rows of `row_bytes` in memory."""
    row_bytes = max(1.0, row_bytes)
    group_rows = max(1, int(row_group_mb * 2**20 / row_bytes))
    shard_rows = max(group_rows, int(shard_mb * 2**20 / row_bytes) // group_rows * group_rows)
    return group_rows, shard_rows


def _prepare_table(
    source: str, dest: str, shard_mb: float, row_group_mb: float, shuffle_seed: int | None, threads: int
) -> Manifest:
    table = read_source(source)
    if table.num_rows == 0:
        raise DatasetError(f"{source}: no rows to write")
    if shuffle_seed is not None:
        table = table.take(np.random.default_rng(shuffle_seed).permutation(table.num_rows))
    group_rows, shard_rows = shard_sizes(table.nbytes / table.num_rows, shard_mb, row_group_mb)
    shards = -(-table.num_rows // shard_rows)
    begin(dest)
    _log.info(f"{dest}: {table.num_rows} rows in {shards} shard(s) of <= {shard_rows} rows, row groups of {group_rows}")
    fs, root = fsspec_filesystem(dest.rstrip("/"))
    parts = ((table.slice(i * shard_rows, shard_rows), group_rows) for i in range(shards))
    names = (SHARD_NAME.format(n) for n in range(shards))
    return commit(dest, _write_all(fs, root, names, parts, threads), source)


def _read(fs, kind: str, files: list[str], schema: pa.Schema, source: str) -> Iterator[pa.RecordBatch]:
    """The files' rows in order, as batches; a file that cannot be read is one line naming it."""
    try:
        dataset = pads.dataset(files, format=kind, filesystem=fs, schema=schema)
        # Less readahead than pyarrow's (4 files, 16 batches): a task's memory is about its shards, not the scan.
        yield from dataset.to_batches(fragment_readahead=1, batch_readahead=READAHEAD_BATCHES)
    except FileNotFoundError:
        raise DatasetError(
            f"{source}: {_names(files)} not found where it was read; with --address every node needs the source "
            "in storage they all reach (s3://, gs://, or a folder every node mounts)"
        ) from None
    except (pa.ArrowInvalid, OSError) as err:
        raise DatasetError(f"{source}: {_names(files)} cannot be read as {kind} ({_first_line(err)})") from None


def _cut(batches: Iterable[pa.RecordBatch], shard_mb: float, row_group_mb: float) -> Iterator[tuple[pa.Table, int]]:
    """The stream cut into shards (and their row-group rows), sized by the first batch's bytes a row."""
    pending: list[pa.RecordBatch] = []
    buffered = 0
    sizes: tuple[int, int] | None = None
    for batch in batches:
        if batch.num_rows == 0:
            continue
        if sizes is None:
            sizes = shard_sizes(batch.nbytes / batch.num_rows, shard_mb, row_group_mb)
        pending.append(batch)
        buffered += batch.num_rows
        while buffered >= sizes[1]:
            table = pa.Table.from_batches(pending)
            yield table.slice(0, sizes[1]), sizes[0]
            rest = table.slice(sizes[1])
            pending, buffered = rest.to_batches(), rest.num_rows
    if buffered:
        yield pa.Table.from_batches(pending), sizes[0]


def _write_all(
    fs, root: str, names: Iterator[str], parts: Iterable[tuple[pa.Table, int]], writers: int
) -> list[Written]:
    """Write each (table, row-group rows) of `parts` as the next of `names`, `writers` at a time (at most that
    many shards in memory beyond the one being cut); the shards in order."""
    if writers <= 1:
        return [_write_shard(fs, root, name, table, rows) for (table, rows), name in zip(parts, names)]
    written: list[Written] = []
    pending: list[Future] = []
    with ThreadPoolExecutor(max_workers=writers) as pool:
        for (table, rows), name in zip(parts, names):
            if len(pending) >= writers:
                written.append(pending.pop(0).result())
            pending.append(pool.submit(_write_shard, fs, root, name, table, rows))
        written.extend(f.result() for f in pending)
    return written


def _write_shard(fs, root: str, name: str, table: pa.Table, group_rows: int) -> Written:
    collected: list[pq.FileMetaData] = []
    with fs.open(f"{root}/{name}", "wb") as handle:
        pq.write_table(table, handle, row_group_size=group_rows, metadata_collector=collected)
        size = handle.tell()
    meta = collected[0]
    return Written(
        path=name,
        bytes=size,
        row_groups=tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups)),
        schema=serialize_schema(meta.schema.to_arrow_schema()),  # what manifest.index() reads from a footer
    )


def _names(files: list[str]) -> str:
    return files[0] if len(files) == 1 else f"one of {files[0]} .. {files[-1]}"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _from_numpy(source: str) -> pa.Table:
    try:
        loaded = np.load(source, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise DatasetError(f"{source}: not a readable NumPy file ({err})") from None
    arrays = dict(loaded.items()) if isinstance(loaded, np.lib.npyio.NpzFile) else {"x": loaded}
    lengths = {name: len(a) for name, a in arrays.items()}
    if len(set(lengths.values())) != 1:
        raise DatasetError(f"{source}: arrays of different lengths {lengths}; each array is a column, one per row")
    return pa.table({name: _column(a) for name, a in arrays.items()})


def _column(array: np.ndarray) -> pa.Array:
    if array.ndim == 1:
        return pa.array(array)
    flat = array.reshape(len(array), -1)  # rows of higher rank become fixed-size lists of their values
    return pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])


def _from_generator(target: str, chunk: int = 65536) -> pa.Table:
    module_name, _, function_name = target.rpartition(":")
    try:
        if module_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location("elastic_prepare_source", module_name)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        function = getattr(module, function_name)
    except (ImportError, AttributeError, FileNotFoundError) as err:
        raise DatasetError(
            f"{target}: cannot load the generator ({err}); use module:function or file.py:function"
        ) from None
    batches = [pa.Table.from_pylist(rows) for rows in _chunks(function(), chunk)]
    return pa.concat_tables(batches) if batches else pa.table({})


def _chunks(rows: Iterator[dict], size: int) -> Iterator[list[dict]]:
    batch: list[dict] = []
    for row in rows:
        batch.append(row)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
