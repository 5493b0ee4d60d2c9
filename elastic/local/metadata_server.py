"""Cloud metadata servers of our own, on 127.0.0.1, speaking each provider's spot-notice protocol.

Tests point the preemption watcher at one of these instead of a cloud; the local cluster runs one per simulated
spot node so that `elastic preempt` can announce a reclaim the way a cloud would. Three protocols:

- aws: IMDSv2. `PUT /latest/api/token` (header `X-aws-ec2-metadata-token-ttl-seconds`, 1..21600) returns a token;
  every GET needs it in `X-aws-ec2-metadata-token` (401 when missing, unknown or expired). The notice is
  `/latest/meta-data/spot/instance-action` (404 until a reclaim, then `{"action", "time"}`) and the early warning
  `/latest/meta-data/events/recommendations/rebalance` (`{"noticeTime"}`).
- gcp: `GET /computeMetadata/v1/instance/preempted` (`TRUE`/`FALSE`) and `.../instance/maintenance-event`, both
  requiring `Metadata-Flavor: Google`, with an ETag and `?wait_for_change=true[&last_etag=E][&timeout_sec=N]`.
- azure: `GET|POST /metadata/scheduledevents?api-version=...` with `Metadata: true`: a `DocumentIncarnation` and
  `Events` (`Preempt` with `NotBefore`), acknowledged by POSTing `{"StartRequests": [{"EventId": ...}]}`; the
  VM name at `/metadata/instance/compute/name?api-version=...&format=text`.

Admin endpoints, outside every provider's paths and never counted with them:
`POST /_elastic/reclaim?notice=SECONDS`, `POST /_elastic/rebalance`, `POST /_elastic/clear`, `GET /_elastic/state`.

Standalone: `python -m elastic.local.metadata_server --provider aws --port 0 --port-file FILE`.
"""

from __future__ import annotations

import argparse
import email.utils
import hashlib
import json
import logging
import os
import secrets
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections import Counter
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from elastic import logs

log = logging.getLogger(__name__)

