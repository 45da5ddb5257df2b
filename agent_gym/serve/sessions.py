"""The session table of ``agent-gym serve``: one env per client session, at most
``max_sessions`` of them, idle ones reaped; a session's reset, step and state calls.

An env's episode calls (``Episode``) and its task list (``TaskList``) are written once, for
the server and the in-process OpenEnv ``Environment`` (``agent_gym.adapters.openenv``)
alike: both check a client's data the same way and word refusals the same way.

Trust: every env is built from the server's own ``env_id`` and ``--env-arg`` settings; a
client's state is accepted only if it was saved from an env with those settings
(``Episode.reset``). An episode's privileged info stays here (``Episode.privileged``) for a
critic to ask for.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import gymnasium

import agent_gym  # noqa: F401  (importing it registers the envs)
from agent_gym.env.base import TextEnv
from agent_gym.env.state import EnvState, StateError, _json_kwargs
from agent_gym.serve.wire import (
    CAPACITY_REACHED,
    EXECUTION_ERROR,
    FACTORY_ERROR,
    PRIVILEGED,
    SESSION_ERROR,
    STATE_REFUSED,
    VALIDATION_ERROR,
    ProtocolError,
    action_text,
    observation_payload,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_SESSIONS = 64
DEFAULT_IDLE_TIMEOUT_S = 600.0
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
MAX_REAPED_IDS = 10_000
# The name of the one split a server serves when its env was built without a ``split``
# setting: every task the env holds.
ALL_TASKS = "all"
RESET_FIELDS = ("seed", "episode_id", "task_id", "index", "split", "state")
# CPython collects its young generation every 700 net allocations. A server holding a
# thousand sessions keeps hundreds of thousands of objects alive, and at any moment the
# frames and futures of every request in flight: collected that often, those in-flight
# objects are promoted to the old generation and soon force a full collection, a pause of
# 200-350 ms over 1,000 Search sessions during which no session is answered (p99 step
# latency 400 ms in benchmarks/bench_serve.py, "sessions"). Every 10,000 allocations they
# have mostly been answered and freed: no full collection in a minute, p99 about 20 ms.
GC_YOUNG_THRESHOLD = 10_000
# Open files the server needs besides one socket per session (its listening socket, the
# event loop's, its logs, an env's own files).
SPARE_FILES = 64
T = TypeVar("T")


def prepare_process(max_sessions: int) -> str | None:
    """Ready the server's process to hold ``max_sessions`` sessions; a warning to show
    when it cannot.

    Each session holds a socket, and many systems start a process with a soft limit of
    1,024 open files, so past about a thousand sessions new connections would fail; the
    soft limit is raised to the hard one, which the process may do itself. And the young
    generation is collected less often (``GC_YOUNG_THRESHOLD``)."""
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    try:
        import resource
    except ImportError:  # not POSIX: no limit of this kind to raise
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # No hard limit (macOS): what the sessions need, as far as the system allows.
    wanted = max(soft, max_sessions + SPARE_FILES) if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):  # a system that caps it lower
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
    if soft != resource.RLIM_INFINITY and soft < max_sessions + SPARE_FILES:
        return (f"this process may open {soft} files, too few for --max-sessions "
                f"{max_sessions} (one each, and {SPARE_FILES} to spare): sessions past "
                "that fail to connect; raise the limit (ulimit -n) or the sessions' number")
    return None


@dataclass(frozen=True)
class ServerConfig:
    """What the server hosts and its limits. ``env_kwargs`` are the server's own settings:
    every session's env is built from them, whatever a client sends. ``token`` admits a
    client at all; ``critic_token``, which must differ from it, is what a ``privileged``
    request carries (none: the server gives privileged info to no one)."""

    env_id: str
    env_kwargs: Mapping[str, Any] = field(default_factory=dict)
    max_sessions: int = DEFAULT_MAX_SESSIONS
    idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    token: str | None = None
    critic_token: str | None = None

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {self.max_sessions}")
        if self.max_request_bytes < 1024:
            raise ValueError("max_request_bytes must be at least 1024")
        if self.idle_timeout_s is not None and not 0 < self.idle_timeout_s < math.inf:
            raise ValueError("idle_timeout_s must be a positive finite number of seconds (or "
                             "None for no reaping)")
        if self.critic_token is not None and self.critic_token == self.token:
            raise ValueError("the critic token (--critic-token-env) must differ from the "
                             "policy's (--token-env): a policy holding it could ask for the "
                             "answers")

    def idle_closed(self) -> str:
        """Why a reaped session is gone, naming the setting that closed it."""
        return f"session closed after {self.idle_timeout_s:g} s idle (serve --idle-timeout)"


@dataclass
class Session:
    """One client's env and its episode. Its lock keeps that env's calls in order (HTTP
    requests for one session may arrive concurrently); different sessions step in parallel
    threads."""

    session_id: str
    episode: Episode
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_active: float = field(default_factory=time.monotonic)
    closed: bool = False
    # Whether a WebSocket that did not open this session is attached (``open_or_attach``):
    # OpenEnv's MCP client opens a session over HTTP, then resets it over ``/ws``.
    attached: bool = False
    # A WebSocket session's way to tell its client, when the reaper closes it, and hang up.
    on_reaped: Callable[[], Awaitable[None]] | None = None

    @property
    def env(self) -> gymnasium.Env:
        return self.episode.env


@dataclass(frozen=True)
class Catalogue:
    """What every session's env offers, the same for all since they are built alike: its
    tasks and the tools its episodes offer."""

    tasks: TaskList
    tools: tuple[dict[str, Any], ...]


class SessionPool:
    """At most ``max_sessions`` live envs; idle ones are closed by a reaper task.

    Every call into an env (build, reset and restore, step, save, close) runs in a worker
    thread, whatever the env: how long the next step takes is the client's to choose (a
    query, a program, a plan), so none may run on the event loop, where it would hold up
    every other session's replies and ``/health``."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.sessions: dict[str, Session] = {}
        # Ids of reaped sessions, so a late client is told why its session is gone;
        # bounded, oldest forgotten first.
        self.reaped: OrderedDict[str, None] = OrderedDict()
        self._reserved = 0
        # One thread per possible session, so a slow env (a sandboxed cell, an ALFWorld
        # planner) holds up no other session whatever the others do; threads are made only
        # when calls overlap (49 of them served 1,000 paced sessions in bench_serve).
        self.executor = ThreadPoolExecutor(
            max_workers=config.max_sessions, thread_name_prefix="agent-gym-env"
        )
        self._own_kwargs: dict[str, Any] | None = None
        self._catalogue: Catalogue | None = None
        self._catalogue_lock = asyncio.Lock()  # the first askers wait for one build

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
        episode = Episode(env, self.config.env_id, self._own_kwargs,
                          idle_timeout_s=self.config.idle_timeout_s)
        session = Session(secrets.token_hex(16), episode)
        self.sessions[session.session_id] = session
        return session

    async def open_or_attach(self, session_id: str | None) -> Session:
        """A new session, or the open one named ``session_id`` for a WebSocket to attach
        to (one WebSocket at a time); ``release`` undoes either."""
        if session_id is None:
            return await self.open()
        session = self.get(session_id)
        if session.attached:
            raise ProtocolError(SESSION_ERROR, f"session {session_id!r} already has a "
                                "WebSocket attached", status=409)
        session.attached = True
        session.last_active = time.monotonic()
        return session

    async def release(self, session: Session, attached: bool) -> None:
        """The end of a WebSocket: a session it ``attached`` to stays open for whoever
        opened it (closed by them, or by the reaper); one it opened is closed, even while
        another WebSocket is attached to it (asked by its id)."""
        if not attached:
            await self.close(session)
            return
        session.attached = False
        session.on_reaped = None
        session.last_active = time.monotonic()

    async def catalogue(self) -> Catalogue:
        """The env's tasks and tools, learnt once from an env built and reset
        in a worker thread (a session's own env may be mid-episode)."""
        async with self._catalogue_lock:
            if self._catalogue is None:
                self._catalogue = await self.run(describe, self.config.env_id,
                                                 dict(self.config.env_kwargs))
        return self._catalogue

    def get(self, session_id: Any) -> Session:
        if not isinstance(session_id, str) or not session_id:
            raise ProtocolError(VALIDATION_ERROR, "give the 'session_id' that /reset returned "
                                "(in observation.session_id)")
        session = self.sessions.get(session_id)
        if session is None:
            raise self._gone(session_id)
        return session

    def _gone(self, session_id: str) -> ProtocolError:
        """Why a session is not there: closed for being idle (the setting named), or not
        known."""
        if session_id in self.reaped:
            return ProtocolError(SESSION_ERROR, f"{self.config.idle_closed()} ({session_id})",
                                 status=404)
        return ProtocolError(SESSION_ERROR, f"session {session_id!r} is unknown (never "
                             "opened, or already closed)", status=404)

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
    # ``Episode``'s calls, in a worker thread, under the session's lock, on an open session.
    async def reset(self, session: Session, data: Mapping[str, Any]) -> dict[str, Any]:
        async with session.lock:
            self._check_open(session)
            payload = await self.run(session.episode.reset, data)
            session.last_active = time.monotonic()
        return payload

    async def step(self, session: Session, action: Any) -> dict[str, Any]:
        async with session.lock:
            self._check_open(session)
            payload = await self.run(session.episode.step, action)
            session.last_active = time.monotonic()
        return payload

    async def state(self, session: Session) -> dict[str, Any]:
        """The episode's state, and the session's id: a WebSocket's client learns it here,
        to name its session in a critic's ``POST /privileged``."""
        async with session.lock:
            self._check_open(session)
            session.last_active = time.monotonic()
            return {**await self.run(session.episode.state), "session_id": session.session_id}

    async def privileged(self, session: Session) -> dict[str, Any]:
        """The current episode's privileged info, for a critic (the caller checked its
        token); a copy of what the episode holds, so on the event loop."""
        async with session.lock:
            self._check_open(session)
            info = session.episode.privileged_info()
            session.last_active = time.monotonic()
        return {PRIVILEGED: info}

    def _check_open(self, session: Session) -> None:
        if session.closed:  # while this request waited for its lock
            raise self._gone(session.session_id)


