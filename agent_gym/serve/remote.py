"""``agent_gym/Remote-v0``: a Gymnasium env whose episode runs on an ``agent-gym serve`` server.

Envs that are expensive to host next to a trainer (sandboxes, ALFWorld planners, a search
index) can run on another machine; this client makes such an env look local, so eval, the
trainers, Gymnasium vector envs and Ray workers use it unchanged::

    env = gymnasium.make("agent_gym/Remote-v0", url="http://host:8000")
    obs, info = env.reset(options={"task_id": "agsm-001"})
    state = env.unwrapped.save_state()          # the server's EnvState, as plain data
    other = gymnasium.make("agent_gym/Remote-v0", url="http://host:8000")
    other.reset(options={"state": state})       # a second session continues from there

It speaks the server's WebSocket session protocol (OpenEnv's ``/ws`` frames): one
connection is one server-side env, kept open for the env's lifetime. Calls block, as a local
env's do; callers that want concurrency run them in threads, one env per thread.

The server never sends privileged info (answers, oracle actions) with an observation, so a
reset's ``info["privileged"]`` is ``{}``, unless the client was made with the server's
critic token (``critic_token_env=VAR``, the server started with ``--critic-token-env``):
then each reset asks for it, for the eval oracle or a critic.

Credentials are named, never given: ``token_env`` and ``critic_token_env`` name environment
variables that hold them, because an env's constructor arguments are recorded wherever the
env is described (an eval run's ``config.json``, a saved state, a Ray actor's spec).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import gymnasium

from agent_gym import untrusted
from agent_gym.env.base import MAX_ACTION_CHARS, MAX_OBSERVATION_CHARS, UnicodeText
from agent_gym.env.state import EnvState, StateError
from agent_gym.extras import install_hint

try:
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import ClientConnection, connect
except ImportError as err:  # the client's transport is an optional extra
    raise ImportError(f"agent_gym.serve.remote needs websockets: {install_hint('serve')}") from err


class RemoteEnvError(RuntimeError):
    """The server refused a request; ``code`` is its wire error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{message} ({code})")
        self.code = code


def ws_url(url: str) -> str:
    """``http(s)://host:port`` (or ``ws(s)://``) -> the session endpoint ``ws(s)://.../ws``."""
    base = url.rstrip("/")
    for plain, secure in (("http://", "ws://"), ("https://", "wss://")):
        if base.startswith(plain):
            base = secure + base[len(plain):]
    if not base.startswith(("ws://", "wss://")):
        base = "ws://" + base
    return base if base.endswith("/ws") else base + "/ws"


class RemoteTextEnv(gymnasium.Env[str, str]):
    """A client session on an ``agent-gym serve`` server, with the local env contract:
    ``reset(seed, options)`` with ``task_id`` / ``index`` / ``state`` options, ``step(text)``
    and ``save_state()``. A restore is verified on the server, step by step, and refused
    there if the state was saved from an env with other settings than the server's.

    Args:
        url: the server, e.g. ``http://127.0.0.1:8000``.
        token_env: the environment variable holding the server's bearer token, if it
            requires one.
        critic_token_env: the environment variable holding the server's critic token, to
            have each reset's privileged info (a policy's client has none, and gets ``{}``).
        timeout: seconds to wait for a connection and for each reply.
    """

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012  (Gymnasium's own attribute)

    def __init__(self, url: str, token_env: str | None = None,
                 critic_token_env: str | None = None, timeout: float = 120.0) -> None:
        self.url = ws_url(url)
        token = _secret(token_env, "token_env")
        self._critic_token = _secret(critic_token_env, "critic_token_env")
        self.observation_space = UnicodeText(MAX_OBSERVATION_CHARS)
        self.action_space = UnicodeText(MAX_ACTION_CHARS)
        headers = {"Authorization": f"Bearer {token}"} if token else None
        self._timeout = timeout
        self._connection = contextlib.ExitStack()
        self._socket: ClientConnection | None = self._connection.enter_context(connect(
            self.url, open_timeout=timeout, additional_headers=headers, max_size=None,
            compression=None,
        ))

    def _call(self, kind: str, data: dict[str, Any] | None = None) -> dict[str, Any]:
        if self._socket is None:
            raise RuntimeError("the remote env is closed")
        frame: dict[str, Any] = {"type": kind}
        if data is not None:
            frame["data"] = data
        try:
            self._socket.send(json.dumps(frame, ensure_ascii=False))
            reply = untrusted.loads(self._socket.recv(timeout=self._timeout))
        except (ConnectionClosed, TimeoutError) as exc:
            raise RemoteEnvError("CONNECTION_LOST", f"the server at {self.url} went away: "
                                 f"{exc}") from exc
        except untrusted.UntrustedJSONError as exc:
            raise RemoteEnvError("INVALID_REPLY", f"the server at {self.url} replied with "
                                 f"something that {exc}") from exc
        if reply.get("type") == "error":
            error = reply.get("data", {})
            code, message = error.get("code", "UNKNOWN"), error.get("message", "server error")
            if code == "STATE_REFUSED":
                raise StateError(message)
            raise RemoteEnvError(code, message)
        return reply["data"]

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        data: dict[str, Any] = {} if seed is None else {"seed": seed}
        for key, value in (options or {}).items():
            if key == "state":
                value = _state_dict(value)
            elif key not in ("task_id", "index"):
                raise ValueError(f"unknown reset option {key!r}; use task_id, index or state")
            data[key] = value
        observation = self._call("reset", data)["observation"]
        privileged = {} if self._critic_token is None else \
            self._call("privileged", {"critic_token": self._critic_token})["privileged"]
        return observation["text"], {**observation["info"], "privileged": privileged}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not isinstance(action, str):
            raise TypeError(f"an action is the assistant's text (str), got {type(action).__name__}")
        payload = self._call("step", {"text": action})
        observation = payload["observation"]
        return (observation["text"], float(payload["reward"] or 0.0), observation["terminated"],
                observation["truncated"], observation["info"])

    @property
    def num_tasks(self) -> int:
        """Tasks of the served env (``describe_env`` and eval read it)."""
        return int(self._call("state")["num_tasks"])

    @property
    def max_turns(self) -> int:
        """Replies an episode of the served env may take."""
        return int(self._call("state")["max_turns"])

    def save_state(self) -> EnvState:
        """The server-side episode's state; restorable here, on the server, or locally."""
        state = self._call("state")["env_state"]
        if state is None:
            raise RuntimeError("call reset() before save_state()")
        return EnvState.from_dict(state)

    def close(self) -> None:
        if self._socket is not None:
            with contextlib.suppress(ConnectionClosed):
                self._socket.send(json.dumps({"type": "close"}))
            self._connection.close()
            self._socket = None
        super().close()


def _secret(variable: str | None, argument: str) -> str | None:
    """The credential in environment variable ``variable`` (None: no credential)."""
    if variable is None:
        return None
    value = os.environ.get(variable)
    if not value:
        raise ValueError(f"Remote-v0's {argument}={variable!r} names an environment variable "
                         "that is not set")
    return value


def _state_dict(state: Any) -> dict[str, Any]:
    if isinstance(state, str | bytes):
        state = EnvState.from_json(state)
    elif isinstance(state, dict):
        state = EnvState.from_dict(state)
    elif not isinstance(state, EnvState):
        raise StateError(f"cannot restore from a {type(state).__name__}; pass an EnvState")
    return json.loads(state.to_json())
