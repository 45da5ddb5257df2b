"""Loopback test doubles for the search tests: a fault-injecting proxy in front of the real
retrieval server, and a fake MediaWiki API (the real one is not reachable from CI)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx


def refused_url() -> str:
    """A loopback URL nothing listens on (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class _Quiet(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in {"content-type": "application/json", **(headers or {})}.items():
            self.send_header(key, value)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """Clients that time out hang up on purpose in these tests."""


class _Stub:
    """A threaded loopback server; subclasses set `handler`."""

    handler: type[BaseHTTPRequestHandler]

    def __init__(self) -> None:
        self.faults: deque[str] = deque()
        self.requests: list[float] = []
        self.fallback = "ok"
        self._httpd = _QuietServer(("127.0.0.1", 0), self.handler)
        self._httpd.daemon_threads = True
        self._httpd.stub = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def next_fault(self) -> str:
        self.requests.append(time.monotonic())
        return self.faults.popleft() if self.faults else self.fallback

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


class _ProxyHandler(_Quiet):
    def do_POST(self) -> None:
        stub: FaultProxy = self.server.stub  # type: ignore[attr-defined]
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        fault = stub.next_fault()
        if fault == "slow":
            time.sleep(stub.slow_seconds)
        if fault == "429":
            self.send(429, b'{"error": "slow down"}', {"retry-after": "0"})
        elif fault == "500":
            self.send(500, b'{"error": "boom"}')
        elif fault == "503":
            self.send(503, b'{"error": "unavailable"}')
        elif fault == "malformed":
            self.send(200, b'{"result": [[{"document": ')
        elif fault == "wrong-shape":
            self.send(200, b'{"result": []}')
        else:
            reply = httpx.post(f"{stub.upstream}{self.path}", content=body,
                               headers={"content-type": "application/json"})
            self.send(reply.status_code, reply.content)


class FaultProxy(_Stub):
    """Forwards to `upstream` unless the next queued fault says otherwise: "slow" (sleep,
    then forward), "429", "500", "503", "malformed" (truncated JSON), "wrong-shape"."""

    handler = _ProxyHandler

    def __init__(self, upstream: str, slow_seconds: float = 1.0) -> None:
        self.upstream = upstream
        self.slow_seconds = slow_seconds
        super().__init__()


class _WikiHandler(_Quiet):
    def do_GET(self) -> None:
        stub: FakeMediaWiki = self.server.stub  # type: ignore[attr-defined]
        params = {k: v[0] for k, v in parse_qs(urlsplit(self.path).query).items()}
        stub.params.append(params)
        stub.agents.append(self.headers.get("user-agent", ""))
        fault = stub.next_fault()
        if fault == "429":
            self.send(429, b"Too many requests", {"retry-after": "0"})
        elif fault == "503":
            self.send(503, b"down")
        elif fault == "maxlag":
            error = {"error": {"code": "maxlag", "info": "Waiting for a database server"}}
            self.send(200, json.dumps(error).encode(), {"retry-after": "0"})
        elif fault == "malformed":
            self.send(200, b"<html>not json</html>")
        else:
            self.send(200, json.dumps(stub.answer(params)).encode())


class FakeMediaWiki(_Stub):
    """Answers `action=query&generator=search&prop=extracts` like MediaWiki's formatversion=2,
    searching a few fixed pages by word overlap; unordered pages carry an `index` rank."""

    handler = _WikiHandler
    pages = (
        (101, "Orvane", "The Orvane is a river that flows into the Grey Sea."),
        (102, "Zennhaven", "Zennhaven is a town on the Orvane, known for glassmaking."),
        (103, "Glassmaking", "Glassmaking is the craft of shaping molten glass."),
    )

    def __init__(self) -> None:
        self.params: list[dict[str, str]] = []
        self.agents: list[str] = []
        super().__init__()

    def answer(self, params: dict[str, str]) -> dict[str, Any]:
        words = set(params.get("gsrsearch", "").lower().split())
        scored = [(len(words & set(text.lower().replace(".", "").replace(",", "").split())),
                   pid, title, text) for pid, title, text in self.pages]
        ranked = sorted((s for s in scored if s[0] > 0), key=lambda s: -s[0])
        ranked = ranked[: int(params.get("gsrlimit", "10"))]
        if not ranked:
            return {"batchcomplete": True}
        pages = [{"pageid": pid, "ns": 0, "title": title, "index": rank + 1, "extract": text}
                 for rank, (_, pid, title, text) in enumerate(ranked)]
        return {"batchcomplete": True, "query": {"pages": list(reversed(pages))}}


# Raw replies of `ScriptedServer`: (status, extra headers, body).
BAD_REPLIES: dict[str, tuple[int, dict[str, str], bytes]] = {
    "retry-after-nan": (429, {"retry-after": "nan"}, b'{"error": "slow down"}'),
    "bad-gzip": (200, {"content-encoding": "gzip"}, b"\x1f\x8b\x08\x00 not a gzip stream"),
    "deep-json": (200, {}, b"[" * 100_000 + b"]" * 100_000),
    "wiki-query-list": (200, {}, b'{"batchcomplete": true, "query": [{"pages": []}]}'),
    "wiki-pages-text": (200, {}, b'{"query": {"pages": "none"}}'),
    "wiki-title-number": (200, {}, b'{"query": {"pages": [{"pageid": 1, "title": 7}]}}'),
}
# What "drip" finally sends, a byte at a time: a valid empty answer for either protocol.
DRIPPED = b" " * 100 + b'{"result": [[]]}'


class _ScriptedHandler(_Quiet):
    def do_GET(self) -> None:
        stub: ScriptedServer = self.server.stub  # type: ignore[attr-defined]
        self.rfile.read(int(self.headers.get("content-length") or 0))
        fault = stub.next_fault()
        if fault != "drip":
            status, headers, body = BAD_REPLIES[fault]
            self.send(status, body, headers)
            return
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(DRIPPED)))
        self.end_headers()
        for byte in DRIPPED:  # ~6 s in all, each byte well inside any read timeout
            if stub.stopped.wait(stub.drip_interval):
                return
            self.wfile.write(bytes([byte]))
            self.wfile.flush()

    do_POST = do_GET


class ScriptedServer(_Stub):
    """Answers every GET and POST with the next queued fault (else `fallback`): one of
    `BAD_REPLIES`, or "drip": headers at once, then the body one byte per `drip_interval`."""

    handler = _ScriptedHandler

    def __init__(self, drip_interval: float = 0.05) -> None:
        self.drip_interval = drip_interval
        self.stopped = threading.Event()
        super().__init__()

    def close(self) -> None:
        self.stopped.set()
        super().close()
