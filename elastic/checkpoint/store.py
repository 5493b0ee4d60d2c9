"""The checkpoints of a run in storage: listing, commit markers, verification and retention (no
torch.distributed; the sharded async saves are elastic.checkpoint.checkpointer's).

Layout of a run folder (``<checkpoint.uri>/<run name>/``)::

    step-000000120/.metadata         torch.distributed.checkpoint (DCP) metadata, written by rank 0 last
    step-000000120/__0_0.distcp      shards: every rank writes its share in parallel (replicated DDP state is
    step-000000120/__1_0.distcp      split across ranks by DCP's planner, not all written by rank 0)
    step-000000120/COMMITTED.json    the commit marker and manifest: written after every shard is durable

A folder without its marker is not a checkpoint (a torn save, or one being deleted). Retention removes the
marker first and the shards after, and only ever after a newer checkpoint has committed, so a crash at any
moment leaves the latest committed checkpoint loadable.
"""

from __future__ import annotations

import json
import pickle
import re
import time
from dataclasses import dataclass, field
from typing import Any

from elastic.config.spec import JobSpec
from elastic.storage import fsspec_filesystem, fsspec_options, parse_uri


def run_directory(spec: JobSpec, run_name: str) -> str:
    """URI of a run's folder, <checkpoint.uri>/<run name>: where Ray Train keeps the run (its storage_path is
    checkpoint.uri and its run name the folder's) and where every rank and the driver find its checkpoints."""
    return parse_uri(spec.checkpoint.uri).child(run_name).uri


MARKER = "COMMITTED.json"
DCP_METADATA = ".metadata"
# Left in a pruned checkpoint's folder: Ray Train's run snapshot still names the folder and refuses to resume
# a run whose snapshot points at a path that no longer exists.
TOMBSTONE = "RETIRED"
# A Ray Train function's reported checkpoint folder, kept inside the step folder beside the shards.
ATTACHED = "files"
PINS = "pins"  # <run>/pins/<holder>.json: {"step": N}, a checkpoint someone is about to copy (PBT's exploit)
_STEP_FOLDER = re.compile(r"^step-(\d{9})$")


def file_ends(storage_data: dict | None) -> dict[str, int]:
    """File name -> where its last item ends, from DCP metadata's storage_data: the file's size as written."""
    ends: dict[str, int] = {}
    for info in (storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    return ends


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str  # inside the filesystem (no scheme)
    uri: str
    committed: bool
    time: float | None = None
    world_size: int | None = None
    size_bytes: int = 0
    shards: int = 0
    files: dict[str, int] = field(default_factory=dict)
    reason: str | None = None  # why it was written: periodic, just-in-time (a reclaim notice) or final

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "uri": self.uri,
            "committed": self.committed,
            "time": self.time,
            "world_size": self.world_size,
            "size_bytes": self.size_bytes,
            "shards": self.shards,
            "reason": self.reason,
        }


