"""A small OpenAI-compatible chat server on loopback, for tests and benchmarks.

It is a test double of a remote model server (vLLM, OpenAI, llama.cpp), with knobs for
latency and failures: the eval client's retries, error handling and concurrency are
exercised against real HTTP on a real socket.

``llama_cpp=True`` mimics llama-cpp-python's server (0.3.36, SmolLM2, measured) started with
``--chat_format chatml-function-calling``, the format in which it calls tools: ``tools`` are
ignored unless ``tool_choice`` is sent (replies then carry no ``tool_calls``), ``role:
"tool"`` content never reaches the model (that template has no tool role; ``seen`` records
the chat as the model saw it), and a message with ``"content": null`` is answered with
HTTP 500 (``null_style`` picks whose wording). With the GGUF's own template, its default,
the real server ignores tools whatever is sent and keeps tool content. ``context_limit`` rejects a prompt longer than that many tokens (counted
as characters / 4) with HTTP 400 and the message of ``context_style``'s server.
A request with ``"stream": true`` is answered as OpenAI streams: server-sent events, one
chunk with the whole message, one with the finish reason, one with the usage, then
``[DONE]`` (verifiers' harnesses only stream).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# What each server answers a prompt that does not fit (status, body), as they word it.
CONTEXT_ERRORS: dict[str, tuple[int, dict[str, Any]]] = {
    "llama.cpp": (400, {"error": {
        "code": 400, "type": "exceed_context_size_error",
        "message": "the request exceeds the available context size, try increasing it"}}),
    "llama-cpp-python": (400, {"error": {
        "message": "Requested tokens (5012) exceed context window of 4096",
        "type": "internal_server_error"}}),
    "vllm": (400, {"object": "error", "type": "BadRequestError", "code": 400, "message":
                   "This model's maximum context length is 4096 tokens. However, you "
                   "requested 5012 tokens (4756 in the messages, 256 in the completion)."}),
    "openai": (400, {"error": {
        "message": "This model's maximum context length is 8192 tokens. However, your "
        "messages resulted in 9000 tokens.", "type": "invalid_request_error",
        "param": "messages", "code": "context_length_exceeded"}}),
}
# What each server answers (HTTP 500) a message whose content is null. llama.cpp's applies
# its chat template with nlohmann::json, which throws. llama-cpp-python's (0.3.36, measured
# with SmolLM2) rejects an assistant message with null content in its request schema, and
# with the GGUF's own template passes on the TypeError Jinja raises for a null user message.
NULL_CONTENT_ERRORS: dict[str, dict[str, Any]] = {
    "llama.cpp": {"error": {
        "code": 500, "type": "server_error",
        "message": "[json.exception.type_error.302] type must be string, but is null"}},
    "llama-cpp-python": {"error": {
        "message": 'can only concatenate str (not "NoneType") to str',
        "type": "internal_server_error", "param": None, "code": None}},
    "llama-cpp-python-schema": {"error": {
        "message": "7 validation errors:\n  {'type': 'string_type', 'loc': ('body', "
        "'messages', 1, 'ChatCompletionRequestAssistantMessage', 'content'), 'msg': "
        "'Input should be a valid string', 'input': None}\n",
        "type": "internal_server_error", "param": None, "code": None}},
}


def prompt_tokens(body: dict[str, Any]) -> int:
    """The double's token count of a request: characters of its messages and tools / 4."""
    text = "".join(str(m.get("content") or "") for m in body.get("messages", []))
    return (len(text) + len(json.dumps(body.get("tools") or []))) // 4


@dataclass
class Behaviour:
    reply: Callable[[dict[str, Any]], dict[str, Any]] = lambda body: {
        "content": "I think the answer is \\boxed{42}."
    }
    delay: float = 0.0
    # Status codes to answer with, one per request, before behaving normally.
    failures: list[int] = field(default_factory=list)
    failure_body: str = '{"error": "injected"}'
    malformed: int = 0  # answer this many requests with broken JSON
    requests: list[dict[str, Any]] = field(default_factory=list)
    llama_cpp: bool = False
    context_limit: int | None = None
    context_style: str = "llama.cpp"
    null_style: str = "llama-cpp-python"  # whose answer to null content (NULL_CONTENT_ERRORS)
    finish_reason: str | None = None  # e.g. "length": every reply was cut by max_tokens
    # The chats the model saw (what a llama_cpp server kept of each request).
    seen: list[list[dict[str, Any]]] = field(default_factory=list)


def _as_seen(body: dict[str, Any], llama_cpp: bool) -> dict[str, Any]:
    if not llama_cpp:
        return body
    seen = dict(body)
    seen["messages"] = [
        {**m, "content": ""} if m.get("role") == "tool" else m for m in body["messages"]
    ]
    if "tool_choice" not in body:
        seen.pop("tools", None)
    return seen


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # The default backlog of 5 reset connections of bursts of concurrent clients.
    request_queue_size = 256

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that timed out and left is what some tests do: no traceback for it."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


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
                    return self._send(failure, behaviour.failure_body.encode())
                if malformed:
                    return self._send(200, b'{"choices": [')
                if behaviour.llama_cpp and any(
                    m.get("content") is None for m in body.get("messages", [])
                ):
                    error = NULL_CONTENT_ERRORS[behaviour.null_style]
                    return self._send(500, json.dumps(error).encode())
                tokens = prompt_tokens(body)
                if behaviour.context_limit is not None and tokens > behaviour.context_limit:
                    status, error = CONTEXT_ERRORS[behaviour.context_style]
                    return self._send(status, json.dumps(error).encode())
                seen = _as_seen(body, behaviour.llama_cpp)
                with server._lock:
                    behaviour.seen.append(seen["messages"])
                message = {"role": "assistant", **behaviour.reply(seen)}
                if "tools" not in seen:  # a model that was shown no tools calls none
                    message.pop("tool_calls", None)
                finish = behaviour.finish_reason or (
                    "tool_calls" if message.get("tool_calls") else "stop")
                usage = {"prompt_tokens": tokens, "completion_tokens": 7}
                if body.get("stream"):
                    return self._stream(body, message, finish, usage)
                payload = {
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                    "usage": usage,
                }
                self._send(200, json.dumps(payload).encode())

            def _stream(self, body: dict[str, Any], message: dict[str, Any], finish: str,
                        usage: dict[str, int]) -> None:
                delta = {**message, "tool_calls": [
                    {"index": i, **call} for i, call in enumerate(message["tool_calls"])
                ]} if message.get("tool_calls") else message
                chunks = [{"choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
                          {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
                          {"choices": [], "usage": {
                              **usage, "total_tokens": sum(usage.values())}}]
                head = {"id": "chatcmpl-double", "object": "chat.completion.chunk",
                        "created": 0, "model": body.get("model", "")}
                events = "".join(f"data: {json.dumps({**head, **chunk})}\n\n" for chunk in chunks)
                data = (events + "data: [DONE]\n\n").encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _send(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> ChatServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
