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
  ``GET /health`` and ``POST /mcp`` (JSON-RPC ``tools/list``). OpenEnv's own HTTP reset and
  step build a throwaway env per request, which cannot hold a multi-turn episode; here
  ``/reset`` opens a session whose id comes back as ``observation.session_id`` and is passed
  to ``/step`` and ``/state`` (an extra request field, which OpenEnv's request models allow),
  and ``POST /close`` ends it.

Extensions inside the spec: ``reset`` data may carry ``state`` (an ``EnvState`` as saved by
``save_state``) to restore mid-episode, or ``task_id`` / ``index`` to pick a task; the
``state`` reply carries the session's current ``EnvState`` as ``env_state``.

Trust: the server builds every env from its own ``env_id`` and ``--env-arg`` settings. A
client's state is only a list of actions to replay: one saved from an env with other
settings (sandbox isolation, limits, paths, backends) is refused, never used to build one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import sys
import time
import warnings
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import gymnasium

from agent_gym.extras import install_hint

try:
    from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
    from fastapi.responses import Response
except ImportError as err:  # the server's stack is an optional extra
    raise ImportError(f"agent-gym serve needs FastAPI: {install_hint('serve')}") from err

import agent_gym  # noqa: F401  (importing it registers the envs)
from agent_gym.env.base import TextEnv, _json_kwargs
from agent_gym.env.state import EnvState, StateError

log = logging.getLogger(__name__)

OPENENV_VERSION_MATCHED = "openenv 0.4.1"
DEFAULT_MAX_SESSIONS = 64
DEFAULT_IDLE_TIMEOUT_S = 600.0
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
MAX_REAPED_IDS = 10_000
# A step of an env whose steps are computation only (``TextEnv.steps_in_process``) runs on
# the event loop, skipping the two thread hand-offs that cost more than such a step (0.25 ms
# of the 1 ms p50 a Search-v0 step took through the server on a loaded 2-core machine) --
# once that session's last INLINE_AFTER steps each took under INLINE_STEP_BUDGET_S. A pure-
# Python step in a worker thread holds the GIL, and so the loop, just as long, so a short one
# holds no other session up longer there; a slower step sends the session back to the pool.
INLINE_STEP_BUDGET_S = 0.001
INLINE_AFTER = 3
T = TypeVar("T")

# OpenEnv's WSErrorCode values, plus two of ours for restore and authentication.
INVALID_JSON = "INVALID_JSON"
UNKNOWN_TYPE = "UNKNOWN_TYPE"
VALIDATION_ERROR = "VALIDATION_ERROR"
EXECUTION_ERROR = "EXECUTION_ERROR"
CAPACITY_REACHED = "CAPACITY_REACHED"
FACTORY_ERROR = "FACTORY_ERROR"
SESSION_ERROR = "SESSION_ERROR"
REQUEST_TOO_LARGE = "REQUEST_TOO_LARGE"
STATE_REFUSED = "STATE_REFUSED"
UNAUTHORIZED = "UNAUTHORIZED"

ACTION_SCHEMA: dict[str, Any] = {
    "title": "AgentGymAction",
    "description": "The assistant's raw reply; tool calls are written in it as the env's "
    "prompt asks.",
    "type": "object",
    "properties": {
        "text": {"type": "string", "description": "the assistant's message"},
        "metadata": {"type": "object", "description": "ignored by the env"},
    },
    "required": ["text"],
    "additionalProperties": False,
}
OBSERVATION_SCHEMA: dict[str, Any] = {
    "title": "AgentGymObservation",
    "type": "object",
    "properties": {
        "text": {"type": "string", "description": "the env's observation"},
        "info": {"type": "object", "description": "the Gymnasium info dict (messages, tools, "
                 "privileged, message, invalid, turn, ...)"},
        "terminated": {"type": "boolean"},
        "truncated": {"type": "boolean"},
        "session_id": {"type": "string", "description": "HTTP sessions only"},
    },
    "required": ["text", "info", "terminated", "truncated"],
}
STATE_SCHEMA: dict[str, Any] = {
    "title": "AgentGymState",
    "type": "object",
    "properties": {
        "episode_id": {"type": ["string", "null"]},
        "step_count": {"type": "integer", "minimum": 0},
        "env_state": {"type": ["object", "null"], "description": "agent_gym EnvState: pass "
                      "it as reset's 'state' to restore this point of the episode"},
        "num_tasks": {"type": "integer", "minimum": 1, "description": "tasks the env holds"},
        "max_turns": {"type": "integer", "minimum": 1, "description": "replies an episode "
                      "may take"},
    },
}


class ProtocolError(Exception):
    """A request the server refuses; ``code`` is the wire error code."""

    def __init__(self, code: str, message: str, status: int = 400, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.status = status
        self.extra = extra

    def payload(self) -> dict[str, Any]:
        return {"message": str(self), "code": self.code, **self.extra}


@dataclass(frozen=True)
class ServerConfig:
    """What the server hosts and its limits. ``env_kwargs`` are the server's own settings:
    every session's env is built from them, whatever a client sends."""

    env_id: str
    env_kwargs: Mapping[str, Any] = field(default_factory=dict)
    max_sessions: int = DEFAULT_MAX_SESSIONS
    idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    token: str | None = None

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {self.max_sessions}")
        if self.max_request_bytes < 1024:
            raise ValueError("max_request_bytes must be at least 1024")
        if self.idle_timeout_s is not None and self.idle_timeout_s <= 0:
            raise ValueError("idle_timeout_s must be positive (or None for no reaping)")


@dataclass
class Session:
    """One client's env. Its lock keeps that env's calls in order (HTTP requests for one
    session may arrive concurrently); different sessions step in parallel threads, except
    short steps of in-process envs, which run on the event loop (INLINE_STEP_BUDGET_S)."""

    session_id: str
    env: gymnasium.Env
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_active: float = field(default_factory=time.monotonic)
    episode_id: str | None = None
    step_count: int = 0
    closed: bool = False
    # Consecutive steps under INLINE_STEP_BUDGET_S; counted only for envs whose steps run
    # in process, so it says whether the next step may run on the event loop.
    fast_steps: int = 0
    # A WebSocket session's way to tell its client, when the reaper closes it, and hang up.
    on_reaped: Callable[[], Awaitable[None]] | None = None


class SessionPool:
    """At most ``max_sessions`` live envs; idle ones are closed by a reaper task."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.sessions: dict[str, Session] = {}
        # Ids of reaped sessions, so a late client is told why its session is gone;
        # bounded, oldest forgotten first.
        self.reaped: OrderedDict[str, None] = OrderedDict()
        self._reserved = 0
        # One thread per possible session: a slow env (a sandboxed cell, an ALFWorld
        # planner) must not hold up the others.
        self.executor = ThreadPoolExecutor(
            max_workers=min(config.max_sessions, 256), thread_name_prefix="agent-gym-env"
        )
        self._own_kwargs: dict[str, Any] | None = None
        self.tools: list[dict[str, Any]] | None = None

    async def run(self, func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, lambda: func(*args, **kwargs))

    async def open(self) -> Session:
        if len(self.sessions) + self._reserved >= self.config.max_sessions:
            raise ProtocolError(
                CAPACITY_REACHED,
                f"the server holds its maximum of {self.config.max_sessions} sessions; close "
                "one or start the server with a larger --max-sessions",
                status=503,
                active_sessions=len(self.sessions),
                max_sessions=self.config.max_sessions,
            )
        self._reserved += 1
        try:
            # No passive env checker: it is a development aid, and a refused first reset
            # (a bad task index) would leave it unable to check the next one.
            env = await self.run(gymnasium.make, self.config.env_id, disable_env_checker=True,
                                 **self.config.env_kwargs)
        except Exception as exc:
            log.exception("building %s failed", self.config.env_id)
            raise ProtocolError(
                FACTORY_ERROR, f"could not build {self.config.env_id}: {exc}", status=500,
                factory_name=self.config.env_id,
            ) from exc
        finally:
            self._reserved -= 1
        if not isinstance(env.unwrapped, TextEnv):
            env.close()
            raise ProtocolError(FACTORY_ERROR, f"{self.config.env_id} is not an agent_gym env",
                                status=500, factory_name=self.config.env_id)
        if self._own_kwargs is None:
            self._own_kwargs = _json_kwargs(self.config.env_id, env.unwrapped._env_kwargs)
        session = Session(secrets.token_hex(16), env)
        self.sessions[session.session_id] = session
        return session

    def get(self, session_id: Any) -> Session:
        if not isinstance(session_id, str) or not session_id:
            raise ProtocolError(VALIDATION_ERROR, "give the 'session_id' that /reset returned "
                                "(in observation.session_id)")
        session = self.sessions.get(session_id)
        if session is None:
            why = "was closed after being idle too long" if session_id in self.reaped else \
                "is unknown (never opened, or already closed)"
            raise ProtocolError(SESSION_ERROR, f"session {session_id!r} {why}", status=404)
        return session

    async def close(self, session: Session) -> None:
        if self.sessions.pop(session.session_id, None) is None:
            return
        session.closed = True
        async with session.lock:
            with contextlib.suppress(Exception):
                await self.run(session.env.close)

    async def reap_forever(self) -> None:
        timeout = self.config.idle_timeout_s
        if timeout is None:
            return
        while True:
            await asyncio.sleep(min(max(timeout / 4, 0.05), 30.0))
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if now - session.last_active > timeout and not session.lock.locked():
                    self.reaped[session.session_id] = None
                    while len(self.reaped) > MAX_REAPED_IDS:
                        self.reaped.popitem(last=False)
                    await self.close(session)
                    if session.on_reaped is not None:
                        with contextlib.suppress(Exception):  # the client may be gone too
                            await session.on_reaped()

    async def shutdown(self) -> None:
        for session in list(self.sessions.values()):
            await self.close(session)
        self.executor.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------- episode calls
    async def reset(self, session: Session, data: Mapping[str, Any]) -> dict[str, Any]:
        seed, options, episode_id = self._reset_arguments(data)
        async with session.lock:
            self._check_open(session)
            try:
                observation, info = await self.run(session.env.reset, seed=seed, options=options)
            except StateError as exc:
                raise ProtocolError(STATE_REFUSED, f"restore failed: {exc}") from exc
            except (KeyError, IndexError, ValueError, TypeError) as exc:
                raise ProtocolError(VALIDATION_ERROR, f"reset refused: {exc}") from exc
            session.episode_id = episode_id
            session.step_count = int(info.get("turn", 0))
            session.last_active = time.monotonic()
        return observation_payload(observation, info, reward=None, terminated=False,
                                   truncated=False)

    async def step(self, session: Session, action: Any) -> dict[str, Any]:
        text = action_text(action)
        async with session.lock:
            self._check_open(session)
            try:
                if session.fast_steps >= INLINE_AFTER:
                    outcome, took = timed_step(session.env, text)
                else:
                    outcome, took = await self.run(timed_step, session.env, text)
            except RuntimeError as exc:  # stepping before reset or after the end
                raise ProtocolError(EXECUTION_ERROR, str(exc)) from exc
            observation, reward, terminated, truncated, info = outcome
            in_process = session.env.unwrapped.steps_in_process
            fast = in_process and took < INLINE_STEP_BUDGET_S
            session.fast_steps = session.fast_steps + 1 if fast else 0
            session.step_count += 1
            session.last_active = time.monotonic()
        return observation_payload(observation, info, reward=reward, terminated=terminated,
                                   truncated=truncated)

    async def state(self, session: Session) -> dict[str, Any]:
        async with session.lock:
            self._check_open(session)
            session.last_active = time.monotonic()
            try:
                env_state = await self.run(session.env.unwrapped.save_state)
            except RuntimeError:  # not reset yet: no episode to save
                env_state = None
        return {
            "episode_id": session.episode_id,
            "step_count": session.step_count,
            "env_state": None if env_state is None else json.loads(env_state.to_json()),
            # What a client needs to plan episodes (eval's task order, a trainer's turns).
            "num_tasks": session.env.unwrapped.num_tasks,
            "max_turns": session.env.unwrapped.max_turns,
        }

    def _check_open(self, session: Session) -> None:
        if session.closed:
            raise ProtocolError(SESSION_ERROR, f"session {session.session_id!r} was closed "
                                "after being idle too long", status=404)

    def _reset_arguments(
        self, data: Mapping[str, Any]
    ) -> tuple[int | None, dict[str, Any], str | None]:
        if not isinstance(data, Mapping):
            raise ProtocolError(VALIDATION_ERROR, "reset data must be a JSON object")
        unknown = set(data) - {"seed", "episode_id", "state", "task_id", "index"}
        if unknown:
            raise ProtocolError(VALIDATION_ERROR, f"unknown reset fields {sorted(unknown)}; "
                                "use seed, episode_id, task_id, index or state")
        seed = data.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise ProtocolError(VALIDATION_ERROR, "seed must be a non-negative integer")
        episode_id = data.get("episode_id")
        if episode_id is not None and (not isinstance(episode_id, str) or len(episode_id) > 255):
            raise ProtocolError(VALIDATION_ERROR, "episode_id must be a string of at most 255 "
                                "characters")
        options = {key: data[key] for key in ("task_id", "index") if key in data}
        if "state" in data:
            if options or seed is not None:
                raise ProtocolError(VALIDATION_ERROR, "'state' cannot be combined with seed, "
                                    "task_id or index: the state names its task and seed")
            options["state"] = self._trusted_state(data["state"])
        return seed, options, episode_id

    def _trusted_state(self, raw: Any) -> EnvState:
        """Parse a client's state and accept it only for this server's env and settings."""
        try:
            state = EnvState.from_json(raw) if isinstance(raw, str) else EnvState.from_dict(raw)
        except StateError as exc:
            raise ProtocolError(STATE_REFUSED, f"bad state: {exc}") from exc
        if state.env_id != self.config.env_id:
            raise ProtocolError(STATE_REFUSED, f"the state belongs to {state.env_id!r}; this "
                                f"server hosts {self.config.env_id!r}")
        if state.env_kwargs != self._own_kwargs:
            raise ProtocolError(
                STATE_REFUSED,
                f"the state was saved from {state.env_id} built with {state.env_kwargs}; this "
                f"server builds it with {self._own_kwargs} (its own --env-arg settings) and "
                "never takes env settings from a client",
            )
        return state


def timed_step(
    env: gymnasium.Env, text: str
) -> tuple[tuple[str, float, bool, bool, dict[str, Any]], float]:
    """``env.step(text)`` and the seconds it took, timed where it ran."""
    started = time.perf_counter()
    outcome = env.step(text)
    return outcome, time.perf_counter() - started


def action_text(action: Any) -> str:
    """The assistant text of an action object: ``{"text": "...", "metadata"?: {...}}``."""
    if not isinstance(action, Mapping):
        raise ProtocolError(VALIDATION_ERROR, "the action must be an object {\"text\": \"...\"}")
    extra = set(action) - {"text", "metadata"}
    if extra:
        raise ProtocolError(VALIDATION_ERROR, f"unknown action fields {sorted(extra)}; the "
                            "action is {\"text\": \"<assistant message>\"}")
    text = action.get("text")
    if not isinstance(text, str):
        raise ProtocolError(VALIDATION_ERROR, "action field 'text' must be a string")
    return text


def observation_payload(
    observation: str, info: Mapping[str, Any], *, reward: float | None, terminated: bool,
    truncated: bool,
) -> dict[str, Any]:
    """OpenEnv's ``{observation, reward, done}``; the observation keeps the Gymnasium
    split of ``done`` into ``terminated`` and ``truncated``, which trainers need."""
    return {
        "observation": {
            "text": observation,
            "info": dict(info),
            "terminated": bool(terminated),
            "truncated": bool(truncated),
        },
        "reward": None if reward is None else float(reward),
        "done": bool(terminated or truncated),
    }


def dumps(value: Any) -> str:
    """``value`` as JSON text in one pass: numpy scalars become numbers, sets and tuples
    lists, anything else unknown its string (an env's info may hold any of them)."""
    return json.dumps(value, default=_convert, ensure_ascii=False)


def _convert(item: Any) -> Any:
    if hasattr(item, "item") and callable(item.item):
        return item.item()
    if isinstance(item, set | frozenset | tuple):
        return list(item)
    return str(item)


class JSONText(Response):
    """A JSON response written by ``dumps`` (Starlette's own rejects numpy values)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


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

    app = FastAPI(title=f"agent-gym {config.env_id}", version=_version(), lifespan=lifespan)
    app.state.pool = pool

    def authorized(headers: Mapping[str, str]) -> bool:
        if config.token is None:
            return True
        scheme, _, given = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip(), config.token)

    async def guarded(request: Request, handler: Callable[[Any], Awaitable[Any]]) -> JSONText:
        """Authenticate, read the body within the size limit, map refusals to errors."""
        try:
            if not authorized(request.headers):
                raise ProtocolError(UNAUTHORIZED, "missing or wrong bearer token", status=401)
            body = await read_body(request, config.max_request_bytes)
            payload: Any = {}
            if body.strip():
                try:
                    payload = json.loads(body)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise ProtocolError(INVALID_JSON, f"Invalid JSON: {exc}") from exc
            return JSONText(await handler(payload))
        except ProtocolError as exc:
            return JSONText({"detail": exc.payload()}, status_code=exc.status)
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
            "version": _version(),
            "author": "agent-gym",
            "readme_content": None,
            "documentation_url": None,
        }

    @app.get("/schema", tags=["Schema"])
    async def schema() -> dict[str, Any]:
        return {"action": ACTION_SCHEMA, "observation": OBSERVATION_SCHEMA,
                "state": STATE_SCHEMA}

    @app.post("/mcp", tags=["MCP"])
    async def mcp(request: Request) -> JSONText:
        """JSON-RPC 2.0 ``tools/list``: the env's tools. Episodes run on /ws and /step."""
        try:
            if not authorized(request.headers):
                raise ProtocolError(UNAUTHORIZED, "missing or wrong bearer token", status=401)
            body = await read_body(request, config.max_request_bytes)
        except ProtocolError as exc:
            return JSONText({"detail": exc.payload()}, status_code=exc.status)
        return JSONText(await mcp_reply(body, pool))

    @app.websocket("/ws")
    async def websocket_session(websocket: WebSocket) -> None:
        await websocket.accept()
        if not authorized(websocket.headers):
            with contextlib.suppress(RuntimeError, WebSocketDisconnect):
                await send_error(websocket, ProtocolError(UNAUTHORIZED, "missing or wrong "
                                                          "bearer token"))
                await websocket.close(code=1008)
            return
        try:
            session = await pool.open()
        except ProtocolError as exc:
            with contextlib.suppress(RuntimeError, WebSocketDisconnect):
                await send_error(websocket, exc)
                await websocket.close()
            return
        async def hang_up() -> None:
            await send_error(websocket, ProtocolError(
                SESSION_ERROR, f"session {session.session_id!r} was closed after being idle "
                f"longer than {config.idle_timeout_s} s"))
            await websocket.close(code=1000)

        session.on_reaped = hang_up
        try:
            await serve_frames(websocket, pool, session, config.max_request_bytes)
        except WebSocketDisconnect:
            pass
        finally:
            await pool.close(session)
            with contextlib.suppress(RuntimeError, WebSocketDisconnect):
                await websocket.close()

    return app


async def serve_frames(
    websocket: WebSocket, pool: SessionPool, session: Session, limit: int
) -> None:
    """Answer one connection's frames until it sends ``close`` or goes away."""
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return
        raw = message.get("text")
        if raw is None:
            raw = (message.get("bytes") or b"").decode("utf-8", errors="replace")
        try:
            if len(raw) > limit or (
                4 * len(raw) > limit and len(raw.encode("utf-8", errors="replace")) > limit
            ):
                raise ProtocolError(REQUEST_TOO_LARGE, f"the frame is larger than the server's "
                                    f"limit of {limit} bytes")
            try:
                frame = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ProtocolError(INVALID_JSON, f"Invalid JSON: {exc}") from exc
            if not isinstance(frame, dict):
                raise ProtocolError(VALIDATION_ERROR, "a frame is a JSON object with 'type'")
            kind = frame.get("type")
            data = frame.get("data", {})
            if kind == "close":
                return
            if session.session_id not in pool.sessions:
                pool.get(session.session_id)  # raises the reaped-session error
            if kind == "reset":
                reply = {"type": "observation", "data": await pool.reset(session, data or {})}
            elif kind == "step":
                reply = {"type": "observation", "data": await pool.step(session, data)}
            elif kind == "state":
                reply = {"type": "state", "data": await pool.state(session)}
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
    await websocket.send_text(json.dumps({"type": "error", "data": error.payload()}))


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


async def mcp_reply(body: bytes, pool: SessionPool) -> dict[str, Any]:
    try:
        request = json.loads(body or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _rpc_error(None, -32700, "Parse error")
    if not isinstance(request, dict) or request.get("jsonrpc") != "2.0" or "method" not in request:
        return _rpc_error(request.get("id") if isinstance(request, dict) else None, -32600,
                          "Invalid Request: expected a JSON-RPC 2.0 request")
    if request["method"] != "tools/list":
        return _rpc_error(request.get("id"), -32601, f"Method not found: {request['method']}; "
                          "only tools/list is served (episodes run on /ws)")
    if pool.tools is None:
        pool.tools = await pool.run(_env_tools, pool.config.env_id, dict(pool.config.env_kwargs))
    tools = pool.tools
    listed = [{"name": t["function"]["name"], "description": t["function"]["description"],
               "inputSchema": t["function"]["parameters"]} for t in tools]
    return {"jsonrpc": "2.0", "id": request.get("id"), "result": {"tools": listed}}


def _env_tools(env_id: str, env_kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    env = gymnasium.make(env_id, **env_kwargs)
    try:
        return env.reset(options={"index": 0})[1]["tools"]
    finally:
        env.close()


def _rpc_error(request_id: Any, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agent-gym")
    except PackageNotFoundError:
        return "0.0.0"


def serve(
    config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, verbose: bool = False
) -> None:
    """Run the server until interrupted (uvicorn on the ``websockets`` package), saying
    where it listens; ``verbose`` adds uvicorn's line per request and WebSocket session."""
    import uvicorn

    print(f"agent-gym serve: {config.env_id} on http://{host}:{port} (WebSocket "
          f"ws://{host}:{port}/ws, HTTP /reset /step /state; Ctrl-C stops)",
          file=sys.stderr, flush=True)

    # uvicorn's "websockets" protocol served 45% more steps/s than its newer "sansio" one in
    # benchmarks/bench_serve.py; uvicorn marks it deprecated, which is not this server's news.
    warnings.filterwarnings("ignore", message="The `websockets` implementation is deprecated")
    # The transport's own cap sits above the server's limit, so a frame a little too large
    # is answered with an error frame instead of a dropped connection.
    uvicorn.run(
        create_app(config), host=host, port=port, ws="websockets",
        ws_max_size=2 * config.max_request_bytes + 65536,
        log_level="info" if verbose else "warning", access_log=verbose,
        timeout_graceful_shutdown=5,
    )
