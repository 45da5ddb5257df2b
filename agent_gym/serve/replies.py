"""Reading a request and writing a reply, the same for every route of ``agent-gym serve``.

A body or frame is untrusted and may be large: it is read within the server's size limit
and parsed as untrusted JSON (``agent_gym.untrusted``), off the event loop when large. A
refusal is a ``ProtocolError``, told to an HTTP client in OpenEnv's ``{"detail": ...}``
and to a WebSocket client in an error frame.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from agent_gym import untrusted
from agent_gym.serve.sessions import SessionPool
from agent_gym.serve.wire import INVALID_JSON, REQUEST_TOO_LARGE, ProtocolError, dumps

# Bodies and frames up to this size are parsed on the event loop (well under a millisecond);
# larger ones in a worker thread: checking a 4 MiB one takes about 60 ms.
INLINE_PARSE_BYTES = 64 << 10


class JSONText(Response):
    """A JSON response written by ``dumps`` (Starlette's own rejects numpy values)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


def error_reply(error: ProtocolError, headers: Mapping[str, str] | None = None) -> JSONText:
    """An HTTP refusal as OpenEnv's clients read it: ``{"detail": {"message", "code"}}``."""
    return JSONText({"detail": error.payload()}, status_code=error.status, headers=headers)


def error_frame(error: ProtocolError) -> str:
    """A refusal on a WebSocket (``/ws``, or a token refused at the edge), where OpenEnv's
    clients read it: an error frame."""
    return dumps({"type": "error", "data": error.payload()})


async def parsed(pool: SessionPool, text: str | bytes) -> Any:
    """``parse(text)``, in a worker thread when ``text`` is large: on the event loop it
    would hold up every other client's replies."""
    if len(text) <= INLINE_PARSE_BYTES:
        return parse(text)
    return await pool.run(parse, text)


def parse(text: str | bytes) -> Any:
    """A request body or frame as JSON, refused (INVALID_JSON) when it is not JSON, is not
    UTF-8, is nested too deep for any request of this protocol, or holds NaN/Infinity."""
    try:
        return untrusted.loads(text)
    except untrusted.UntrustedJSONError as exc:
        raise ProtocolError(INVALID_JSON, f"Invalid JSON: the request {exc}") from exc


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused past ``limit`` bytes without reading the rest."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ProtocolError(REQUEST_TOO_LARGE, f"the request body is {declared} bytes; the "
                            f"server's limit is {limit}", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ProtocolError(REQUEST_TOO_LARGE, f"the request body exceeds the server's "
                                f"limit of {limit} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)
