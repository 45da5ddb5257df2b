"""Serve any search backend over Search-R1's `POST /retrieve` protocol.

One process holds the index (mmap'ed, shared page cache) and every rollout worker queries
it over HTTP/1.1 keep-alive connections, instead of each worker loading its own copy. The
stdlib threading server is enough: BM25 scoring is numpy work that releases the GIL for
most of its time, and the protocol is a single JSON request/response.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from agent_gym import untrusted
from agent_gym.search.passages import SearchBackend, SearchError

log = logging.getLogger(__name__)

MAX_BODY = 8 << 20


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes; with Nagle on, the body waits for the client's
    # delayed ACK (~40 ms per request on keep-alive connections).
    disable_nagle_algorithm = True
    server: _Server

    def do_GET(self) -> None:
        if self.path.rstrip("/") in ("", "/health"):
            self._reply(HTTPStatus.OK, {"status": "ok", "backend": self.server.backend.name})
        else:
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint: GET {self.path}"})

    def do_POST(self) -> None:
        if self.path.rstrip("/") != "/retrieve":
            self._drain()
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint: POST {self.path}"})
            return
        try:
            queries, topk, scores = self._read_request()
        except ValueError as exc:
            self._reply(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
            return
        try:
            hits = self.server.backend.search(queries, topk)
        except SearchError as exc:
            self._reply(HTTPStatus.BAD_GATEWAY, {"error": str(exc)})
            return
        except Exception as exc:  # a bug in a backend must not kill the serving thread silently
            log.exception("search backend failed")
            self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(exc).__name__}"})
            return
        result = [
            [p.to_wire() if scores else p.to_wire()["document"] for p in passages]
            for passages in hits
        ]
        self._reply(HTTPStatus.OK, {"result": result})

    def _read_request(self) -> tuple[list[str], int, bool]:
        """Parse and validate the body; ValueError carries the message sent back to the client."""
        try:
            body = untrusted.loads(self.rfile.read(self._content_length()) or b"null")
        except untrusted.UntrustedJSONError as exc:
            raise ValueError(f"request body is not JSON this server reads: it {exc}") from None
        if not isinstance(body, dict):
            raise ValueError('expected a JSON object {"queries": [...], "topk": k}')
        queries, topk = body.get("queries"), body.get("topk")
        if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
            raise ValueError('"queries" must be a list of strings')
        if len(queries) > self.server.max_batch:
            raise ValueError(f"at most {self.server.max_batch} queries per request")
        if topk is None:
            topk = self.server.default_topk
        if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= 1000:
            raise ValueError('"topk" must be an integer between 1 and 1000')
        return queries, topk, bool(body.get("return_scores", True))

    def _content_length(self) -> int:
        try:
            length = int(self.headers.get("content-length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY:
            self.close_connection = True
            raise ValueError(f"need a content-length between 0 and {MAX_BODY} bytes")
        return length

    def _drain(self) -> None:
        with contextlib.suppress(ValueError):
            self.rfile.read(self._content_length())

    def _reply(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        try:
            data = json.dumps(payload, ensure_ascii=False).encode()
        except UnicodeEncodeError:  # a lone surrogate (live backends' JSON can carry one)
            data = json.dumps(payload).encode()  # travels intact as a "\\udxxx" escape
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s - %s", self.address_string(), format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    backend: SearchBackend
    default_topk: int
    max_batch: int

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that timed out and hung up is routine under load, not a traceback."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            log.debug("client %s disconnected", client_address)
        else:
            log.exception("error while serving %s", client_address)


class RetrievalServer:
    """A running server; `port=0` picks a free port (see `.url`). Use as a context manager
    or call `close()`; `serve_forever()` blocks (the CLI), `start()` serves from a thread."""

    def __init__(
        self,
        backend: SearchBackend,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        default_topk: int = 3,
        max_batch: int = 1024,
    ) -> None:
        self._httpd = _Server((host, port), _Handler)
        self._httpd.backend = backend
        self._httpd.default_topk = default_topk
        self._httpd.max_batch = max_batch
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> RetrievalServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def close(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
        self._httpd.server_close()

    def __enter__(self) -> RetrievalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
