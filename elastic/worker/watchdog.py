"""The hang watchdog: a rank that makes no step progress for too long is ended, so its attempt fails and
restarts from the last committed checkpoint instead of holding its GPUs forever.

A rank stuck in a collective whose peer died, in a read from a mount that stopped answering, or in a report
barrier another rank never joins looks alive to Ray: no error, no restart, a node billed for nothing. Each rank
runs this watchdog in a thread of its own. When the rank has not finished a step for the timeout, it writes the
Python stacks of every thread of the process (faulthandler's dump, which reads frames without running Python
code in them) to the job's log and to the run folder (`hangs/`), tells the run ledger that the attempt ended
hung, waits a grace period (so the other ranks, stalled behind this one, dump theirs too) and exits the
process. Ray Train sees a worker die: the attempt counts against `failure.max_failures` and restarts from the
last committed checkpoint. A rank whose main thread holds the GIL forever cannot run this thread: faulthandler's
own C timer, re-armed by this thread every second, then dumps and exits the process a little later instead.

`HangTimeout` (pure) sets the timeout: `failure.hang_timeout_seconds` if given (0: off), else derived from the
slowest step and save measured so far, never below a floor of a few minutes.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable

_log = logging.getLogger(__name__)

FLOOR_SECONDS = 180.0  # the derived timeout's floor: an evaluation pass between steps must not look hung
STEP_FACTOR = 20.0  # the derived timeout: this many of the slowest step ...
SAVE_FACTOR = 3.0  # ... plus this many of the slowest save (a synchronous save happens inside a step)
GRACE_SECONDS = 10.0  # between the dump and the exit: the other ranks' watchdogs dump theirs meanwhile
BACKSTOP_EXTRA_SECONDS = 30.0  # faulthandler's C timer fires this long after the watchdog should have
EXIT_CODE = 124  # as timeout(1): the process was ended for making no progress


class HangTimeout:
    """Pure: the timeout in seconds (None: off) from the configured value or the measured step and save times."""

    def __init__(self, configured: float | None, floor: float = FLOOR_SECONDS):
        self.configured = configured
        self.floor = floor
        self.slowest_step = 0.0
        self.slowest_save = 0.0

    def stepped(self, seconds: float) -> None:
        self.slowest_step = max(self.slowest_step, seconds)

    def saved(self, seconds: float) -> None:
        self.slowest_save = max(self.slowest_save, seconds)

    def seconds(self) -> float | None:
        if self.configured is not None:
            return self.configured if self.configured > 0 else None
        return max(self.floor, STEP_FACTOR * self.slowest_step + SAVE_FACTOR * self.slowest_save)

    def describe(self) -> str:
        if self.configured is not None:
            return "failure.hang_timeout_seconds"
        return (
            f"derived: max({self.floor:g} s, {STEP_FACTOR:g} x slowest step {self.slowest_step:.2f} s + "
            f"{SAVE_FACTOR:g} x slowest save {self.slowest_save:.2f} s)"
        )


class NoWatchdog:
    """Null object: the watchdog is off (failure.hang_timeout_seconds: 0)."""

    def progress(self, step: int) -> None:
        pass

    def saved(self, seconds: float) -> None:
        pass

    def pause(self) -> None:
        pass

    def stop(self) -> None:
        pass


class HangWatchdog:
    """One rank's watchdog. `progress(step)` after every step arms it (the first call) and resets its clock;
    `pause()` before a wait that is not a hang (until the next progress); `stop()` as the worker leaves.

    `on_hang(step)` runs once it fires, before the exit (the session records the attempt's end there); `write`
    keeps the stacks in the run folder; `exit` ends the process (tests pass their own)."""

    def __init__(
        self,
        rank: int,
        timeout: HangTimeout,
        on_hang: Callable[[int], None] = lambda step: None,
        write: Callable[[str], None] = lambda stacks: None,
        grace_seconds: float = GRACE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        exit: Callable[[int], None] = os._exit,
        poll_seconds: float = 1.0,
    ):
        self.rank = rank
        self.timeout = timeout
        self._on_hang, self._write, self._exit = on_hang, write, exit
        self._grace, self._clock, self._poll = grace_seconds, clock, poll_seconds
        self._last: float | None = None  # None: not armed (before the first step, or paused)
        self._step = 0
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired = False

    def progress(self, step: int) -> None:
        now = self._clock()
        if self._last is not None and step > self._step:
            self.timeout.stepped((now - self._last) / (step - self._step))
        self._last, self._step = now, step
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="elastic-hang-watchdog", daemon=True)
            self._thread.start()

    def saved(self, seconds: float) -> None:
        self.timeout.saved(seconds)

    def pause(self) -> None:
        self._last = None
        faulthandler.cancel_dump_traceback_later()

    def stop(self) -> None:
        self._stopped.set()
        faulthandler.cancel_dump_traceback_later()

    def check(self) -> bool:
        """One look (the thread's loop calls it): fire if the rank has been still for the timeout."""
        limit, last = self.timeout.seconds(), self._last
        if limit is None or last is None or self.fired:
            return False
        still = self._clock() - last
        if still < limit:
            _arm_backstop(limit - still + self._grace + BACKSTOP_EXTRA_SECONDS)
            return False
        self._fire(still, limit)
        return True

    def _watch(self) -> None:
        while not self._stopped.wait(self._poll):
            if self.check():
                return

    def _fire(self, still: float, limit: float) -> None:
        self.fired = True
        faulthandler.cancel_dump_traceback_later()
        stacks = dump_stacks()
        _log.error(
            f"hang: rank {self.rank} made no step progress for {still:.0f} s after step {self._step} (timeout "
            f"{limit:.0f} s, {self.timeout.describe()}); ending this attempt as a failure, to restart from the "
            f"last committed checkpoint. Stacks of rank {self.rank}:\n{stacks}"
        )
        # Neither may hold the exit up: either could itself be stuck behind the hang (a storage call).
        _bounded(lambda: self._write(stacks), self._grace / 2)
        _bounded(lambda: self._on_hang(self._step), self._grace / 2)
        time.sleep(self._grace)
        self._exit(EXIT_CODE)


def session_watchdog(rank: int, configured: float | None, store, placement: str | None, attempt: Callable):
    """A session's watchdog: the stacks it dumps are kept in the run folder (`hangs/`), and `attempt()` (the
    session's attempt ledger) records that the attempt ended hung."""
    if configured == 0:
        return NoWatchdog()
    name = f"{store.root}/hangs/{placement or 'attempt'}-{int(time.time())}-rank-{rank}.txt"

    def write(stacks: str) -> None:
        store.fs.makedirs(f"{store.root}/hangs", exist_ok=True)
        with store.fs.open(name, "w") as handle:
            handle.write(stacks)

    def ended(step: int) -> None:
        attempt().hung(step)
        attempt().close()

    return HangWatchdog(rank, HangTimeout(configured), on_hang=ended, write=write)


def dump_stacks() -> str:
    """Every thread's Python stack, as faulthandler writes it (it needs a real file: a temporary one)."""
    with tempfile.TemporaryFile(mode="w+") as handle:
        faulthandler.dump_traceback(file=handle, all_threads=True)
        handle.flush()
        handle.seek(0)
        return handle.read()


def _arm_backstop(seconds: float) -> None:
    """faulthandler's C timer, for a main thread that holds the GIL and starves the watchdog's: it dumps every
    stack to the process's stderr (fd 2: Ray swaps sys.stderr in its workers for an object without a file)
    and exits."""
    stream = sys.__stderr__
    if stream is None:
        return
    try:
        faulthandler.dump_traceback_later(seconds, exit=True, file=stream)
    except (ValueError, OSError):  # stderr closed: no backstop, the watchdog thread still works
        pass


def _bounded(work: Callable[[], None], seconds: float) -> None:
    """Run `work` in a thread and wait for it at most `seconds`; a failure is logged, never raised."""

    def run() -> None:
        try:
            work()
        except Exception as err:  # the watchdog's exit must happen whatever the bookkeeping does
            _log.warning(f"hang watchdog: {err}")

    thread = threading.Thread(target=run, name="elastic-hang-report", daemon=True)
    thread.start()
    thread.join(seconds)
