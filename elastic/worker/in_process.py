"""A run that trains in its Tune trainable's own process: a one-worker sweep or pack trial on a GPU share (a
"light" trial, elastic.sweep.trial). The job's function runs right there, through the same worker entry, with
no Train controller, worker group or helper actors. Inside a Tune trainable Ray Train's own calls are refused
(`ray.train.get_context` raises there), so while such a run trains (`running_in_process`) this module stands in
for what the session takes from Ray Train:

- the context: rank 0 of 1, and where the run's checkpoints live (`InProcessContext`, `RunStorage`);
- the reports: each goes to `forward` (on to Tune, elastic.sweep.tune_reports) instead of Ray Train;
- the reclaim notice: this node's drain, from the GCS's draining nodes (what Ray Train's preemption watcher
  reads for a worker group), so the just-in-time checkpoint still happens (`DrainNotices`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from elastic.storage import pyarrow_filesystem
from elastic.worker.jit import Notice

Forward = Callable[[dict, "str | None"], None]


class RunStorage:
    """What the session uses of Ray Train's StorageContext: the run's name, its checkpoint folders' paths and
    their filesystem."""

    def __init__(self, run_uri: str, run_name: str):
        self.experiment_dir_name = run_name
        self.storage_filesystem, self._root = pyarrow_filesystem(run_uri)

    def build_checkpoint_path_from_name(self, name: str) -> str:
        return f"{self._root.rstrip('/')}/{name}"


class InProcessContext:
    """What the session reads of Ray Train's context, for the one worker of a light trial."""

    def __init__(self, run_uri: str, run_name: str, forward: Forward):
        self.storage, self.forward = RunStorage(run_uri, run_name), forward

    def get_world_rank(self) -> int:
        return 0

    def get_world_size(self) -> int:
        return 1

    def get_local_rank(self) -> int:
        return 0

    def get_storage(self) -> RunStorage:
        return self.storage


_active: InProcessContext | None = None


@contextmanager
def running_in_process(run_uri: str, run_name: str, forward: Forward) -> Iterator[InProcessContext]:
    """While the block runs, the session of this process trains in process (one at a time per process)."""
    global _active
    if _active is not None:
        raise RuntimeError(f"{_active.storage.experiment_dir_name} already trains in this process")
    _active = InProcessContext(run_uri, run_name, forward)
    try:
        yield _active
    finally:
        _active = None


def in_process() -> bool:
    return _active is not None


def train_context():
    """Ray Train's context in a worker group's worker; the in-process one while a light trial trains."""
    if _active is not None:
        return _active
    import ray.train

    return ray.train.get_context()


def report_in_process(metrics: dict, checkpoint=None) -> bool:
    """A report of a light trial's session: to its `forward` (Tune), never to Ray Train. False outside one."""
    if _active is None:
        return False
    _active.forward(dict(metrics), getattr(checkpoint, "path", None) if checkpoint is not None else None)
    return True


class DrainNotices:
    """A notice source for the session (elastic.worker.jit): this node's drain, read from the GCS at most every
    `every` seconds (the training loop asks at every step)."""

    def __init__(self, node_id: str, every: float = 1.0, read: Callable[[], dict] | None = None, clock=time.monotonic):
        self.node_id, self.every, self._clock = node_id, every, clock
        self._read = read or _draining_nodes
        self._last: float | None = None
        self._notice: Notice | None = None

    def __call__(self) -> Notice | None:
        if self._notice is not None:
            return self._notice  # a drain is not taken back
        now = self._clock()
        if self._last is not None and now - self._last < self.every:
            return None
        self._last = now
        try:
            deadline_ms = self._read().get(self.node_id)
        except Exception:  # the GCS did not answer this time: ask again in a second
            return None
        if deadline_ms is None:
            return None
        self._notice = Notice(deadline=deadline_ms / 1000.0 if deadline_ms else None, node_ids=(self.node_id,))
        return self._notice


def _draining_nodes() -> dict:
    """{node id: drain deadline in unix ms (0: none)}. ray._private.state is what Ray Train's preemption watcher
    and our driver's capacity view (elastic.driver.capacity) read; Ray 2.60 has no public call for it."""
    import ray

    return dict(ray._private.state.state.get_draining_nodes() or {})
