"""Who may use a server: the bearer token every route but ``/health`` asks for, and the
critic token a ``privileged`` request carries (see ``agent_gym.serve.app``).
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Mapping
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from agent_gym.serve.replies import error_frame, error_reply
from agent_gym.serve.sessions import ServerConfig
from agent_gym.serve.wire import UNAUTHORIZED, ProtocolError

OPEN_PATHS = frozenset({"/health"})  # for load balancers and orchestrators' probes


class RequireToken:
    """ASGI middleware: every request but ``OPEN_PATHS`` carries the token in its
    ``Authorization`` header (``authorized``), or is refused before any route sees it.

    At the app's edge rather than in each route, so nothing is left open by being added
    later or by coming from FastAPI itself (the docs and the OpenAPI schema). The header is
    compared as bytes: a client's non-ASCII token is a wrong token, not an error."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS or \
                self.authorized(scope["headers"]):
            await self.app(scope, receive, send)
            return
        refusal = ProtocolError(UNAUTHORIZED, "missing or wrong bearer token", status=401)
        if scope["type"] == "http":
            reply = error_reply(refusal, headers={"www-authenticate": "Bearer"})
            await reply(scope, receive, send)
            return
        # A WebSocket client is told why as OpenEnv's clients read it: an error frame.
        if (await receive())["type"] == "websocket.connect":
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.send", "text": error_frame(refusal)})
            await send({"type": "websocket.close", "code": 1008})

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """``Bearer <token>``, or HTTP Basic with the token as its password (any user
        name): what ``requests`` sends from a netrc file by itself, which is how a client
        that sets no header, ``openenv validate --url``, reaches a server with a token."""
        value = next((value for name, value in headers if name == b"authorization"), b"")
        scheme, _, given = value.partition(b" ")
        scheme, given = scheme.lower(), given.strip()
        if scheme == b"basic":
            try:
                given = base64.b64decode(given, validate=True).partition(b":")[2]
            except binascii.Error:
                return False
        elif scheme != b"bearer":
            return False
        return hmac.compare_digest(given, self.token)


def check_critic(config: ServerConfig, data: Any) -> None:
    """Refuse a ``privileged`` request unless its ``critic_token`` is the server's.

    The token travels in the request rather than in a header so that any client of the
    protocol can send it, OpenEnv's included, whose WebSocket has no headers to set."""
    if config.critic_token is None:
        raise ProtocolError(UNAUTHORIZED, "this server gives privileged info to no one: start "
                            "it with --critic-token-env VAR to serve critics", status=403)
    given = data.get("critic_token") if isinstance(data, Mapping) else None
    if not isinstance(given, str) or not hmac.compare_digest(
            given.encode("utf-8", errors="surrogatepass"), config.critic_token.encode("utf-8")):
        raise ProtocolError(UNAUTHORIZED, "a privileged request needs the server's critic "
                            "token in 'critic_token' (missing or wrong)", status=403)
