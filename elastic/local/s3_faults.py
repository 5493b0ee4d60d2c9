"""A fault-injecting S3 proxy: it forwards every request to the real endpoint, streaming both bodies, and breaks
the ones its plan (elastic.local.fault_plan) picks: a 500 InternalError or a 503 SlowDown with S3's XML error
body, a connection reset in the middle of a body, or added latency. Each injected fault is logged.

`elastic local up --s3-faults` puts one in front of the stack's S3 endpoint (the stack's AWS_ENDPOINT_URL then
names the proxy); tests and the soak start one in-process with `running_proxy`. It is steered at runtime over
HTTP on its own port, under `/_elastic/faults` (no S3 bucket name can start with `_`), through `FaultControl`:

    GET    /_elastic/faults           requests seen, faults injected by kind, open windows
    PUT    /_elastic/faults/rates     {"slow_down": 0.1, "reset": 0.05, "match": {"methods": ["PUT"]}}
    POST   /_elastic/faults/windows   {"kind": "503", "seconds": 5, "match": {"path_contains": "/step-"}}
    DELETE /_elastic/faults/windows   close every window

Run as a daemon: python -m elastic.local.s3_faults --upstream http://127.0.0.1:PORT --port P --seed S
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import struct
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from xml.sax.saxutils import escape

import aiohttp
from aiohttp import web

from elastic import logs
from elastic.local.fault_plan import ERROR_500, RESET, SLOW_DOWN, Decision, FaultPlan, Rates, Window

log = logging.getLogger(__name__)

ADMIN_PREFIX = "/_elastic/faults"
CHUNK_BYTES = 256 * 1024
# Not forwarded: they describe one hop's connection, not the request (RFC 9110 7.6.1). Expect is answered by
# this server already; Content-Length travels with the body.
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "expect",
}
_ERRORS = {
    ERROR_500: (500, "InternalError", "We encountered an internal error. Please try again."),
    SLOW_DOWN: (503, "SlowDown", "Please reduce your request rate."),
}


def s3_error_body(code: str, message: str, resource: str) -> bytes:
    """An S3 error document, as botocore parses it (Code, Message, Resource, RequestId)."""
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{escape(message)}</Message>"
        f"<Resource>{escape(resource)}</Resource><RequestId>{uuid.uuid4().hex[:16].upper()}</RequestId></Error>"
    ).encode()


class FaultProxy:
    """The aiohttp application: admin routes under ADMIN_PREFIX, everything else proxied through the plan."""

    def __init__(self, upstream: str, plan: FaultPlan):
        self.upstream = upstream.rstrip("/")
        self.plan = plan
        self._client: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=0)
        app.router.add_get(ADMIN_PREFIX, self._stats)
        app.router.add_put(f"{ADMIN_PREFIX}/rates", self._set_rates)
        app.router.add_post(f"{ADMIN_PREFIX}/windows", self._open_window)
        app.router.add_delete(f"{ADMIN_PREFIX}/windows", self._close_windows)
        app.router.add_route("*", "/{tail:.*}", self._proxy)
        app.on_startup.append(self._start_client)
        app.on_cleanup.append(self._stop_client)
        return app

    async def _start_client(self, _app: web.Application) -> None:
        # auto_decompress off: bodies pass through byte for byte, with the Content-Length the client expects.
        self._client = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None))

    async def _stop_client(self, _app: web.Application) -> None:
        if self._client is not None:
            await self._client.close()

    # -- admin
    async def _stats(self, _request: web.Request) -> web.Response:
        return web.json_response(self.plan.snapshot())

    async def _set_rates(self, request: web.Request) -> web.Response:
        try:
            self.plan.rates = Rates.from_json(await request.json())
        except (ValueError, TypeError, AttributeError) as err:  # not JSON, or not an object
            return web.json_response({"error": str(err)}, status=400)
        log.info("fault rates now %s", self.plan.rates)
        return web.json_response(self.plan.snapshot())

    async def _open_window(self, request: web.Request) -> web.Response:
        try:
            window = self.plan.open_window(Window.from_json(await request.json()))
        except (ValueError, TypeError, AttributeError) as err:  # not JSON, or not an object
            return web.json_response({"error": str(err)}, status=400)
        log.warning("fault window opened: %s fail with %s", _describe(window), window.kind)
        return web.json_response(self.plan.snapshot())

    async def _close_windows(self, _request: web.Request) -> web.Response:
        closed = self.plan.close_windows()
        log.warning("fault windows closed (%d)", closed)
        return web.json_response(self.plan.snapshot())

    # -- the proxy
    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        decision = self.plan.decide(request.method, request.path)
        if decision.kind is not None:
            log.warning(
                "fault %d: %s on %s %s (request %d, %s)",
                sum(self.plan.injected.values()),
                decision.kind,
                request.method,
                request.path,
                decision.number,
                decision.source,
            )
        if decision.delay:
            await asyncio.sleep(decision.delay)
        if decision.kind in _ERRORS:
            await _drain(request)
            status, code, message = _ERRORS[decision.kind]
            body = b"" if request.method == "HEAD" else s3_error_body(code, message, request.path)
            return web.Response(status=status, body=body, content_type="application/xml")
        has_body = (request.content_length or 0) > 0 or request.headers.get("Transfer-Encoding") == "chunked"
        if decision.kind == RESET and has_body:
            # Mid-request: half the body arrives, then the connection goes. Nothing reaches the store.
            await request.content.read(max(1, (request.content_length or 2) // 2))
            _reset(request)
            return web.Response(status=500)  # never sent: the connection is gone
        return await self._forward(request, decision)

    async def _forward(self, request: web.Request, decision: Decision) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        data = request.content if request.body_exists else None
        async with self._client.request(
            request.method,
            self.upstream + request.path_qs,
            headers=headers,
            data=data,
            allow_redirects=False,
            skip_auto_headers=("Content-Type", "User-Agent", "Accept", "Accept-Encoding"),
        ) as upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                    response.headers.add(key, value)
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            await response.prepare(request)
            if decision.kind == RESET:
                # Mid-response: the headers promise the whole body, half of it comes, then the connection goes.
                half = (upstream.content_length or 0) // 2
                if half:
                    await response.write(await upstream.content.read(half))
                _reset(request)
                return response
            async for chunk in upstream.content.iter_chunked(CHUNK_BYTES):
                await response.write(chunk)
            await response.write_eof()
            return response


async def _drain(request: web.Request) -> None:
    """Read and drop a request's body, so the client is not cut off while it is still sending."""
    while await request.content.read(CHUNK_BYTES):
        pass