class CheckpointStore:
    """The checkpoints of one run: listing, commit markers, verification and retention. No torch.distributed.

    Pruned checkpoints are retired, not removed: marker first, then a tombstone, then the shards. The folder
    never vanishes, so Ray Train's run snapshot (which lists every reported checkpoint) stays valid."""

    def __init__(self, run_uri: str):
        self.run_uri = run_uri.rstrip("/")
        self.location = parse_uri(self.run_uri)
        self.fs, self.root = fsspec_filesystem(self.run_uri)

    # -- naming
    @staticmethod
    def folder_name(step: int) -> str:
        return f"step-{step:09d}"

    def path(self, step: int) -> str:
        return f"{self.root}/{self.folder_name(step)}"

    def uri(self, step: int) -> str:
        return f"{self.run_uri}/{self.folder_name(step)}"

    def writer_options(self) -> dict:
        """fsspec options for torch's FsspecWriter/Reader (endpoint, region; credentials from the AWS chain)."""
        return fsspec_options(self.location)

    # -- reading
    def list(self) -> list[CheckpointInfo]:
        """Every step folder that is not retired, oldest first, committed or not."""
        return [self.info(step) for step in sorted(self.live_folders())]

    def scan(self) -> dict[int, set[str]]:
        """Step -> the names of the files in its folder, from one recursive listing (retention runs after
        every save: per-folder requests grew with the run's age)."""
        self.fs.invalidate_cache(self.root)
        try:
            try:
                paths = self.fs.find(self.root, prefix="step-")  # s3fs/gcsfs: list only the step folders
            except TypeError:
                paths = self.fs.find(self.root)
        except FileNotFoundError:
            return {}
        folders: dict[int, set[str]] = {}
        root = self.root.rstrip("/") + "/"
        for path in paths:
            folder, _, name = path[len(root) :].partition("/") if path.startswith(root) else ("", "", "")
            match = _STEP_FOLDER.match(folder)
            if match and name:
                folders.setdefault(int(match.group(1)), set()).add(name)
        return folders

    def live_folders(self) -> dict[int, set[str]]:
        """Step -> the names of its files, for every step folder not retired, from one listing."""
        return {step: names for step, names in self.scan().items() if TOMBSTONE not in names}

    def info(self, step: int) -> CheckpointInfo:
        path = self.path(step)
        manifest = self._read_marker(step)
        if manifest is None:
            files = self._sizes(path)
            return CheckpointInfo(
                step,
                path,
                self.uri(step),
                committed=False,
                size_bytes=sum(files.values()),
                shards=sum(1 for f in files if f.endswith(".distcp")),
                files=files,
            )
        files = {k: int(v) for k, v in manifest["files"].items()}
        return CheckpointInfo(
            step,
            path,
            self.uri(step),
            committed=True,
            time=manifest.get("time"),
            world_size=manifest.get("world_size"),
            size_bytes=sum(files.values()),
            shards=sum(1 for f in files if f.endswith(".distcp")),
            files=files,
            reason=manifest.get("reason"),
        )

    def restorable_steps(self) -> list[int]:
        """The committed steps, oldest first, for a restore, which tries the newest first. Torn saves newer
        than the latest commit (a crash mid-upload) are deleted on the way: the next save of the same step
        would otherwise reuse their folder, stale shards included."""
        folders = self.live_folders()
        committed = sorted(step for step, names in folders.items() if MARKER in names)
        for step, names in sorted(folders.items()):
            if MARKER not in names and (not committed or step > committed[-1]):
                self.delete(step)
        return committed

    def latest_committed(self) -> CheckpointInfo | None:
        committed = [step for step, names in self.live_folders().items() if MARKER in names]
        return self.info(max(committed)) if committed else None

    def manifest(self, step: int) -> dict | None:
        return self._read_marker(step)

    # -- writing
    def commit(
        self, step: int, world_size: int, extra: dict | None = None, files: dict[str, int] | None = None
    ) -> CheckpointInfo:
        """Write the marker, listing every file with its size. Call once all shards and .metadata exist.
        `files` (name -> size, from the writer that just wrote them) saves listing the folder."""
        path = self.path(step)
        files = dict(files) if files is not None else self._sizes(path)
        if DCP_METADATA not in files:
            raise RuntimeError(f"{self.uri(step)} has no {DCP_METADATA}; the save did not finish")
        manifest = {"step": step, "time": time.time(), "world_size": world_size, "files": files, **(extra or {})}
        self.fs.pipe_file(f"{path}/{MARKER}", json.dumps(manifest, indent=1).encode())
        return CheckpointInfo(
            step,
            path,
            self.uri(step),
            committed=True,
            time=manifest["time"],
            world_size=world_size,
            size_bytes=sum(files.values()),
            shards=sum(1 for f in files if f.endswith(".distcp")),
            files=files,
            reason=manifest.get("reason"),
        )

    def retain(self, keep: int, keep_every: int | None = None) -> list[int]:
        """Delete all but the newest `keep` committed checkpoints (and every `keep_every`-th step), and any
        uncommitted folder older than the newest committed one. Returns the deleted steps. Lists the run
        folder: the process that commits the checkpoints prunes through `Retention`, which does not."""
        return self.prune(self.live_folders(), keep, keep_every)

    def prune(
        self, folders: dict[int, set[str]], keep: int, keep_every: int | None = None, pinned: set[int] = frozenset()
    ) -> list[int]:
        """Retention over `folders` (step -> its file names, the marker among them if committed): retire or
        delete what `prunable` picks, dropping each from `folders` once it is gone. Returns the deleted steps."""
        doomed = prunable({step: MARKER in names for step, names in folders.items()}, keep, keep_every, pinned)
        for step in doomed:
            names = folders[step]
            if MARKER in names:
                self.retire(step, names if len(names) > 1 else None)  # only the marker known: retire() lists
            else:
                self.delete(step)
            del folders[step]  # only once deleted: a failure leaves it to the next pruning
        return doomed

    def remove_torn(self) -> list[int]:
        """Delete uncommitted folders older than the newest committed checkpoint (failed saves): they can
        never be loaded, and no one else tracks them. Returns the deleted steps."""
        infos = self.list()
        committed = [i.step for i in infos if i.committed]
        if not committed:
            return []
        torn = [i.step for i in infos if not i.committed and i.step < committed[-1]]
        for step in torn:
            self.delete(step)
        return torn

    # -- pins: checkpoints another run is about to copy, which retention keeps
    def pin(self, step: int, holder: str) -> None:
        """Keep `step` through retention until `holder` unpins it (one pin per holder: a new one replaces it)."""
        self.fs.makedirs(f"{self.root}/{PINS}", exist_ok=True)  # a local folder needs it; object stores have none
        self.fs.pipe_file(f"{self.root}/{PINS}/{holder}.json", json.dumps({"step": step, "time": time.time()}).encode())

    def unpin(self, holder: str) -> None:
        try:
            self.fs.rm(f"{self.root}/{PINS}/{holder}.json")
        except FileNotFoundError:
            pass

    def pinned_steps(self) -> set[int]:
        """The steps pinned now, from one listing of the pins folder (unreadable pins are skipped)."""
        folder = f"{self.root}/{PINS}"
        self.fs.invalidate_cache(folder)
        try:
            names = [p for p in self.fs.ls(folder, detail=False) if p.endswith(".json")]
        except FileNotFoundError:
            return set()
        steps = set()
        for name in names:
            try:
                steps.add(int(json.loads(self.fs.cat_file(name))["step"]))
            except (FileNotFoundError, ValueError, KeyError, TypeError):
                continue  # unpinned meanwhile, or torn
        return steps

    def retire(self, step: int, names: set[str] | None = None) -> None:
        """Prune a committed checkpoint: marker first (from then on it is not a checkpoint), then a tombstone,
        then the shards, in one batched delete. The folder stays, holding only the tombstone. `names`: the
        folder's files, when the caller knows them (no listing)."""
        path = self.path(step)
        self.fs.invalidate_cache(path)
        try:
            self.fs.rm(f"{path}/{MARKER}")
        except FileNotFoundError:
            pass
        tombstone = f"step {step} pruned by retention at {time.time():.0f}\n"
        self.fs.pipe_file(f"{path}/{TOMBSTONE}", tombstone.encode())
        remaining = self._sizes(path) if names is None else names
        doomed = [f"{path}/{name}" for name in sorted(remaining) if name not in (MARKER, TOMBSTONE)]
        if doomed:
            self.fs.rm(doomed)

    def delete(self, step: int) -> None:
        """Remove a folder no one else tracks (a failed save). Marker first: from that moment the folder is
        not a checkpoint, whatever happens to the rest."""
        path = self.path(step)
        marker = f"{path}/{MARKER}"
        self.fs.invalidate_cache(path)
        if self.fs.exists(marker):
            self.fs.rm(marker)
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass

    # -- verification
    def verify(self, step: int) -> list[str]:
        """Problems with a checkpoint (empty list: every shard present, readable and sized as recorded)."""
        manifest = self._read_marker(step)
        if manifest is None:
            return [f"{self.uri(step)}: no commit marker ({MARKER}); not a committed checkpoint"]
        path = self.path(step)
        actual = self._sizes(path)
        problems = []
        for name, size in manifest["files"].items():
            if name not in actual:
                problems.append(f"{name}: missing")
            elif actual[name] != int(size):
                problems.append(f"{name}: {actual[name]} bytes, manifest says {size}")
        if DCP_METADATA in actual:
            problems += self._check_dcp_metadata(path, actual)
        return problems

    def read_tensors(self, step: int) -> dict[str, Any]:
        """Every tensor of a checkpoint, read back in this process (no process group): for comparisons
        and inspection. Keys are DCP's flattened names, e.g. `model.module.head.weight`, `optim.state...`."""
        # torch only here: the store is used by the CLI (`elastic checkpoints`), which should start fast.
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = FsspecReader(self.uri(step), **self.writer_options()).read_metadata()
        state = {
            key: torch.empty(meta.size, dtype=meta.properties.dtype)
            for key, meta in metadata.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)
        }
        dcp.load(state, storage_reader=FsspecReader(self.uri(step), **self.writer_options()), no_dist=True)
        return {**state, **self._attached_tensors(step)}

    def _attached_tensors(self, step: int) -> dict[str, Any]:
        """The tensors in an attached folder (what a Ray Train function reported, a Trainer saved): safetensors
        files and torch-saved state dicts, under `files/<name>/<dotted key>`."""
        import io

        import torch

        found: dict[str, Any] = {}
        manifest = self._read_marker(step) or {}
        for name in sorted(manifest.get("files", {})):
            if not name.startswith(f"{ATTACHED}/"):
                continue
            if name.endswith(".safetensors"):
                from safetensors.torch import load as load_safetensors  # with transformers: its files only

                loaded = load_safetensors(self.fs.cat_file(f"{self.path(step)}/{name}"))
            elif name.endswith((".pt", ".pth", ".bin")):
                try:
                    loaded = torch.load(io.BytesIO(self.fs.cat_file(f"{self.path(step)}/{name}")), weights_only=False)
                except Exception:  # not a torch file after all: nothing to compare in it
                    continue
            else:
                continue
            found.update(_flatten_tensors(loaded, f"{name}/"))
        return found

    def _check_dcp_metadata(self, path: str, actual: dict[str, int]) -> list[str]:
        """Every byte range DCP's metadata points at must lie inside an existing shard file."""
        try:
            with self.fs.open(f"{path}/{DCP_METADATA}", "rb") as handle:
                metadata = pickle.load(handle)
        except Exception as err:  # any unreadable metadata is a broken checkpoint, whatever the cause
            return [f"{DCP_METADATA}: unreadable ({type(err).__name__})"]
        problems = []
        for name, end in sorted(file_ends(metadata.storage_data).items()):
            if name not in actual:
                problems.append(f"{name}: missing (the metadata references it)")
            elif actual[name] < end:
                problems.append(f"{name}: {actual[name]} bytes, the metadata needs {end}")
        return problems

    def _read_marker(self, step: int) -> dict | None:
        # Another process may have committed since this one listed the folder: never trust s3fs's cache.
        self.fs.invalidate_cache(self.path(step))
        try:
            with self.fs.open(f"{self.path(step)}/{MARKER}", "r") as handle:
                return json.load(handle)
        except FileNotFoundError:
            return None

    def _sizes(self, path: str) -> dict[str, int]:
        """Name (relative to the folder: an attached folder's files are ATTACHED/...) -> size, every file."""
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.find(path, detail=True)
        except FileNotFoundError:
            return {}
        base = path.rstrip("/") + "/"
        found = {}
        for name, entry in entries.items():
            name = name[len(base) :] if name.startswith(base) else name.rsplit("/", 1)[-1]
            if entry.get("type") == "file" and name not in (MARKER, TOMBSTONE):
                found[name] = int(entry.get("size") or 0)
        return found


