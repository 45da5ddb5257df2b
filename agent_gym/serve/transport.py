"""The WebSocket transport ``serve`` runs: uvicorn's ``websockets`` protocol, which served
45% more steps/s than its newer ``websockets-sansio`` one in ``benchmarks/bench_serve.py``,
with its handshake mended.

That protocol hands the app the request's header values encoded as ISO-8859-1, as
websockets documents for 17.0 and later; but websockets' legacy server, which it runs on,
still reads a header's bytes as ASCII with surrogate escapes. A handshake with any byte
over 0x7F in a header (a note in UTF-8, a token with an accent) then failed encoding them:
an HTTP 500 and two tracebacks in the log, for a request that is merely unusual. Here each
value is given back its bytes first, so the app sees the handshake as HTTP routes see any
request (h11 keeps such bytes), and answers it as it answers every other: a wrong token is
refused, a note is ignored.
"""

from __future__ import annotations

import warnings

# Importing the protocol warns that uvicorn and websockets deprecate it: why it is still the
# one run is said above, and is not news for whoever runs the server.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*(websockets.legacy|`websockets` impl).*")
    from uvicorn.protocols.websockets.websockets_impl import WebSocketProtocol
    from websockets.datastructures import Headers
    from websockets.legacy.server import HTTPResponse


class ServeWebSocketProtocol(WebSocketProtocol):
    """uvicorn's ``websockets`` protocol whose handshake keeps header bytes as they came."""

    async def process_request(self, path: str, request_headers: Headers) -> HTTPResponse | None:
        return await super().process_request(path, Headers(
            (name, as_latin1(value)) for name, value in request_headers.raw_items()))


def as_latin1(value: str) -> str:
    """A header value as its bytes read as ISO-8859-1, whether websockets read them so or as
    ASCII with surrogate escapes (a value holding surrogates was read the second way)."""
    try:
        value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("ascii", errors="surrogateescape").decode("latin-1")
    return value