def _reset(request: web.Request) -> None:
    """Close the connection with a TCP reset (SO_LINGER 0), as a failing load balancer or server does."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _describe(window: Window) -> str:
    """E.g. "PUT requests with /step- in the path, for 5 s"."""
    what = f"{'/'.join(window.match.methods) or 'all'} requests"
    if window.match.path_contains:
        what += f" with {window.match.path_contains} in the path"
    if window.seconds is not None:
        what += f", for {window.seconds:g} s"
    if window.requests is not None:
        what += f", for {window.requests} failed requests"
    return what


class FaultControl:
    """Steers a running proxy over its admin routes (the proxy's base URL, e.g. http://127.0.0.1:PORT)."""

    def __init__(self, url: str, timeout: float = 10.0):
        self.url = url.rstrip("/") + ADMIN_PREFIX
        self.timeout = timeout

    def stats(self) -> dict:
        return self._call("GET", "")

    def set_rates(self, **rates) -> dict:
        """E.g. set_rates(slow_down=0.1, reset=0.05, match={"methods": ["PUT"]}); no arguments: no faults."""
        return self._call("PUT", "/rates", rates)

    def open_window(self, kind: str = SLOW_DOWN, **window) -> dict:
        """E.g. open_window("503", seconds=5, match={"path_contains": "/step-"}) or requests=3."""
        return self._call("POST", "/windows", {"kind": kind, **window})

    def close_windows(self) -> dict:
        return self._call("DELETE", "/windows")

    @contextmanager
    def window(self, kind: str = SLOW_DOWN, **window) -> Iterator[None]:
        """A window open for the duration of a block."""
        self.open_window(kind, **window)
        try:
            yield
        finally:
            self.close_windows()

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            return json.loads(response.read())


@contextmanager
def running_proxy(upstream: str, seed: int = 0, rates: Rates | None = None) -> Iterator[tuple[str, FaultControl]]:
    """A proxy on a free 127.0.0.1 port, on a thread of this process, for a block. Yields its URL and control."""
    plan = FaultPlan(seed=seed, rates=rates or Rates())
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(FaultProxy(upstream, plan).app(), access_log=None)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, name="elastic-s3-faults", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        yield url, FaultControl(url)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="the real S3 endpoint, e.g. http://127.0.0.1:9000")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logs.configure()
    proxy = FaultProxy(args.upstream, FaultPlan(seed=args.seed))
    log.info("S3 fault proxy on %s:%d -> %s (seed %d)", args.host, args.port, args.upstream, args.seed)
    web.run_app(proxy.app(), host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
