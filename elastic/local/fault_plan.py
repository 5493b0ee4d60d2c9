"""Which S3 requests the fault-injecting proxy (elastic.local.s3_faults) breaks, and how: a pure, seeded plan.

Two sources of faults, checked in this order for every request:
- windows: while one is open, every request it matches fails the same way (an outage, a throttling storm);
  it closes after a number of seconds, after a number of failed requests, or when closed by hand;
- rates: each request draws once from the plan's random stream and fails with the configured probability
  of each kind.

The random stream is seeded, and each request draws exactly once whatever happens, so the sequence of
decisions is the same for the same seed and the same request order. No I/O here: the proxy carries the
decisions out, and these rules are unit-tested without a network.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

# What a request can suffer. "latency" delays it and then lets it through; the others fail it.
ERROR_500 = "500"  # InternalError
SLOW_DOWN = "503"  # SlowDown: S3's throttling answer
RESET = "reset"  # the connection is reset in the middle of the request's or the response's body
LATENCY = "latency"
FAILING_KINDS = (ERROR_500, SLOW_DOWN, RESET)
KINDS = (*FAILING_KINDS, LATENCY)


@dataclass(frozen=True)
class Match:
    """Which requests a window or the rates apply to: HTTP methods (empty: all) and a substring of the path
    (e.g. `/step-` for checkpoint files, `.distcp` for shards)."""

    methods: tuple[str, ...] = ()
    path_contains: str = ""

    def __call__(self, method: str, path: str) -> bool:
        return (not self.methods or method.upper() in self.methods) and self.path_contains in path

    @classmethod
    def from_json(cls, data: dict) -> Match:
        return cls(tuple(m.upper() for m in data.get("methods") or ()), str(data.get("path_contains") or ""))


@dataclass(frozen=True)
class Rates:
    """Probability per request of each fault kind (their sum at most 1), and the delay a latency fault adds."""

    error_500: float = 0.0
    slow_down: float = 0.0
    reset: float = 0.0
    latency: float = 0.0
    latency_seconds: float = 0.5
    match: Match = Match()

    def __post_init__(self) -> None:
        probabilities = (self.error_500, self.slow_down, self.reset, self.latency)
        if any(p < 0 for p in probabilities) or sum(probabilities) > 1 + 1e-9:
            raise ValueError(f"fault rates must be >= 0 and add up to at most 1, got {probabilities}")
        if self.latency_seconds < 0:
            raise ValueError(f"latency_seconds must be >= 0, got {self.latency_seconds}")

    def pick(self, draw: float) -> str | None:
        """The fault kind a draw in [0, 1) lands on, or None."""
        edge = 0.0
        for kind, probability in (
            (ERROR_500, self.error_500),
            (SLOW_DOWN, self.slow_down),
            (RESET, self.reset),
            (LATENCY, self.latency),
        ):
            edge += probability
            if draw < edge:
                return kind
        return None

    @classmethod
    def from_json(cls, data: dict) -> Rates:
        known = {"error_500", "slow_down", "reset", "latency", "latency_seconds"}
        unknown = set(data) - known - {"match"}
        if unknown:
            raise ValueError(f"unknown fault rate fields {sorted(unknown)}; use {sorted(known | {'match'})}")
        values = {k: float(v) for k, v in data.items() if k in known}
        return cls(**values, match=Match.from_json(data.get("match") or {}))


@dataclass
class Window:
    """Every matching request fails with `kind` until `seconds` have passed or `requests` have failed (None:
    no such limit; a window without either stays open until closed)."""

    kind: str
    match: Match = Match()
    seconds: float | None = None
    requests: int | None = None
    opened_at: float = 0.0
    failed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAILING_KINDS:
            raise ValueError(f"window kind {self.kind!r}: use one of {', '.join(FAILING_KINDS)}")

    def is_open(self, now: float) -> bool:
        if self.seconds is not None and now - self.opened_at >= self.seconds:
            return False
        return self.requests is None or self.failed < self.requests

    @classmethod
    def from_json(cls, data: dict) -> Window:
        seconds, requests = data.get("seconds"), data.get("requests")
        return cls(
            kind=str(data.get("kind", SLOW_DOWN)),
            match=Match.from_json(data.get("match") or {}),
            seconds=None if seconds is None else float(seconds),
            requests=None if requests is None else int(requests),
        )


@dataclass(frozen=True)
class Decision:
    """What to do with one request: `kind` None lets it through untouched."""

    number: int  # the request's number, from 1, in arrival order
    kind: str | None
    delay: float = 0.0
    source: str = ""  # "window" or "rate"


@dataclass
class FaultPlan:
    """The proxy's state: the seeded stream, the rates, the open windows and what was injected so far."""

    seed: int = 0
    rates: Rates = Rates()
    clock: Callable[[], float] = time.monotonic
    windows: list[Window] = field(default_factory=list)
    requests: int = 0
    injected: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)

    def decide(self, method: str, path: str) -> Decision:
        self.requests += 1
        draw = self._random.random()  # always one draw: later decisions do not depend on the windows
        now = self.clock()
        self.windows = [w for w in self.windows if w.is_open(now)]
        for window in self.windows:
            if window.match(method, path):
                window.failed += 1
                return self._record(Decision(self.requests, window.kind, source="window"))
        if not self.rates.match(method, path):
            return Decision(self.requests, None)
        kind = self.rates.pick(draw)
        if kind is None:
            return Decision(self.requests, None)
        delay = self.rates.latency_seconds if kind == LATENCY else 0.0
        return self._record(Decision(self.requests, kind, delay, source="rate"))

    def open_window(self, window: Window) -> Window:
        window.opened_at = self.clock()
        self.windows.append(window)
        return window

    def close_windows(self) -> int:
        closed, self.windows = len(self.windows), []
        return closed

    def snapshot(self) -> dict:
        now = self.clock()
        return {
            "seed": self.seed,
            "requests": self.requests,
            "injected": {kind: self.injected[kind] for kind in KINDS},
            "open_windows": sum(1 for w in self.windows if w.is_open(now)),
        }

    def _record(self, decision: Decision) -> Decision:
        self.injected[decision.kind] += 1
        return decision