PROVIDERS = ("aws", "gcp", "azure")
ADMIN_PREFIX = "/_elastic/"
AWS_TOKEN_PATH = "/latest/api/token"
AWS_ACTION_PATH = "/latest/meta-data/spot/instance-action"
AWS_REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
AWS_MAX_TTL_S = 21600
GCP_PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
GCP_MAINTENANCE_PATH = "/computeMetadata/v1/instance/maintenance-event"
AZURE_EVENTS_PATH = "/metadata/scheduledevents"
AZURE_NAME_PATH = "/metadata/instance/compute/name"


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class MetadataServer:
    """One provider's metadata endpoint on 127.0.0.1 (port 0: any free port), served from a thread.

    State changes (`announce_*`, `clear`) and fault knobs are thread-safe; `requests` counts provider requests
    as `"METHOD /path"` (no query) so tests can assert on poll rates, token fetches and acks.
    """

    def __init__(self, provider: str, port: int = 0, vm_name: str = "elastic-vm-0"):
        if provider not in PROVIDERS:
            raise ValueError(f"provider must be one of {', '.join(PROVIDERS)}, got {provider!r}")
        self.provider = provider
        self.vm_name = vm_name
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # GCP wait_for_change waits on it
        self.requests: Counter[str] = Counter()
        self.acks: list[str] = []  # Azure EventIds acknowledged, in order
        self._tokens: dict[str, float] = {}  # AWS token -> expiry (monotonic)
        self._token_ttl_cap: float | None = None
        self._fail: list[tuple[int, str | None]] = []  # (status, path or None for any) per next request
        self._delay_s = 0.0
        self._malformed: str | None = None
        self.clear()
        server = self

        class Handler(_Handler):
            owner = server

        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._httpd.daemon_threads = True
        self._httpd.block_on_close = False  # a delayed handler must not hold up close()
        self._thread: threading.Thread | None = None

    # --- lifecycle -------------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MetadataServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"metadata-{self.provider}",
            daemon=True,
        )
        self._thread.start()
        return self

    def close(self) -> None:
        with self._changed:
            self._changed.notify_all()
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> MetadataServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # --- what the cloud announces ---------------------------------------------------------------------------
    def clear(self) -> None:
        """No notice of any kind (a fresh instance)."""
        with self._changed:
            self.reclaim_at: float | None = None  # epoch seconds of the reclaim
            self.rebalance_at: float | None = None
            self.action = "terminate"
            self.maintenance = "NONE"
            self.events: list[dict] = []
            self.incarnation = getattr(self, "incarnation", 0) + 1
            self._changed.notify_all()

    def announce_reclaim(self, notice_seconds: float = 120.0, action: str = "terminate") -> None:
        """A spot reclaim `notice_seconds` from now (GCP's notice is fixed: ~30 s, whatever this says)."""
        with self._changed:
            self.reclaim_at = time.time() + notice_seconds
            if self.provider == "azure":
                self.events.append(
                    {
                        "EventId": str(uuid.uuid4()).upper(),
                        "EventType": "Preempt",
                        "ResourceType": "VirtualMachine",
                        "Resources": [self.vm_name],
                        "EventStatus": "Scheduled",
                        "NotBefore": email.utils.formatdate(self.reclaim_at, usegmt=True),
                        "Description": "",
                        "EventSource": "Platform",
                        "DurationInSeconds": -1,
                    }
                )
                self.incarnation += 1
            self.action = action
            self._changed.notify_all()

    def announce_maintenance(self, value: str = "TERMINATE_ON_HOST_MAINTENANCE") -> None:
        """GCP only: the value of instance/maintenance-event."""
        with self._changed:
            self.maintenance = value
            self._changed.notify_all()

    def announce_event(self, event: dict) -> None:
        """Azure only: add a raw scheduled event (other VMs' events, other event types)."""
        with self._changed:
            self.events.append(dict(event))
            self.incarnation += 1

    def announce_rebalance(self) -> None:
        """AWS only: an EC2 rebalance recommendation (elevated risk of a reclaim; no deadline)."""
        with self._changed:
            self.rebalance_at = time.time()

    # --- fault knobs ----------------------------------------------------------------------------------
    def fail_next(self, count: int, status: int = 503, path: str | None = None) -> None:
        """Answer the next `count` provider requests (to `path` only, if given) with `status`."""
        with self._lock:
            self._fail += [(status, path)] * count

    def delay(self, seconds: float) -> None:
        """Hold every provider response this long (a slow or hung metadata service)."""
        with self._lock:
            self._delay_s = seconds

    def serve_malformed(self, body: str | None = '{"action": "terminate", "time": ') -> None:
        """Serve `body` instead of the notice document (None: back to normal)."""
        with self._lock:
            self._malformed = body

    def token_ttl(self, seconds: float | None) -> None:
        """AWS: cap every new token's TTL (short-lived tokens to test refresh); None: as requested."""
        with self._lock:
            self._token_ttl_cap = seconds

    def expire_tokens(self) -> None:
        with self._lock:
            self._tokens.clear()

    def state(self) -> dict:
        with self._lock:
            return {
                "provider": self.provider,
                "requests": dict(self.requests),
                "acks": list(self.acks),
                "reclaim_at": self.reclaim_at,
                "incarnation": self.incarnation,
            }

    # --- provider protocols (called by the handler, lock not held) ----------------------------------------
    def _take_fault(self, path: str) -> int | None:
        with self._lock:
            for i, (status, only) in enumerate(self._fail):
                if only is None or only == path:
                    del self._fail[i]
                    return status
        return None

    def _aws(self, method: str, path: str, headers, query) -> tuple[int, dict, str]:
        if method == "PUT" and path == AWS_TOKEN_PATH:
            try:
                ttl = int(headers.get("X-aws-ec2-metadata-token-ttl-seconds", ""))
            except ValueError:
                ttl = 0
            if not 1 <= ttl <= AWS_MAX_TTL_S:
                return 400, {}, "missing or invalid X-aws-ec2-metadata-token-ttl-seconds"
            token = secrets.token_urlsafe(24)
            with self._lock:
                lifetime = min(ttl, self._token_ttl_cap) if self._token_ttl_cap is not None else ttl
                self._tokens[token] = time.monotonic() + lifetime
            return 200, {"X-aws-ec2-metadata-token-ttl-seconds": str(ttl)}, token
        if method != "GET":
            return 405, {}, ""
        with self._lock:
            expiry = self._tokens.get(headers.get("X-aws-ec2-metadata-token", ""))
        if expiry is None or expiry <= time.monotonic():
            return 401, {}, ""  # IMDSv2 only: no, unknown or expired token
        if path == AWS_ACTION_PATH:
            if self._malformed is not None:
                return 200, {"Content-Type": "text/plain"}, self._malformed
            if self.reclaim_at is None:
                return 404, {}, ""
            return (
                200,
                {"Content-Type": "text/plain"},
                json.dumps({"action": self.action, "time": _iso(self.reclaim_at)}),
            )
        if path == AWS_REBALANCE_PATH:
            if self.rebalance_at is None:
                return 404, {}, ""
            return 200, {"Content-Type": "text/plain"}, json.dumps({"noticeTime": _iso(self.rebalance_at)})
        return 404, {}, ""

    def _gcp_value(self, path: str) -> str | None:
        if path == GCP_PREEMPTED_PATH:
            return self._malformed if self._malformed is not None else ("TRUE" if self.reclaim_at else "FALSE")
        if path == GCP_MAINTENANCE_PATH:
            return self.maintenance
        return None

    def _gcp(self, method: str, path: str, headers, query) -> tuple[int, dict, str]:
        if headers.get("Metadata-Flavor") != "Google":
            return 403, {}, "Missing Metadata-Flavor:Google header."
        if method != "GET":
            return 405, {}, ""
        with self._changed:
            value = self._gcp_value(path)
            if value is None:
                return 404, {}, ""
            if query.get("wait_for_change", [""])[0].lower() == "true":
                # Return at once if the caller's last_etag is stale, else when the value changes or the timeout ends.
                last = query.get("last_etag", [_etag(value)])[0]
                timeout = min(float(query.get("timeout_sec", ["60"])[0]), 60.0)
                end = time.monotonic() + timeout
                while _etag(value) == last and (left := end - time.monotonic()) > 0:
                    self._changed.wait(left)
                    value = self._gcp_value(path)
        return 200, {"Metadata-Flavor": "Google", "ETag": _etag(value), "Content-Type": "application/text"}, value

    def _azure(self, method: str, path: str, headers, query, body: bytes) -> tuple[int, dict, str]:
        if headers.get("Metadata") != "true":
            return 400, {}, json.dumps({"error": "Bad request. Required metadata header not specified"})
        if "api-version" not in query:
            return 400, {}, json.dumps({"error": "Bad request. api-version was not specified in the request"})
        if path == AZURE_NAME_PATH and method == "GET":
            return 200, {"Content-Type": "text/plain"}, self.vm_name
        if path != AZURE_EVENTS_PATH:
            return 404, {}, ""
        if method == "POST":
            try:
                ids = [r["EventId"] for r in json.loads(body)["StartRequests"]]
            except (ValueError, KeyError, TypeError):
                return 400, {}, json.dumps({"error": "Bad request. StartRequests expected"})
            with self._lock:
                for event in self.events:
                    if event["EventId"] in ids:
                        event["EventStatus"] = "Started"
                        self.acks.append(event["EventId"])
                self.incarnation += 1
            return 200, {}, ""
        if self._malformed is not None:
            return 200, {"Content-Type": "application/json"}, self._malformed
        with self._lock:
            doc = {"DocumentIncarnation": self.incarnation, "Events": [dict(e) for e in self.events]}
        return 200, {"Content-Type": "application/json"}, json.dumps(doc)

    def _admin(self, method: str, path: str, query) -> tuple[int, dict, str]:
        verb = path[len(ADMIN_PREFIX) :]
        if method == "GET" and verb == "state":
            return 200, {"Content-Type": "application/json"}, json.dumps(self.state())
        if method != "POST":
            return 405, {}, ""
        if verb == "reclaim":
            try:
                notice = float(query.get("notice", ["120"])[0])
            except ValueError:
                return 400, {}, "notice must be a number of seconds"
            self.announce_reclaim(notice)
        elif verb == "rebalance":
            self.announce_rebalance()
        elif verb == "maintenance":
            self.announce_maintenance(query.get("value", ["TERMINATE_ON_HOST_MAINTENANCE"])[0])
        elif verb == "clear":
            self.clear()
        else:
            return 404, {}, ""
        return 200, {"Content-Type": "application/json"}, json.dumps(self.state())


