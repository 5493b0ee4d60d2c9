"""Appending to the run ledger through fsspec, on object stores as on local disks.

Object stores have no append, and the driver and rank 0 of a worker group write at the same time: so each
writing process owns its objects, `<run>/ledger/<start ms>-<source>-<id>-<segment>.jsonl`, and rewrites only
its current segment (a few hundred lines at most, then it starts the next), never another writer's. Reading
the ledger is listing that folder and merging every line by time.

Writes happen in a background thread (at most every `flush_seconds`), so recording an event never waits on
storage; `flush()` writes now (before a process ends). A failed write is logged once and retried at the next
flush: the ledger never stops a run.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid

from elastic.ledger.events import Event
from elastic.storage import fsspec_filesystem

log = logging.getLogger(__name__)

LEDGER_FOLDER = "ledger"
SEGMENT_EVENTS = 400  # lines per object before a writer starts its next: bounds what each flush rewrites


class NoLedger:
    """Null object: nothing recorded (not rank 0, or no run folder)."""

    def record(self, event: Event) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class LedgerWriter:
    """One process's writer: `record(event)` from any thread, flushed in the background."""

    def __init__(self, run_uri: str, source: str, flush_seconds: float = 5.0, segment_events: int = SEGMENT_EVENTS):
        self.fs, root = fsspec_filesystem(run_uri.rstrip("/"))
        self.folder = f"{root}/{LEDGER_FOLDER}"
        self._prefix = f"{int(time.time() * 1000):013d}-{source}-{uuid.uuid4().hex[:8]}"
        self._segment_events = segment_events
        self._flush_seconds = flush_seconds
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # one write at a time: the thread's and an explicit flush()
        self._segments: list[list[str]] = [[]]
        self._dirty: set[int] = set()
        self._warned = False
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="elastic-ledger", daemon=True)
        self._thread.start()

    def record(self, event: Event) -> None:
        line = json.dumps(event.to_dict(), default=str)
        with self._lock:
            if len(self._segments[-1]) >= self._segment_events:
                self._segments.append([])
            self._segments[-1].append(line)
            self._dirty.add(len(self._segments) - 1)

    def flush(self) -> None:
        with self._write_lock:
            with self._lock:
                dirty, self._dirty = sorted(self._dirty), set()
                contents = {index: "\n".join(self._segments[index]) + "\n" for index in dirty}
            failed = set()
            for index, text in contents.items():
                try:
                    self.fs.makedirs(self.folder, exist_ok=True)
                    with self.fs.open(f"{self.folder}/{self._prefix}-{index:04d}.jsonl", "w") as handle:
                        handle.write(text)
                except Exception as err:  # storage hiccup: kept dirty, written at the next flush
                    failed.add(index)
                    if not self._warned:
                        self._warned = True
                        log.warning("run ledger: could not write %s (%s: %s)", self.folder, type(err).__name__, err)
            if failed:
                with self._lock:
                    self._dirty |= failed

    def close(self) -> None:
        self._closed.set()
        self.flush()

    def _loop(self) -> None:
        while not self._closed.wait(self._flush_seconds):
            if self._dirty:
                self.flush()


def read_ledger(run_uri: str) -> list[Event]:
    """Every event of the run folder's ledger, by time (lines that do not parse, e.g. a torn last line on a
    local disk, are skipped)."""
    fs, root = fsspec_filesystem(run_uri.rstrip("/"))
    folder = f"{root}/{LEDGER_FOLDER}"
    fs.invalidate_cache(folder)
    try:
        names = [p for p in fs.ls(folder, detail=False) if p.endswith(".jsonl")]
    except FileNotFoundError:
        return []
    events: list[Event] = []
    for name in sorted(names):
        # One GET of the object as it is now: a writer (this process's own flush thread, among others) replaces
        # its file whole while runs go on, and an open handle pinned to the listed ETag would fail on the read
        # (s3fs's FileExpired, seen in a driver's end-of-run read under load).
        try:
            text = fs.cat_file(name).decode("utf-8", errors="replace")
        except FileNotFoundError:
            continue
        for line in text.splitlines():
            try:
                data = json.loads(line)
            except ValueError:
                continue
            event = Event.from_dict(data) if isinstance(data, dict) else None
            if event is not None:
                events.append(event)
    events.sort(key=lambda e: e.time)
    return events