def _flatten_tensors(value: Any, prefix: str) -> dict[str, Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return {prefix.rstrip("."): value}
    if isinstance(value, dict):
        found: dict[str, Any] = {}
        for key, item in value.items():
            found.update(_flatten_tensors(item, f"{prefix}{key}."))
        return found
    if isinstance(value, (list, tuple)):
        found = {}
        for index, item in enumerate(value):
            found.update(_flatten_tensors(item, f"{prefix}{index}."))
        return found
    return {}


def prunable(
    folders: dict[int, bool], keep: int, keep_every: int | None = None, pinned: set[int] = frozenset()
) -> list[int]:
    """The steps retention deletes, from the live step folders (step -> committed): every folder older than the
    newest commit except the newest `keep` committed ones, the committed multiples of `keep_every` and the
    `pinned` ones. Folders newer than the newest commit are saves in flight; without any commit nothing is
    deleted."""
    committed = sorted(step for step, is_committed in folders.items() if is_committed)
    if not committed:
        return []
    kept = set(committed[-keep:])
    if keep_every:
        kept |= {step for step in committed if step % keep_every == 0}
    kept |= set(committed) & set(pinned)
    return sorted(step for step in folders if step not in kept and step < committed[-1])


class Retention:
    """Pruning by the process that commits a run's checkpoints (rank 0), after each commit.

    The run folder is listed once, on first use; from then on this process's own commits and failed saves
    keep the view current (no one else writes the run's checkpoints meanwhile: one placement at a time). A
    listing per save grew with the run's age, since every retired folder keeps its tombstone: with 3,000 of
    them a listing took 1 s on the local endpoint, on every save."""

    def __init__(self, store: CheckpointStore, keep: int, keep_every: int | None = None):
        self.store, self.keep, self.keep_every = store, keep, keep_every
        self.honor_pins = False  # a sweep trial's: another trial may be about to copy a checkpoint (PBT)
        self._folders: dict[int, set[str]] | None = None  # live step folder -> its files (MARKER if committed)

    def committed(self, step: int, files: dict[str, int] | None = None) -> list[int]:
        """Record a commit (`files`: what it wrote, as in its manifest) and prune. Returns the deleted steps."""
        folders = self._view()
        folders[step] = set(files or {}) | {MARKER}
        pinned = self.store.pinned_steps() if self.honor_pins else set()
        return self.store.prune(folders, self.keep, self.keep_every, pinned)

    def failed(self, step: int) -> None:
        """Record a save that did not commit: its folder may hold some shards, deleted once a newer one commits."""
        self._view().setdefault(step, set())

    def _view(self) -> dict[int, set[str]]:
        if self._folders is None:
            self._folders = self.store.live_folders()
        return self._folders