def _etag(value: str) -> str:
    return hashlib.sha1(value.encode()).hexdigest()[:16]


class _Handler(BaseHTTPRequestHandler):
    owner: MetadataServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet: tests and the local stack read their own logs
        pass

    def _handle(self, method: str) -> None:
        parsed = urllib.parse.urlsplit(self.path)
        path, query = parsed.path, urllib.parse.parse_qs(parsed.query)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        server = self.owner
        if path.startswith(ADMIN_PREFIX):
            self._reply(*server._admin(method, path, query))
            return
        with server._lock:
            server.requests[f"{method} {path}"] += 1
            delay = server._delay_s
        if delay:
            time.sleep(delay)
        status = server._take_fault(path)
        if status is not None:
            self._reply(status, {}, "injected fault")
            return
        if server.provider == "aws":
            self._reply(*server._aws(method, path, self.headers, query))
        elif server.provider == "gcp":
            self._reply(*server._gcp(method, path, self.headers, query))
        else:
            self._reply(*server._azure(method, path, self.headers, query, body))

    def _reply(self, status: int, headers: dict, body: str) -> None:
        data = body.encode()
        try:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (its timeout); nothing to do

    def do_GET(self) -> None:
        self._handle("GET")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_POST(self) -> None:
        self._handle("POST")


def post_admin(url: str, verb: str, timeout: float = 5.0, **params) -> dict:
    """Ask a (standalone) metadata server to change what it announces: verb = reclaim | rebalance | clear."""
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    request = urllib.request.Request(f"{url.rstrip('/')}{ADMIN_PREFIX}{verb}{query}", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"{}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m elastic.local.metadata_server",
        description="A local cloud metadata server that can announce spot reclaims.",
    )
    parser.add_argument("--provider", choices=PROVIDERS, required=True)
    parser.add_argument("--port", type=int, default=0, help="0: any free port (see --port-file)")
    parser.add_argument("--port-file", type=Path, help="write the bound port here once listening")
    parser.add_argument("--vm-name", default="elastic-vm-0", help="Azure: this VM's name")
    args = parser.parse_args(argv)
    server = MetadataServer(args.provider, port=args.port, vm_name=args.vm_name)
    if args.port_file:
        tmp = args.port_file.with_suffix(args.port_file.suffix + ".tmp")
        tmp.write_text(str(server.port))
        os.replace(tmp, args.port_file)  # readers never see a partial file
    logs.configure()
    log.info(
        "metadata server (%s) on %s; admin: POST %s%sreclaim?notice=S",
        args.provider,
        server.url,
        server.url,
        ADMIN_PREFIX,
    )
    try:
        server._httpd.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
