"""Spot-notice sources (AWS IMDSv2, GCP metadata, Azure Scheduled Events) and the watcher that drains the Ray node.

Each source turns its cloud's metadata protocol into `Notice`s: a *reclaim* (the node goes at `deadline`), a
*rebalance* recommendation (AWS: elevated risk, no deadline; logged, never drained) or *info* (other events,
logged once). The `Watcher` polls a source, drains this Ray node once per reclaim through a `Drainer`
(drain.py) with a deadline a safety margin before the cloud's, and keeps polling. Metadata outages back off
exponentially (capped, jittered) and never end the daemon. Clock, sleep and output are injected for tests.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import random
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Mapping, Protocol

from elastic.drain import Drainer
from elastic.errors import ElasticError, MetadataUnavailable

PROVIDERS = ("aws", "gcp", "azure")
# Every cloud serves instance metadata on this link-local address (GCP also as metadata.google.internal, which
# needs DNS; the address works everywhere and fails fast off-cloud).
DEFAULT_METADATA_URL = "http://169.254.169.254"
GCP_NOTICE_S = 30.0  # GCP's preemption notice; the metadata server gives no deadline, so: first seen + 30 s
AZURE_MIN_NOTICE_S = 30.0  # Azure's minimum Preempt notice, used when NotBefore is empty (event already started)
AWS_TOKEN_TTL_S = 21600
AZURE_API_VERSION = "2020-07-01"
AZURE_NAME_API_VERSION = "2021-02-01"
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # link-local: never through HTTP_PROXY


@dataclass(frozen=True)
class Notice:
    provider: str
    kind: str  # "reclaim" (drain), "rebalance" (AWS early warning: log only) or "info" (log only)
    key: str  # identity: one drain (or one log line) per key
    detail: str
    deadline: float | None = None  # epoch seconds at which the cloud takes the node (reclaims)
    event_id: str | None = None  # Azure: the scheduled event to acknowledge once drained


@dataclass(frozen=True)
class Poll:
    notices: tuple[Notice, ...] = ()
    malformed: tuple[tuple[str, str], ...] = ()  # (path, body) of documents that did not parse: no notice


@dataclass(frozen=True)
class Response:
    status: int
    headers: Mapping[str, str]
    body: str


def request(method: str, url: str, headers: Mapping[str, str], timeout: float, data: bytes | None = None) -> Response:
    """One metadata request. 5xx, timeouts and connection errors raise MetadataUnavailable; other statuses return."""
    where = f"{method} {urllib.parse.urlsplit(url).path}"
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers))
    try:
        with _NO_PROXY.open(req, timeout=timeout) as resp:
            return Response(resp.status, dict(resp.headers), resp.read().decode("utf-8", "replace"))
    except urllib.error.HTTPError as err:
        body = err.read().decode("utf-8", "replace") if err.fp else ""
        if err.code >= 500:
            raise MetadataUnavailable(f"{where}: HTTP {err.code}") from None
        return Response(err.code, dict(err.headers or {}), body)
    except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
        reason = getattr(err, "reason", None) or err
        raise MetadataUnavailable(f"{where}: {type(reason).__name__ if isinstance(reason, Exception) else ''} "
                                  f"{reason}".strip()) from None


def _unexpected(where: str, resp: Response) -> MetadataUnavailable:
    return MetadataUnavailable(f"{where}: unexpected HTTP {resp.status}")


class NoticeSource(Protocol):
    provider: str

    def poll(self) -> Poll: ...

    def acknowledge(self, notice: Notice) -> None: ...


# ---------------------------------------------------------------------------------------------------------
# AWS: IMDSv2


class AwsSource:
    provider = "aws"
    ACTION = "/latest/meta-data/spot/instance-action"
    REBALANCE = "/latest/meta-data/events/recommendations/rebalance"

    def __init__(self, url: str = DEFAULT_METADATA_URL, timeout_s: float = 2.0, token_ttl_s: int = AWS_TOKEN_TTL_S,
                 clock: Callable[[], float] = time.time):
        self.url, self.timeout_s, self.token_ttl_s, self.clock = url.rstrip("/"), timeout_s, token_ttl_s, clock
        self._token: str | None = None
        self._token_expires = 0.0

    def _fetch_token(self) -> str:
        resp = request("PUT", f"{self.url}/latest/api/token",
                       {"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl_s)}, self.timeout_s)
        if resp.status != 200 or not resp.body:
            raise _unexpected("PUT /latest/api/token", resp)
        # Refresh well before expiry: at 80% of the TTL (a poll in flight must not carry a dying token).
        self._token, self._token_expires = resp.body.strip(), self.clock() + 0.8 * self.token_ttl_s
        return self._token

    def _get(self, path: str) -> Response:
        if self._token is None or self.clock() >= self._token_expires:
            self._fetch_token()
        resp = request("GET", self.url + path, {"X-aws-ec2-metadata-token": self._token or ""}, self.timeout_s)
        if resp.status == 401:  # expired or revoked early (IMDS restarted): one fresh token, one retry
            resp = request("GET", self.url + path, {"X-aws-ec2-metadata-token": self._fetch_token()}, self.timeout_s)
        if resp.status not in (200, 404):
            raise _unexpected(f"GET {path}", resp)
        return resp

    def poll(self) -> Poll:
        notices, malformed = [], []
        resp = self._get(self.ACTION)
        if resp.status == 200:
            try:
                doc = json.loads(resp.body)
                action, when = str(doc["action"]), _parse_iso(doc["time"])
                notices.append(Notice("aws", "reclaim", f"aws-{action}-{doc['time']}",
                                      f"spot instance-action {action} at {doc['time']}", deadline=when))
            except (ValueError, KeyError, TypeError):
                malformed.append((self.ACTION, resp.body))
        resp = self._get(self.REBALANCE)
        if resp.status == 200:
            try:
                at = str(json.loads(resp.body)["noticeTime"])
                notices.append(Notice("aws", "rebalance", f"aws-rebalance-{at}",
                                      f"EC2 rebalance recommendation (noticeTime {at}): elevated reclaim risk"))
            except (ValueError, KeyError, TypeError):
                malformed.append((self.REBALANCE, resp.body))
        return Poll(tuple(notices), tuple(malformed))

    def acknowledge(self, notice: Notice) -> None:
        pass  # AWS has nothing to acknowledge


def _parse_iso(text) -> float:
    return datetime.fromisoformat(str(text).replace("Z", "+00:00")).astimezone(timezone.utc).timestamp()


# ---------------------------------------------------------------------------------------------------------
# GCP: instance/preempted (long-polled with wait_for_change) and instance/maintenance-event


class GcpSource:
    provider = "gcp"
    PREEMPTED = "/computeMetadata/v1/instance/preempted"
    MAINTENANCE = "/computeMetadata/v1/instance/maintenance-event"
    HEADERS = {"Metadata-Flavor": "Google"}

    def __init__(self, url: str = DEFAULT_METADATA_URL, timeout_s: float = 2.0, wait_s: float = 5.0,
                 clock: Callable[[], float] = time.time):
        self.url, self.timeout_s, self.clock = url.rstrip("/"), timeout_s, clock
        self.wait_s = max(1, round(wait_s)) if wait_s > 0 else 0  # timeout_sec is whole seconds
        self._etag: str | None = None
        self._first_seen: dict[str, float] = {}  # what -> when this watcher first saw it (the deadline's base)

    def poll(self) -> Poll:
        notices, malformed = [], []
        if self._etag and self.wait_s:
            # Long poll: returns at once if the value moved past our ETag, else on change or after wait_s.
            query = urllib.parse.urlencode({"wait_for_change": "true", "last_etag": self._etag,
                                            "timeout_sec": self.wait_s})
            resp = request("GET", f"{self.url}{self.PREEMPTED}?{query}", self.HEADERS, self.timeout_s + self.wait_s)
        else:
            resp = request("GET", self.url + self.PREEMPTED, self.HEADERS, self.timeout_s)
        if resp.status != 200:
            raise _unexpected(f"GET {self.PREEMPTED}", resp)
        self._etag = resp.headers.get("ETag") or resp.headers.get("Etag")
        value = resp.body.strip().upper()
        if value == "TRUE":
            notices.append(self._reclaim("preempted", "preempted=TRUE"))
        elif value == "FALSE":
            self._first_seen.pop("preempted", None)
        else:
            malformed.append((self.PREEMPTED, resp.body))
        resp = request("GET", self.url + self.MAINTENANCE, self.HEADERS, self.timeout_s)
        if resp.status == 200:
            event = resp.body.strip()
            if event.startswith("TERMINATE"):
                notices.append(self._reclaim("maintenance", f"maintenance-event={event}"))
            else:
                self._first_seen.pop("maintenance", None)
                if event and event != "NONE":
                    notices.append(Notice("gcp", "info", f"gcp-maintenance-{event}", f"maintenance-event={event}"))
        elif resp.status != 404:
            raise _unexpected(f"GET {self.MAINTENANCE}", resp)
        return Poll(tuple(notices), tuple(malformed))

    def _reclaim(self, what: str, detail: str) -> Notice:
        seen = self._first_seen.setdefault(what, self.clock())
        return Notice("gcp", "reclaim", f"gcp-{what}-{seen:.3f}", f"{detail} (GCP gives ~{GCP_NOTICE_S:.0f} s)",
                      deadline=seen + GCP_NOTICE_S)

    def acknowledge(self, notice: Notice) -> None:
        pass  # GCP has nothing to acknowledge


# ---------------------------------------------------------------------------------------------------------
# Azure: Scheduled Events


class AzureSource:
    provider = "azure"
    EVENTS = "/metadata/scheduledevents"
    NAME = "/metadata/instance/compute/name"
    HEADERS = {"Metadata": "true"}

    def __init__(self, url: str = DEFAULT_METADATA_URL, timeout_s: float = 2.0, vm_name: str | None = None,
                 clock: Callable[[], float] = time.time):
        self.url, self.timeout_s, self.clock = url.rstrip("/"), timeout_s, clock
        self.vm_name = vm_name
        self.incarnation: int | None = None
        self._first_seen: dict[str, float] = {}

    def _events_url(self) -> str:
        return f"{self.url}{self.EVENTS}?api-version={AZURE_API_VERSION}"

    def _lookup_vm_name(self) -> None:
        try:
            resp = request("GET", f"{self.url}{self.NAME}?api-version={AZURE_NAME_API_VERSION}&format=text",
                           self.HEADERS, self.timeout_s)
        except MetadataUnavailable:
            return  # unknown for now: every Preempt counts as ours; asked again next poll
        if resp.status == 200 and resp.body.strip():
            self.vm_name = resp.body.strip()

    def poll(self) -> Poll:
        if self.vm_name is None:
            self._lookup_vm_name()
        resp = request("GET", self._events_url(), self.HEADERS, self.timeout_s)
        if resp.status != 200:
            raise _unexpected(f"GET {self.EVENTS}", resp)
        try:
            doc = json.loads(resp.body)
            incarnation, events = doc["DocumentIncarnation"], list(doc.get("Events") or [])
        except (ValueError, KeyError, TypeError, AttributeError):
            return Poll(malformed=((self.EVENTS, resp.body),))
        # The incarnation changes whenever the event list does; events are keyed by EventId, so an unchanged
        # document never produces a second drain, and a changed one is read in full.
        self.incarnation = incarnation
        notices = []
        for event in events:
            if not isinstance(event, dict) or "EventId" not in event:
                continue
            resources = event.get("Resources") or []
            if self.vm_name and resources and self.vm_name not in resources:
                continue  # another VM's event (documents cover the whole availability set)
            event_id, kind = str(event["EventId"]), str(event.get("EventType", ""))
            if kind == "Preempt":
                seen = self._first_seen.setdefault(event_id, self.clock())
                deadline = _parse_http_date(event.get("NotBefore")) or seen + AZURE_MIN_NOTICE_S
                notices.append(Notice("azure", "reclaim", f"azure-{event_id}",
                                      f"scheduled event Preempt {event_id} NotBefore {event.get('NotBefore') or '-'}",
                                      deadline=deadline, event_id=event_id))
            else:
                notices.append(Notice("azure", "info", f"azure-{event_id}-{event.get('EventStatus')}",
                                      f"scheduled event {kind} {event_id} ({event.get('EventStatus')}, "
                                      f"NotBefore {event.get('NotBefore') or '-'}): not a preemption, no drain"))
        return Poll(tuple(notices))

    def acknowledge(self, notice: Notice) -> None:
        """Approve the event (StartRequests): tells Azure we are ready, so it may go ahead before NotBefore."""
        body = json.dumps({"StartRequests": [{"EventId": notice.event_id}]}).encode()
        resp = request("POST", self._events_url(), {**self.HEADERS, "Content-Type": "application/json"},
                       self.timeout_s, data=body)
        if resp.status != 200:
            raise _unexpected(f"POST {self.EVENTS}", resp)


def _parse_http_date(text) -> float | None:
    if not text:
        return None
    try:
        return email.utils.parsedate_to_datetime(str(text)).timestamp()
    except (TypeError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------------------
# provider detection


def detect_provider(url: str = DEFAULT_METADATA_URL, timeout_s: float = 1.0) -> str | None:
    """Which cloud's metadata service answers at `url`, each probed once and briefly; None off-cloud."""
    base = url.rstrip("/")
    probes = {
        "aws": lambda: (r := request("PUT", f"{base}/latest/api/token",
                                     {"X-aws-ec2-metadata-token-ttl-seconds": "60"}, timeout_s)).status == 200
        and bool(r.body.strip()),
        "gcp": lambda: (r := request("GET", base + GcpSource.PREEMPTED, GcpSource.HEADERS, timeout_s)).status == 200
        and r.headers.get("Metadata-Flavor") == "Google",
        "azure": lambda: request("GET", f"{base}{AzureSource.NAME}?api-version={AZURE_NAME_API_VERSION}&format=text",
                                 AzureSource.HEADERS, timeout_s).status == 200,
    }
    for provider, probe in probes.items():
        try:
            if probe():
                return provider
        except MetadataUnavailable:
            continue
    return None


