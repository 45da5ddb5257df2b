"""A small OpenAI-compatible chat server on loopback, for tests and benchmarks.

It is a test double of a remote model server (vLLM, OpenAI), with knobs for latency and
failures: the eval client's retries, error handling and concurrency are exercised against
real HTTP on a real socket.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Behaviour:
    reply: Callable[[dict[str, Any]], dict[str, Any]] = lambda body: {
        "content": "I think the answer is \\boxed{42}."
    }
    delay: float = 0.0
    # Status codes to answer with, one per request, before behaving normally.
    failures: list[int] = field(default_factory=list)
    malformed: int = 0  # answer this many requests with broken JSON
    requests: list[dict[str, Any]] = field(default_factory=list)


class ChatServer:
    def __init__(self, behaviour: Behaviour | None = None) -> None:
        self.behaviour = behaviour or Behaviour()
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            # Keep-alive, as model servers do; HTTP/1.0 made every request a new connection.
            protocol_version = "HTTP/1.1"
            # TCP_NODELAY, as uvicorn sets: with Nagle, the body written after the headers
            # waited for the client's delayed ACK, 40 ms on every reply.
            disable_nagle_algorithm = True

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                behaviour = server.behaviour
                with server._lock:
                    behaviour.requests.append(body)
                    failure = behaviour.failures.pop(0) if behaviour.failures else None
                    malformed = behaviour.malformed > 0
                    behaviour.malformed -= malformed
                time.sleep(behaviour.delay)
                if self.path != "/v1/chat/completions":
                    return self._send(404, b'{"error": "not found"}')
                if failure is not None:
                    return self._send(failure, b'{"error": "injected"}')
                if malformed:
                    return self._send(200, b'{"choices": [')
                message = {"role": "assistant", **behaviour.reply(body)}
                payload = {
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 11, "completion_tokens": 7},
                }
                self._send(200, json.dumps(payload).encode())

            def _send(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            # The default backlog of 5 reset connections of bursts of concurrent clients.
            request_queue_size = 256

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> ChatServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

