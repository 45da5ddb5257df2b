"""``agent-gym serve``: any agent_gym env behind OpenEnv's wire protocol, with restore.

Most RL frameworks that reach environments over the network (TRL, SkyRL, ART, verifiers,
NeMo-Gym) speak OpenEnv's protocol, so one server makes every agent_gym env usable from all
of them. The wire format follows OpenEnv's ``openenv`` package (``openenv.core.env_server``):

* WebSocket ``/ws``: one session (one env) per connection. Client frames are
  ``{"type": "reset"|"step"|"state"|"close", "data": {...}}``; replies are
  ``{"type": "observation", "data": {"observation": {...}, "reward", "done"}}``,
  ``{"type": "state", "data": {...}}`` or ``{"type": "error", "data": {"message", "code"}}``
  with OpenEnv's error codes. A bad frame gets an error frame and the session goes on.
* HTTP ``POST /reset``, ``POST /step``, ``GET /state``, ``GET /schema``, ``GET /metadata``,
  ``GET /health``, and OpenEnv's task API (``GET /list_environments``, ``/{env}/splits``,
  ``POST /{env}/tasks``, ``/num_tasks``, ``/task``, ``/task_range``: ``agent_gym.serve.tasks``).
  OpenEnv's own HTTP reset and step build a throwaway env per request, which cannot hold a
  multi-turn episode; here ``/reset`` opens a session whose id comes back as
  ``observation.session_id`` and is passed to ``/step`` and ``/state`` (an extra request
  field, which OpenEnv's request models allow), and ``POST /close`` ends it.
* MCP (``agent_gym.serve.mcp``): JSON-RPC on ``POST /mcp``, the ``/mcp`` WebSocket and the
  ``mcp`` frame of ``/ws``; ``/ws?session_id=`` attaches to a session opened over HTTP.

Extensions inside the spec: ``reset`` data may carry ``state`` (an ``EnvState`` as saved by
``save_state``) to restore mid-episode, or ``task_id`` / ``index`` (with ``split``) to pick
a task; the
``state`` reply carries the session's current ``EnvState`` as ``env_state``.

Privileged info (reference answers, oracle actions, walkthroughs, gold passages) is never
in an observation: clients such as verifiers' OpenEnv env show the model the whole of it.
A critic or oracle asks for the current episode's with the critic token the server was
started with (``--critic-token-env``): a ``{"type": "privileged", "data": {"critic_token":
...}}`` frame on the session's WebSocket, or ``POST /privileged`` with ``session_id`` and
``critic_token``. Without a critic token the server gives it to no one (both tokens are
checked in ``agent_gym.serve.auth``).

Trust: the server builds every env from its own ``env_id`` and ``--env-arg`` settings. A
client's state is only a list of actions to replay: one saved from an env with other
settings (sandbox isolation, limits, paths, backends) is refused, never used to build one.
With a token (``--token-env``) every route but ``/health`` needs it, the API's own docs
(``/docs``, ``/redoc``, ``/openapi.json``) included; without one the server listens on
loopback only, unless told explicitly that anyone who reaches it may use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import gymnasium

from agent_gym.extras import install_hint

try:
    from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
    from fastapi.responses import Response
except ImportError as err:  # the server's stack is an optional extra
    raise ImportError(f"agent-gym serve needs FastAPI: {install_hint('serve')}") from err

import agent_gym  # noqa: F401  (importing it registers the envs)
from agent_gym.serve import mcp
from agent_gym.serve.auth import RequireToken, check_critic
from agent_gym.serve.replies import JSONText, error_frame, error_reply, parsed, read_body
from agent_gym.serve.sessions import (
    ServerConfig,
    Session,
    SessionPool,
    prepare_process,
)
from agent_gym.serve.tasks import add_task_routes
from agent_gym.serve.wire import (
    ACTION_SCHEMA,
    EXECUTION_ERROR,
    OBSERVATION_SCHEMA,
    PRIVILEGED,
    REQUEST_TOO_LARGE,
    SESSION_ERROR,
    STATE_SCHEMA,
    UNKNOWN_TYPE,
    VALIDATION_ERROR,
    ProtocolError,
    dumps,
    server_version,
)

log = logging.getLogger(__name__)

# Env calls run in worker threads (``SessionPool``), and one computing in Python holds the
# GIL: each time the event loop wakes it waits for the GIL up to Python's switch interval,
# 5 ms by default, several times per reply (a /health took 17 ms instead of 2 while one
# client's step computed). A server process hands the GIL over ten times sooner.
GIL_SWITCH_INTERVAL_S = 0.0005


def env_description(env_id: str) -> str:
    """The first paragraph of the env class's docstring."""
    entry = gymnasium.spec(env_id).entry_point
    doc = ""
    if isinstance(entry, str):
        module, _, name = entry.partition(":")
        doc = getattr(__import__(module, fromlist=[name]), name).__doc__ or ""
    return doc.strip().split("\n\n")[0].replace("\n", " ") or env_id


