"""The preemption watcher: polls a notice source (preemption.py) and drains this Ray node once per reclaim.

The drain goes through a `Drainer` (drain.py) with a deadline a safety margin before the cloud's; the watcher
keeps polling afterwards. Metadata outages back off exponentially (capped, jittered) and never end the daemon; a
drain Ray rejects is retried on the next poll; Azure events are acknowledged once drained. Policies are pure
functions; clock, sleep, randomness and output are injected so tests run the loop in microseconds.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

from elastic.errors import DrainError, ElasticError, MetadataUnavailable
from elastic.preemption.drain import Drainer, RayDrainer
from elastic.preemption.notices import DEFAULT_METADATA_URL, Notice, NoticeSource, detect_provider, make_source

# ---------------------------------------------------------------------------------------------------------
# policies (pure) and the watcher loop


def drain_deadline(notice_deadline: float, now: float, margin_s: float) -> float:
    """When Ray should consider the node gone: the cloud's deadline less the margin, never before now."""
    return max(now, notice_deadline - max(0.0, margin_s))


def backoff_delay(failures: int, base_s: float, cap_s: float, jitter: float, rand: float) -> float:
    """Delay after `failures` consecutive failures: base, 2x base, 4x ... capped, stretched by up to `jitter`.

    Never shorter than the base (the normal poll interval), so an outage never polls faster than health does.
    """
    nominal = min(cap_s, base_s * 2 ** max(0, failures - 1))
    return max(base_s, nominal) * (1.0 + jitter * rand)


@dataclass(frozen=True)
class WatchConfig:
    poll_seconds: float = 5.0  # AWS asks for about one poll every 5 s
    margin_seconds: float = 2.0  # drain deadline = cloud deadline - margin (clock skew, the drain RPC)
    backoff_cap_seconds: float = 30.0  # longest wait between failing polls (inside AWS's 2 minutes)
    jitter: float = 0.2


@dataclass
class WatchState:
    """What the watcher knows, for logs and tests."""

    drained: dict[str, float] = field(default_factory=dict)  # reclaim key -> drain deadline (accepted drains)
    pending: dict[str, Notice] = field(default_factory=dict)  # reclaims whose drain is not accepted yet
    to_ack: dict[str, tuple[Notice, float]] = field(default_factory=dict)  # Azure: drained, not yet acknowledged
    acked: set[str] = field(default_factory=set)
    rebalance: Notice | None = None
    logged: set[str] = field(default_factory=set)  # keys of notices and malformed bodies already logged
    failures: int = 0  # consecutive failed polls


log = logging.getLogger(__name__)


