"""Spot-notice sources: AWS IMDSv2, GCP metadata, Azure Scheduled Events; and which of them answers here.

Each source turns its cloud's metadata protocol into `Notice`s: a *reclaim* (the node goes at `deadline`), a
*rebalance* recommendation (AWS: elevated risk, no deadline; logged, never drained) or *info* (other events,
logged once). A poll that cannot reach the service (timeout, connection error, 5xx) raises MetadataUnavailable;
a document that does not parse is reported in `Poll.malformed` and means no notice. What to do with notices is
watcher.py's; the bridge to Ray's drain API is drain.py's.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Protocol

from elastic.errors import MetadataUnavailable

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
        raise MetadataUnavailable(
            f"{where}: {type(reason).__name__ if isinstance(reason, Exception) else ''} {reason}".strip()
        ) from None


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

    def __init__(
        self,
        url: str = DEFAULT_METADATA_URL,
        timeout_s: float = 2.0,
        token_ttl_s: int = AWS_TOKEN_TTL_S,
        clock: Callable[[], float] = time.time,
    ):
        self.url, self.timeout_s, self.token_ttl_s, self.clock = url.rstrip("/"), timeout_s, token_ttl_s, clock
        self._token: str | None = None
        self._token_expires = 0.0

    def _fetch_token(self) -> str:
        resp = request(
            "PUT",
            f"{self.url}/latest/api/token",
            {"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl_s)},
            self.timeout_s,
        )
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
                notices.append(
                    Notice(
                        "aws",
                        "reclaim",
                        f"aws-{action}-{doc['time']}",
                        f"spot instance-action {action} at {doc['time']}",
                        deadline=when,
                    )
                )
            except (ValueError, KeyError, TypeError, OverflowError):  # OverflowError: a time past year 9999
                malformed.append((self.ACTION, resp.body))
        resp = self._get(self.REBALANCE)
        if resp.status == 200:
            try:
                at = str(json.loads(resp.body)["noticeTime"])
                notices.append(
                    Notice(
                        "aws",
                        "rebalance",
                        f"aws-rebalance-{at}",
                        f"EC2 rebalance recommendation (noticeTime {at}): elevated reclaim risk",
                    )
                )
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

    def __init__(
        self,
        url: str = DEFAULT_METADATA_URL,
        timeout_s: float = 2.0,
        wait_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ):
        self.url, self.timeout_s, self.clock = url.rstrip("/"), timeout_s, clock
        self.wait_s = max(1, round(wait_s)) if wait_s > 0 else 0  # timeout_sec is whole seconds
        self._etag: str | None = None
        self._first_seen: dict[str, float] = {}  # what -> when this watcher first saw it (the deadline's base)

    def poll(self) -> Poll:
        notices, malformed = [], []
        if self._etag and self.wait_s:
            # Long poll: returns at once if the value moved past our ETag, else on change or after wait_s.
            query = urllib.parse.urlencode(
                {"wait_for_change": "true", "last_etag": self._etag, "timeout_sec": self.wait_s}
            )
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
        return Notice(
            "gcp",
            "reclaim",
            f"gcp-{what}-{seen:.3f}",
            f"{detail} (GCP gives ~{GCP_NOTICE_S:.0f} s)",
            deadline=seen + GCP_NOTICE_S,
        )

    def acknowledge(self, notice: Notice) -> None:
        pass  # GCP has nothing to acknowledge


# ---------------------------------------------------------------------------------------------------------
# Azure: Scheduled Events


class AzureSource:
    provider = "azure"
    EVENTS = "/metadata/scheduledevents"
    NAME = "/metadata/instance/compute/name"
    HEADERS = {"Metadata": "true"}

    def __init__(
        self,
        url: str = DEFAULT_METADATA_URL,
        timeout_s: float = 2.0,
        vm_name: str | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.url, self.timeout_s, self.clock = url.rstrip("/"), timeout_s, clock
        self.vm_name = vm_name
        self.incarnation: int | None = None
        self._first_seen: dict[str, float] = {}

    def _events_url(self) -> str:
        return f"{self.url}{self.EVENTS}?api-version={AZURE_API_VERSION}"

    def _lookup_vm_name(self) -> None:
        try:
            resp = request(
                "GET",
                f"{self.url}{self.NAME}?api-version={AZURE_NAME_API_VERSION}&format=text",
                self.HEADERS,
                self.timeout_s,
            )
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
            incarnation, events = doc["DocumentIncarnation"], doc.get("Events") or []
            if not isinstance(incarnation, int) or not isinstance(events, list):
                raise TypeError("DocumentIncarnation must be a number and Events a list")
        except (ValueError, KeyError, TypeError, AttributeError):
            return Poll(malformed=((self.EVENTS, resp.body),))
        # The incarnation changes whenever the event list does; events are keyed by EventId, so an unchanged
        # document never produces a second drain, and a changed one is read in full.
        self.incarnation = incarnation
        notices, malformed = [], []
        for event in events:
            if not _well_formed_azure_event(event):
                # One broken event must not hide a well-formed Preempt next to it: skip just this one.
                malformed.append((self.EVENTS, json.dumps(event, sort_keys=True)))
                continue
            resources = event.get("Resources") or []
            if self.vm_name and resources and self.vm_name not in resources:
                continue  # another VM's event (documents cover the whole availability set)
            event_id, kind = str(event["EventId"]), str(event.get("EventType", ""))
            if kind == "Preempt":
                seen = self._first_seen.setdefault(event_id, self.clock())
                deadline = _parse_http_date(event.get("NotBefore")) or seen + AZURE_MIN_NOTICE_S
                notices.append(
                    Notice(
                        "azure",
                        "reclaim",
                        f"azure-{event_id}",
                        f"scheduled event Preempt {event_id} NotBefore {event.get('NotBefore') or '-'}",
                        deadline=deadline,
                        event_id=event_id,
                    )
                )
            else:
                notices.append(
                    Notice(
                        "azure",
                        "info",
                        f"azure-{event_id}-{event.get('EventStatus')}",
                        f"scheduled event {kind} {event_id} ({event.get('EventStatus')}, "
                        f"NotBefore {event.get('NotBefore') or '-'}): not a preemption, no drain",
                    )
                )
        return Poll(tuple(notices), tuple(malformed))

    def acknowledge(self, notice: Notice) -> None:
        """Approve the event (StartRequests): tells Azure we are ready, so it may go ahead before NotBefore."""
        body = json.dumps({"StartRequests": [{"EventId": notice.event_id}]}).encode()
        resp = request(
            "POST", self._events_url(), {**self.HEADERS, "Content-Type": "application/json"}, self.timeout_s, data=body
        )
        if resp.status != 200:
            raise _unexpected(f"POST {self.EVENTS}", resp)


def _well_formed_azure_event(event) -> bool:
    """An event this watcher can act on: a mapping with a scalar EventId, string type/status, Resources a list of
    VM names, NotBefore a string (an HTTP date, or empty once the event started)."""
    return (
        isinstance(event, dict)
        and isinstance(event.get("EventId"), (str, int))
        and not isinstance(event.get("EventId"), bool)
        and all(isinstance(event.get(k), (str, type(None))) for k in ("EventType", "EventStatus", "NotBefore"))
        and isinstance(event.get("Resources"), (list, type(None)))
        and all(isinstance(r, str) for r in event.get("Resources") or [])
    )


def _parse_http_date(text) -> float | None:
    if not text:
        return None
    try:
        return email.utils.parsedate_to_datetime(str(text)).timestamp()
    except (TypeError, ValueError, OverflowError):
        return None


# ---------------------------------------------------------------------------------------------------------
# provider detection


def detect_provider(url: str = DEFAULT_METADATA_URL, timeout_s: float = 1.0) -> str | None:
    """Which cloud's metadata service answers at `url`, each probed once and briefly; None off-cloud."""
    base = url.rstrip("/")
    probes = {
        "aws": lambda: (
            (
                r := request(
                    "PUT", f"{base}/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "60"}, timeout_s
                )
            ).status
            == 200
            and bool(r.body.strip())
        ),
        "gcp": lambda: (
            (r := request("GET", base + GcpSource.PREEMPTED, GcpSource.HEADERS, timeout_s)).status == 200
            and r.headers.get("Metadata-Flavor") == "Google"
        ),
        "azure": lambda: (
            request(
                "GET",
                f"{base}{AzureSource.NAME}?api-version={AZURE_NAME_API_VERSION}&format=text",
                AzureSource.HEADERS,
                timeout_s,
            ).status
            == 200
        ),
    }
    for provider, probe in probes.items():
        try:
            if probe():
                return provider
        except MetadataUnavailable:
            continue
    return None


def make_source(
    provider: str,
    url: str = DEFAULT_METADATA_URL,
    timeout_s: float = 2.0,
    poll_seconds: float = 5.0,
    clock: Callable[[], float] = time.time,
) -> NoticeSource:
    if provider == "aws":
        return AwsSource(url, timeout_s, clock=clock)
    if provider == "gcp":
        return GcpSource(url, timeout_s, wait_s=poll_seconds, clock=clock)
    if provider == "azure":
        return AzureSource(url, timeout_s, clock=clock)
    raise ValueError(f"unknown provider {provider!r}; expected one of {', '.join(PROVIDERS)}")