# --------------------------------------------------------------------- the app
def create_app(config: ServerConfig) -> FastAPI:
    """The ASGI app: run it with uvicorn (``serve`` does)."""
    pool = SessionPool(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> Any:
        reaper = asyncio.create_task(pool.reap_forever())
        try:
            yield
        finally:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
            await pool.shutdown()

    app = FastAPI(title=f"agent-gym {config.env_id}", version=server_version(),
                  lifespan=lifespan)
    if config.token is not None:
        app.add_middleware(RequireToken, token=config.token)
    app.state.pool = pool
    add_http_routes(app, pool)
    add_mcp_route(app, pool)
    add_task_routes(app, pool)
    add_websocket_route(app, pool)
    return app


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (a name other than localhost
    may resolve to anything, so it is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ExposureError(ValueError):
    """Listening where others can reach the server, without a token and without being
    told that this is meant."""


# --------------------------------------------------------------------- HTTP
def add_http_routes(app: FastAPI, pool: SessionPool) -> None:
    """OpenEnv's HTTP routes: ``/reset``, ``/step``, ``/state``, ``/close`` (ours), and
    ``/health``, ``/metadata``, ``/schema``."""
    config = pool.config

    async def guarded(request: Request, handler: Callable[[Any], Awaitable[Any]]) -> JSONText:
        """Read the body within the size limit, map refusals to errors."""
        try:
            body = await read_body(request, config.max_request_bytes)
            payload = await parsed(pool, body) if body.strip() else {}
            return JSONText(await handler(payload))
        except ProtocolError as exc:
            return error_reply(exc)
        except Exception as exc:  # an env bug must not take the server down
            log.exception("request failed")
            return JSONText({"detail": {"message": f"{type(exc).__name__}: {exc}",
                                            "code": EXECUTION_ERROR}}, status_code=500)

    def body_object(payload: Any) -> Mapping[str, Any]:
        if not isinstance(payload, Mapping):
            raise ProtocolError(VALIDATION_ERROR, "the request body must be a JSON object")
        return payload

    @app.post("/reset", tags=["Environment Control"])
    async def http_reset(request: Request) -> JSONText:
        """Open a session and reset it; ``observation.session_id`` names it for /step."""

        async def handle(payload: Any) -> dict[str, Any]:
            data = dict(body_object(payload))
            session = await pool.open()
            try:
                result = await pool.reset(session, data)
            except BaseException:
                await pool.close(session)
                raise
            result["observation"]["session_id"] = session.session_id
            return result

        return await guarded(request, handle)

    @app.post("/step", tags=["Environment Control"])
    async def http_step(request: Request) -> JSONText:
        """``{"action": {"text": ...}, "session_id": ...}`` (``timeout_s`` and
        ``request_id`` are accepted, as OpenEnv's StepRequest allows)."""

        async def handle(payload: Any) -> dict[str, Any]:
            data = body_object(payload)
            session = pool.get(data.get("session_id"))
            result = await pool.step(session, data.get("action"))
            result["observation"]["session_id"] = session.session_id
            return result

        return await guarded(request, handle)

    @app.get("/state", tags=["State Management"])
    async def http_state(request: Request) -> JSONText:
        """``?session_id=...``: the session's episode id, step count and ``EnvState``."""

        async def handle(_: Any) -> dict[str, Any]:
            return await pool.state(pool.get(request.query_params.get("session_id")))

        return await guarded(request, handle)

    @app.post("/privileged", tags=["State Management"])
    async def http_privileged(request: Request) -> JSONText:
        """``{"session_id": ..., "critic_token": ...}``: the episode's privileged info, for
        a critic; never part of an observation."""

        async def handle(payload: Any) -> dict[str, Any]:
            data = body_object(payload)
            check_critic(config, data)
            return await pool.privileged(pool.get(data.get("session_id")))

        return await guarded(request, handle)

    @app.post("/close", tags=["Environment Control"])
    async def http_close(request: Request) -> JSONText:
        """End an HTTP session now instead of waiting for the idle reaper."""

        async def handle(payload: Any) -> dict[str, Any]:
            session = pool.get(body_object(payload).get("session_id"))
            await pool.close(session)
            return {"closed": session.session_id}

        return await guarded(request, handle)

    @app.get("/health", tags=["Health"])
    async def health() -> dict[str, str]:
        return {"status": "healthy"}

    @app.get("/metadata", tags=["Environment Info"])
    async def metadata() -> dict[str, Any]:
        return {
            "name": config.env_id,
            "description": env_description(config.env_id),
            "version": server_version(),
            "author": "agent-gym",
            "readme_content": None,
            "documentation_url": None,
        }

    @app.get("/schema", tags=["Schema"])
    async def schema() -> dict[str, Any]:
        return {"action": ACTION_SCHEMA, "observation": OBSERVATION_SCHEMA,
                "state": STATE_SCHEMA}


# --------------------------------------------------------------------- MCP
def add_mcp_route(app: FastAPI, pool: SessionPool) -> None:
    """MCP's JSON-RPC (``agent_gym.serve.mcp``) on ``POST /mcp``, where a call names its
    session, and on the ``/mcp`` WebSocket, one session per connection."""
    config = pool.config

    @app.post("/mcp", tags=["MCP"])
    async def mcp_http(request: Request) -> Response:
        """JSON-RPC 2.0: initialize, tools/list, tools/call, OpenEnv's session methods."""
        try:
            body = await read_body(request, config.max_request_bytes)
        except ProtocolError as exc:
            return error_reply(exc)
        reply = await mcp_answer(pool, body or b"{}", None)
        # A notification gets no response: MCP's HTTP transport acknowledges it with 202.
        return Response(status_code=202) if reply is None else JSONText(reply)

    @app.websocket("/mcp")
    async def mcp_websocket(websocket: WebSocket) -> None:
        def refusal(error: ProtocolError) -> str:
            return dumps(mcp.rpc_error(None, mcp.SERVER_ERROR, str(error),
                                       {"code": error.code, **error.extra}))

        async def answer(session: Session) -> None:
            await serve_rpc_frames(websocket, pool, session, config.max_request_bytes)

        await hold_session(websocket, pool, None, refusal, answer)


async def serve_rpc_frames(
    websocket: WebSocket, pool: SessionPool, session: Session, limit: int
) -> None:
    """Answer one ``/mcp`` connection's JSON-RPC frames until it goes away."""
    while True:
        raw = await receive_frame(websocket)
        if raw is None:
            return
        if oversized(raw, limit):
            reply = mcp.rpc_error(None, mcp.INVALID_REQUEST, f"the frame is larger than the "
                                  f"server's limit of {limit} bytes")
        else:
            reply = await mcp_answer(pool, raw, session)
        if reply is not None:
            await websocket.send_text(dumps(reply))


async def mcp_answer(pool: SessionPool, text: str | bytes, session: Session | None
                     ) -> dict[str, Any] | None:
    """The JSON-RPC response to a body or frame (None for a notification)."""
    try:
        request = await parsed(pool, text)
    except ProtocolError as exc:
        return mcp.rpc_error(None, mcp.PARSE_ERROR, f"Parse error: {exc}")
    return await mcp.rpc_reply(pool, request, session)


# --------------------------------------------------------------------- WebSocket
def add_websocket_route(app: FastAPI, pool: SessionPool) -> None:
    """``/ws``: one session per connection, answered frame by frame (``serve_frames``)."""
    config = pool.config

    @app.websocket("/ws")
    async def websocket_session(websocket: WebSocket) -> None:
        async def answer(session: Session) -> None:
            await serve_frames(websocket, pool, session, config.max_request_bytes)

        # ``?session_id=``: attach to a session opened over HTTP (OpenEnv's MCP client).
        await hold_session(websocket, pool, websocket.query_params.get("session_id"),
                           error_frame, answer)


async def hold_session(
    websocket: WebSocket, pool: SessionPool, session_id: str | None,
    refusal: Callable[[ProtocolError], str], answer: Callable[[Session], Awaitable[None]],
) -> None:
    """A WebSocket's life with its session, the same for ``/ws`` and ``/mcp``: accept it,
    open a session (or attach to ``session_id``), ``answer`` its frames until it leaves,
    then release the session and close. A refused session, and the reaper closing an idle
    one, are told to the client as ``refusal`` words a ``ProtocolError`` in the socket's
    protocol."""
    await websocket.accept()
    try:
        session = await pool.open_or_attach(session_id)
    except ProtocolError as exc:
        with contextlib.suppress(RuntimeError, WebSocketDisconnect):
            await websocket.send_text(refusal(exc))
            await websocket.close()
        return

    async def hang_up() -> None:
        # Said twice: in a frame for a client that reads, and as the close reason, which
        # is what a client that next sends (OpenEnv's) reports.
        why = pool.config.idle_closed()
        await websocket.send_text(refusal(ProtocolError(SESSION_ERROR, why)))
        await websocket.close(code=1000, reason=why)

    session.on_reaped = hang_up
    try:
        await answer(session)
    except WebSocketDisconnect:
        pass
    finally:
        await pool.release(session, attached=session_id is not None)
        with contextlib.suppress(RuntimeError, WebSocketDisconnect):
            await websocket.close()


async def receive_frame(websocket: WebSocket) -> str | None:
    """The next frame's text (a binary frame read as UTF-8), or None once the client left."""
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        return None
    text = message.get("text")
    if text is None:
        return (message.get("bytes") or b"").decode("utf-8", errors="replace")
    return text


def oversized(text: str, limit: int) -> bool:
    """Whether a frame is over ``limit`` bytes of UTF-8; encoded only when its length in
    characters (1 to 4 bytes each) leaves the answer open."""
    return len(text) > limit or (
        4 * len(text) > limit and len(text.encode("utf-8", errors="replace")) > limit)


async def serve_frames(
    websocket: WebSocket, pool: SessionPool, session: Session, limit: int
) -> None:
    """Answer one connection's frames until it sends ``close`` or goes away."""
    while True:
        raw = await receive_frame(websocket)
        if raw is None:
            return
        try:
            if oversized(raw, limit):
                raise ProtocolError(REQUEST_TOO_LARGE, f"the frame is larger than the server's "
                                    f"limit of {limit} bytes")
            frame = await parsed(pool, raw)
            if not isinstance(frame, dict):
                raise ProtocolError(VALIDATION_ERROR, "a frame is a JSON object with 'type'")
            kind = frame.get("type")
            data = frame.get("data", {})
            if kind == "close":
                return
            if session.session_id not in pool.sessions:
                pool.get(session.session_id)  # raises the reaped-session error
            if kind == "reset":
                opening = await pool.reset(session, data or {})
                if session.attached:  # opened over HTTP: named as /reset's observation is
                    opening["observation"]["session_id"] = session.session_id
                reply = {"type": "observation", "data": opening}
            elif kind == "step":
                outcome = (mcp.step_action(pool, session, data) if mcp.is_mcp_action(data)
                           else pool.step(session, data))
                reply = {"type": "observation", "data": await outcome}
            elif kind == "state":
                reply = {"type": "state", "data": await pool.state(session)}
            elif kind == PRIVILEGED:
                check_critic(pool.config, data)
                reply = {"type": PRIVILEGED, "data": await pool.privileged(session)}
            elif kind == "mcp":  # JSON-RPC on the session; a notification gets no reply
                answer = await mcp.rpc_reply(pool, data, session)
                if answer is None:
                    continue
                reply = {"type": "mcp", "data": answer}
            else:
                raise ProtocolError(UNKNOWN_TYPE, f"Unknown message type: {kind}")
        except ProtocolError as exc:
            await send_error(websocket, exc)
            if exc.code == SESSION_ERROR:
                return
            continue
        except Exception as exc:  # an env bug ends the step, not the server
            log.exception("session %s failed", session.session_id)
            await send_error(websocket, ProtocolError(EXECUTION_ERROR,
                                                      f"{type(exc).__name__}: {exc}"))
            continue
        await websocket.send_text(dumps(reply))


async def send_error(websocket: WebSocket, error: ProtocolError) -> None:
    await websocket.send_text(error_frame(error))


def serve(
    config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, verbose: bool = False,
    allow_unauthenticated: bool = False,
) -> None:
    """Run the server until interrupted (uvicorn, ``agent_gym.serve.transport``), saying
    where it listens; ``verbose`` adds uvicorn's line per request and WebSocket session.

    Whoever reaches a server can make it run what its env runs (code, for the sandboxed
    ones), so off loopback it needs a token, or ``allow_unauthenticated`` saying that
    anyone on that network may: ``ExposureError`` otherwise, before anything binds."""
    import uvicorn

    if config.token is None and not is_loopback(host):
        if not allow_unauthenticated:
            raise ExposureError(
                f"--host {host} lets other machines reach the server, and it has no token: "
                "set one with --token-env VAR, or pass --allow-unauthenticated if everyone "
                "who can reach this address may use it")
        print(f"agent-gym serve: WARNING: listening on {host} with no token; anyone who "
              "reaches this address can run episodes (--allow-unauthenticated)",
              file=sys.stderr, flush=True)
    print(f"agent-gym serve: {config.env_id} on http://{host}:{port} (WebSocket "
          f"ws://{host}:{port}/ws, HTTP /reset /step /state; Ctrl-C stops)",
          file=sys.stderr, flush=True)

    shortfall = prepare_process(config.max_sessions)
    if shortfall is not None:
        print(f"agent-gym serve: WARNING: {shortfall}", file=sys.stderr, flush=True)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    from agent_gym.serve.transport import ServeWebSocketProtocol

    # The transport's own cap sits above the server's limit, so a frame a little too large
    # is answered with an error frame instead of a dropped connection. No per-message
    # deflate: its zlib state, some 300 KB a connection for the connection's life, went
    # through malloc with every connection opened and closed, and the heap kept the holes
    # (server RSS grew 13-39 KB per connection, 82 MB to 454 MB over 12,000); the frames
    # are short text on a nearby network, which it barely shrinks.
    uvicorn.run(
        create_app(config), host=host, port=port, ws=ServeWebSocketProtocol,
        ws_max_size=2 * config.max_request_bytes + 65536, ws_per_message_deflate=False,
        log_level="info" if verbose else "warning", access_log=verbose,
        timeout_graceful_shutdown=5,
    )