def log_line(message: str, clock: Callable[[], float] = time.time) -> None:
    """One timestamped line per event (the daemon's log file is read by people across clock domains)."""
    ts = datetime.fromtimestamp(clock(), timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    log.info("%s watch-preemption: %s", ts, message)


class Watcher:
    def __init__(
        self,
        source: NoticeSource,
        drainer: Drainer,
        config: WatchConfig = WatchConfig(),
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        emit: Callable[[str], None] | None = None,
        rand: Callable[[], float] = random.random,
    ):
        self.source, self.drainer, self.config = source, drainer, config
        self.clock, self.sleep, self.rand = clock, sleep, rand
        self.emit = emit or (lambda message: log_line(message, clock))
        self.state = WatchState()

    def step(self) -> float:
        """One poll and whatever it calls for; returns the seconds to wait before the next poll."""
        state, config = self.state, self.config
        try:
            poll = self.source.poll()
        except MetadataUnavailable as err:
            state.failures += 1
            delay = backoff_delay(
                state.failures, config.poll_seconds, config.backoff_cap_seconds, config.jitter, self.rand()
            )
            self.emit(
                f"metadata service unavailable ({err}); backing off {delay:.1f} s (failure {state.failures} in a row)"
            )
            self._retry_pending()  # a drain we already owe does not wait for the metadata service
            return delay
        if state.failures:
            self.emit(f"metadata service answering again after {state.failures} failed poll(s)")
            state.failures = 0
        for path, body in poll.malformed:
            key = f"malformed:{path}:{body}"
            if key not in state.logged:  # once per distinct body: a broken document must not flood the log
                state.logged.add(key)
                self.emit(f"malformed document at {path} ignored (treated as no notice): {body[:200]!r}")
        for notice in poll.notices:
            self._observe(notice)
        self._retry_pending()
        self._acknowledge_due()
        return config.poll_seconds

    def _observe(self, notice: Notice) -> None:
        state = self.state
        new = notice.key not in state.logged
        state.logged.add(notice.key)
        if notice.kind == "reclaim":
            if new:
                left = (notice.deadline or 0) - self.clock()
                self.emit(f"reclaim notice ({notice.provider}): {notice.detail}; the node goes in {left:.1f} s")
            if notice.key not in state.drained:
                state.pending[notice.key] = notice
        elif notice.kind == "rebalance":
            state.rebalance = notice
            if new:
                self.emit(
                    f"rebalance recommendation ({notice.provider}): {notice.detail}; no drain until a reclaim notice"
                )
        elif new:
            self.emit(f"event ({notice.provider}): {notice.detail}")

    def _retry_pending(self) -> None:
        for key, notice in list(self.state.pending.items()):
            self._drain(key, notice)

    def _drain(self, key: str, notice: Notice) -> None:
        now = self.clock()
        deadline = drain_deadline(notice.deadline or now, now, self.config.margin_seconds)
        message = f"spot reclaim: {notice.detail}"
        self.emit(
            f"drain requested: reason PREEMPTION, deadline in {deadline - now:.1f} s "
            f"(cloud deadline - {self.config.margin_seconds:g} s margin)"
        )
        try:
            outcome = self.drainer.drain(deadline, message)
        except ElasticError as err:  # GCS unreachable, node not found or ambiguous: retried on the next poll
            self.emit(f"drain failed: {err}; retrying on the next poll")
            return
        if not outcome.accepted:
            self.emit(
                f"drain rejected by Ray for node {outcome.node_id}: {outcome.reason or 'no reason given'}; "
                "retrying on the next poll"
            )
            return
        self.emit(f"drain accepted by Ray for node {outcome.node_id}")
        del self.state.pending[key]
        self.state.drained[key] = deadline
        if notice.event_id:
            self.state.to_ack[key] = (notice, deadline)

    def _acknowledge_due(self) -> None:
        # Acknowledging lets the cloud go ahead early, so it waits for the drain deadline Ray was given: the run's
        # just-in-time checkpoint keeps its whole window.
        for key, (notice, deadline) in list(self.state.to_ack.items()):
            if self.clock() < deadline:
                continue
            try:
                self.source.acknowledge(notice)
            except MetadataUnavailable as err:
                self.emit(f"acknowledging {notice.event_id} failed ({err}); retrying on the next poll")
                continue
            del self.state.to_ack[key]
            self.state.acked.add(key)
            self.emit(f"acknowledged scheduled event {notice.event_id} (drained; ready for the reclaim)")

    def run(self, once: bool = False, max_polls: int | None = None) -> bool:
        """Poll until stopped (or once); True if the last poll reached the metadata service."""
        polls = 0
        while True:
            started = self.clock()
            delay = self.step()
            polls += 1
            if once or (max_polls is not None and polls >= max_polls):
                return self.state.failures == 0
            self.sleep(max(0.0, delay - (self.clock() - started)))


def drain_now(
    drainer: Drainer,
    seconds: float,
    margin_s: float,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
    emit: Callable[[str], None] = log_line,
) -> int:
    """This node is shutting down now (a Kubernetes preStop hook, a VM's shutdown): drain it with a deadline
    `seconds - margin_s` from now, then hold until that deadline or until Ray has ended the node, so Ray and the
    run's just-in-time checkpoint keep going while the platform waits for this command. 1 if the drain failed."""
    started = clock()
    deadline = started + max(0.0, seconds - max(0.0, margin_s))
    try:
        outcome = drainer.drain(deadline, f"node shutting down: drain requested with {seconds:g} s left")
    except ElasticError as err:  # DrainError, ClusterError: no Ray node to drain, nothing to hold for
        emit(f"{err}; not holding the shutdown")
        return 1
    if outcome.accepted:
        emit(
            f"draining node {outcome.node_id}, deadline in {deadline - started:.1f} s; holding the shutdown until then"
        )
    else:  # e.g. the spot watcher drained it a moment ago: the run still needs the node up until the deadline
        emit(
            f"Ray rejected the drain of node {outcome.node_id} ({outcome.reason or 'no reason given'}); "
            "holding the shutdown anyway while the node is up"
        )
    while clock() < deadline:
        if not drainer.is_alive():
            emit(f"node {outcome.node_id} has ended (it was idle, or its work moved): releasing the shutdown")
            return 0 if outcome.accepted else 1
        sleep(min(1.0, deadline - clock()))
    emit(f"drain deadline reached for node {outcome.node_id}: releasing the shutdown")
    return 0 if outcome.accepted else 1


def watch(
    provider: str = "auto",
    metadata_url: str | None = None,
    drainer: Drainer | None = None,
    address: str | None = None,
    node_id: str | None = None,
    config: WatchConfig = WatchConfig(),
    once: bool = False,
    emit: Callable[[str], None] = log_line,
) -> int:
    """The `elastic watch-preemption` daemon; returns its exit status (0 also off-cloud under --provider auto).

    Runs until killed unless `once`. The node to drain: `drainer`, else a RayDrainer for `node_id` (default:
    this host's Ray node) on the cluster at `address` (default: RAY_ADDRESS, else the one this host joined).
    """
    url = metadata_url or DEFAULT_METADATA_URL
    if provider == "auto":
        detected = detect_provider(url)
        if detected is None:
            emit(f"no cloud metadata service answers at {url} (not on AWS, GCP or Azure): nothing to watch, exiting")
            return 0
        emit(f"detected the {detected} metadata service at {url}")
        provider = detected
    drainer = drainer or RayDrainer(address=address, node_id=node_id)
    target = "the Ray node"
    if isinstance(drainer, RayDrainer):
        # Resolve the node now: an ambiguous host is the user's to fix (exit 2); a node not registered yet is
        # looked up again when a notice comes.
        try:
            target = f"Ray node {drainer.node_id()} (GCS {drainer.gcs_address()})"
        except DrainError as err:
            emit(f"{err}; looking again when a notice comes")
    emit(
        f"watching {provider} spot notices at {url} every {config.poll_seconds:g} s; a reclaim drains {target} "
        f"{config.margin_seconds:g} s before the cloud's deadline"
    )
    source = make_source(provider, url, poll_seconds=config.poll_seconds)
    watcher = Watcher(source, drainer, config, emit=emit)
    reached = watcher.run(once=once)
    # Only --once returns: 1 if the service was down or a drain it called for did not go through.
    return 0 if reached and not watcher.state.pending else 1