def make_source(provider: str, url: str = DEFAULT_METADATA_URL, timeout_s: float = 2.0, poll_seconds: float = 5.0,
                clock: Callable[[], float] = time.time) -> NoticeSource:
    if provider == "aws":
        return AwsSource(url, timeout_s, clock=clock)
    if provider == "gcp":
        return GcpSource(url, timeout_s, wait_s=poll_seconds, clock=clock)
    if provider == "azure":
        return AzureSource(url, timeout_s, clock=clock)
    raise ValueError(f"unknown provider {provider!r}; expected one of {', '.join(PROVIDERS)}")


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
    margin_seconds: float = 5.0  # drain deadline = cloud deadline - margin
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


def log_line(message: str, clock: Callable[[], float] = time.time) -> None:
    ts = datetime.fromtimestamp(clock(), timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    print(f"{ts} watch-preemption: {message}", flush=True)


class Watcher:
    def __init__(self, source: NoticeSource, drainer: Drainer, config: WatchConfig = WatchConfig(),
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 emit: Callable[[str], None] | None = None, rand: Callable[[], float] = random.random):
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
            delay = backoff_delay(state.failures, config.poll_seconds, config.backoff_cap_seconds, config.jitter,
                                  self.rand())
            self.emit(f"metadata service unavailable ({err}); backing off {delay:.1f} s "
                      f"(failure {state.failures} in a row)")
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
                self.emit(f"rebalance recommendation ({notice.provider}): {notice.detail}; no drain until a "
                          "reclaim notice")
        elif new:
            self.emit(f"event ({notice.provider}): {notice.detail}")

    def _retry_pending(self) -> None:
        for key, notice in list(self.state.pending.items()):
            self._drain(key, notice)

    def _drain(self, key: str, notice: Notice) -> None:
        now = self.clock()
        deadline = drain_deadline(notice.deadline or now, now, self.config.margin_seconds)
        message = f"spot reclaim: {notice.detail}"
        self.emit(f"drain requested: reason PREEMPTION, deadline in {deadline - now:.1f} s "
                  f"(cloud deadline - {self.config.margin_seconds:g} s margin)")
        try:
            outcome = self.drainer.drain(deadline, message)
        except ElasticError as err:  # GCS unreachable, node not found or ambiguous: retried on the next poll
            self.emit(f"drain failed: {err}; retrying on the next poll")
            return
        if not outcome.accepted:
            self.emit(f"drain rejected by Ray for node {outcome.node_id}: {outcome.reason or 'no reason given'}; "
                      "retrying on the next poll")
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


def watch(provider: str = "auto", metadata_url: str | None = None, drainer: Drainer | None = None,
          address: str | None = None, node_id: str | None = None, config: WatchConfig = WatchConfig(),
          once: bool = False, emit: Callable[[str], None] = log_line) -> int:
    """The `elastic watch-preemption` daemon; returns its exit status (0 also off-cloud under --provider auto)."""
    from elastic.drain import DrainError, RayDrainer

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
    emit(f"watching {provider} spot notices at {url} every {config.poll_seconds:g} s; a reclaim drains {target} "
         f"{config.margin_seconds:g} s before the cloud's deadline")
    source = make_source(provider, url, poll_seconds=config.poll_seconds)
    ok = Watcher(source, drainer, config, emit=emit).run(once=once)
    return 0 if ok or not once else 1