@dataclass
class Episode:
    """An env's current episode and the calls on it, for every host of an env: the
    server's pool runs them in worker threads, the in-process OpenEnv ``Environment``
    directly, so a client's reset data and actions are checked alike and refused in the
    same words (``ProtocolError``s) wherever the env runs.

    ``own_kwargs`` are the host's settings of the env (a state saved from an env with others
    is refused); ``idle_timeout_s`` the server's, named when a step finds no episode,
    since a reaped client that reconnects finds itself on a fresh session."""

    env: gymnasium.Env
    env_id: str
    own_kwargs: Mapping[str, Any]
    idle_timeout_s: float | None = None
    episode_id: str | None = None
    step_count: int = 0
    # The current episode's ``info["privileged"]``, kept from its reset and given only to
    # a critic; None until a reset succeeds, so also whether there is an episode to step.
    privileged: dict[str, Any] | None = None

    def reset(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """Check a client's reset data and reset the env with it; the observation payload.
        (In a worker thread on the server: a state to parse and restore may be megabytes
        long.)"""
        seed, options, episode_id = reset_arguments(data, self.env_id, self.own_kwargs,
                                                    served_split(self.env))
        try:
            observation, info = self.env.reset(seed=seed, options=options)
        except StateError as exc:
            raise ProtocolError(STATE_REFUSED, f"restore failed: {exc}") from exc
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise ProtocolError(VALIDATION_ERROR, f"reset refused: {exc}") from exc
        self.episode_id = episode_id
        self.step_count = int(info.get("turn", 0))
        self.privileged = dict(info.get(PRIVILEGED) or {})
        return observation_payload(observation, info, reward=None, terminated=False,
                                   truncated=False)

    def step(self, action: Any) -> dict[str, Any]:
        """Step with a client's action object (``wire.action_text``); the observation
        payload."""
        text = action_text(action)
        self._check_started()
        try:
            observation, reward, terminated, truncated, info = self.env.step(text)
        except RuntimeError as exc:  # stepping after the end
            raise ProtocolError(EXECUTION_ERROR, str(exc), status=409) from exc
        self.step_count += 1
        return observation_payload(observation, info, reward=reward, terminated=terminated,
                                   truncated=truncated)

    def state(self) -> dict[str, Any]:
        return {
            "episode_id": self.episode_id,
            "step_count": self.step_count,
            "env_state": saved_state(self.env),
            # What a client needs to plan episodes (eval's task order, a trainer's turns).
            "num_tasks": self.env.unwrapped.num_tasks,
            "max_turns": self.env.unwrapped.max_turns,
        }

    def privileged_info(self) -> dict[str, Any]:
        """The current episode's privileged info (the caller decides who may have it)."""
        return dict(self._check_started())

    def _check_started(self) -> dict[str, Any]:
        """The episode's privileged info, or a refusal of a call that needs an episode
        before any reset: a client's slip (or one whose session was reaped and that
        reconnected to a fresh one), answered, not an env error logged with its
        traceback."""
        if self.privileged is not None:
            return self.privileged
        message = "no episode in this session yet: send reset first"
        if self.idle_timeout_s is not None:
            message += (f" (a session idle for {self.idle_timeout_s:g} s is closed, "
                        "serve --idle-timeout; a client that reconnects is on a new one)")
        raise ProtocolError(EXECUTION_ERROR, message, status=409)


def reset_arguments(
    data: Mapping[str, Any], env_id: str, own_kwargs: Mapping[str, Any], split: str
) -> tuple[int | None, dict[str, Any], str | None]:
    """A reset's seed, options and episode id from a client's data. ``split`` is the one
    split the env serves: OpenEnv's task API resets by split and index, and the split is a
    host setting, so naming another is refused rather than ignored."""
    if not isinstance(data, Mapping):
        raise ProtocolError(VALIDATION_ERROR, "reset data must be a JSON object")
    unknown = set(data) - set(RESET_FIELDS)
    if unknown:
        raise ProtocolError(VALIDATION_ERROR, f"unknown reset fields {sorted(unknown)}; "
                            f"use {', '.join(RESET_FIELDS)}")
    seed = data.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise ProtocolError(VALIDATION_ERROR, "seed must be a non-negative integer")
    episode_id = data.get("episode_id")
    if episode_id is not None and (not isinstance(episode_id, str) or len(episode_id) > 255):
        raise ProtocolError(VALIDATION_ERROR, "episode_id must be a string of at most 255 "
                            "characters")
    if "split" in data:
        check_split(data["split"], split)
    options = {key: data[key] for key in ("task_id", "index") if key in data}
    if "state" in data:
        if options or seed is not None or "split" in data:
            raise ProtocolError(VALIDATION_ERROR, "'state' cannot be combined with seed, "
                                "task_id, index or split: the state names its task and seed")
        options["state"] = trusted_state(data["state"], env_id, own_kwargs)
    return seed, options, episode_id


def trusted_state(raw: Any, env_id: str, own_kwargs: Mapping[str, Any]) -> EnvState:
    """Parse a client's state and accept it only for ``env_id`` built with ``own_kwargs``."""
    try:
        state = EnvState.from_json(raw) if isinstance(raw, str) else EnvState.from_dict(raw)
    except StateError as exc:
        raise ProtocolError(STATE_REFUSED, f"bad state: {exc}") from exc
    if state.env_id != env_id:
        raise ProtocolError(STATE_REFUSED, f"the state belongs to {state.env_id!r}; this "
                            f"server hosts {env_id!r}")
    if state.env_kwargs != own_kwargs:
        raise ProtocolError(
            STATE_REFUSED,
            f"the state was saved from {state.env_id} built with {state.env_kwargs}; this "
            f"server builds it with {dict(own_kwargs)} (its own --env-arg settings) and "
            "never takes env settings from a client",
        )
    return state


def served_split(env: gymnasium.Env) -> str:
    """The split an env's tasks come from: its ``split`` setting, or ``ALL_TASKS``."""
    split = getattr(env.unwrapped, "_env_kwargs", {}).get("split")
    return split if isinstance(split, str) and split else ALL_TASKS


def check_split(asked: Any, split: str) -> None:
    """Refuse a split other than ``split``, the one the env serves: the split is a host
    setting, so a client naming another is told so rather than ignored."""
    if asked != split:
        raise ProtocolError(VALIDATION_ERROR, f"split {asked!r} is not served here: this "
                            f"env's tasks are split {split!r} (the split is the host's "
                            "setting: serve --env-arg split=...)")


class TaskIndexError(ProtocolError):
    """A task index out of range: the one refusal OpenEnv's task API contract has an
    ``Environment`` raise as ``IndexError`` (its server answers that with 400)."""


@dataclass(frozen=True)
class TaskList:
    """OpenEnv's task API (``TaskProvider``) over an env's tasks, for the server's routes
    and the in-process ``Environment`` alike: the env's one split, and its tasks as
    ``{"id", "index"}``, never a task's payload, which holds its answer. Every call names
    the split, which is checked; bounds and indices come from clients and are checked too."""

    split: str
    task_ids: tuple[str, ...]

    @classmethod
    def of(cls, env: gymnasium.Env) -> TaskList:
        return cls(served_split(env), tuple(task.task_id for task in env.unwrapped.tasks))

    def ids(self, split: Any) -> Sequence[str]:
        """The task ids of ``split``, which must be the one served."""
        check_split(split, self.split)
        return self.task_ids

    def task(self, split: Any, index: Any) -> dict[str, Any]:
        ids = self.ids(split)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(ids):
            raise TaskIndexError(VALIDATION_ERROR, f"index must be a whole number in "
                                 f"[0, {len(ids)}), got {index!r}")
        return {"id": ids[index], "index": index}

    def tasks(self, split: Any, start: Any = None, stop: Any = None) -> list[dict[str, Any]]:
        """The tasks from ``start`` to ``stop`` (as a slice takes them; None: every one)."""
        ids = self.ids(split)
        if any(bound is not None and (isinstance(bound, bool) or not isinstance(bound, int))
               for bound in (start, stop)):
            raise ProtocolError(VALIDATION_ERROR, "start and stop must be whole numbers or "
                                "null")
        return [{"id": ids[i], "index": i} for i in range(len(ids))[start:stop]]


def describe(env_id: str, env_kwargs: Mapping[str, Any]) -> Catalogue:
    """Build ``env_id`` and read its catalogue; the tools are a reset's (an env may choose
    them by its protocol setting)."""
    env = gymnasium.make(env_id, disable_env_checker=True, **env_kwargs)
    try:
        _, info = env.reset(options={"index": 0})
        return Catalogue(TaskList.of(env), tuple(info.get("tools", ())))
    finally:
        env.close()


def saved_state(env: gymnasium.Env) -> dict[str, Any] | None:
    """The env's ``EnvState`` as a JSON object, or None before its first reset."""
    try:
        return json.loads(env.unwrapped.save_state().to_json())
    except RuntimeError:  # not reset yet: no episode to save
        return None
