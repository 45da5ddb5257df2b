"""The wire format of ``agent-gym serve`` (OpenEnv's): error codes, request and response
schemas (see ``agent_gym.serve.app``; MCP's JSON-RPC is ``agent_gym.serve.mcp``).

Every observation a client receives is built by ``observation_payload``, which leaves out
the env's ``info["privileged"]`` (reference answers, oracle actions, walkthroughs, gold
passages): clients such as verifiers' OpenEnv env show the whole observation to the model.
A critic asks for it with a ``privileged`` request and the server's critic token.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

OPENENV_VERSION_MATCHED = "openenv 0.4.1"

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

PRIVILEGED = "privileged"  # the info key, the request type and its reply's field

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
                 "message, invalid, turn, ...) without 'privileged', which only a critic "
                 "gets, from a 'privileged' request"},
        "terminated": {"type": "boolean"},
        "truncated": {"type": "boolean"},
        "session_id": {"type": "string", "description": "sessions opened over HTTP only "
                       "(/reset, or /mcp's openenv/session/create)"},
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
        "session_id": {"type": "string", "description": "the session's id, which a "
                       "critic's POST /privileged names"},
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
    split of ``done`` into ``terminated`` and ``truncated``, which trainers need, and the
    info without ``privileged``: an observation may reach the policy whole."""
    return {
        "observation": {
            "text": observation,
            "info": {key: value for key, value in info.items() if key != PRIVILEGED},
            "terminated": bool(terminated),
            "truncated": bool(truncated),
        },
        "reward": None if reward is None else float(reward),
        "done": bool(terminated or truncated),
    }


def dumps(value: Any) -> str:
    """``value`` as JSON text that always encodes as UTF-8, the one encoder of every reply.

    Numpy scalars become numbers, sets and tuples lists, anything else unknown its string
    (an env's info may hold any of them). A lone surrogate (an action sent as ``"\\ud800"``
    decodes to one, and the env echoes it in its messages and state) has no UTF-8 form, so
    such a reply is written with JSON's ``\\u`` escapes instead: the client reads back the
    very text it sent, and a saved state holding it restores."""
    text = json.dumps(value, default=_convert, ensure_ascii=False)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return json.dumps(value, default=_convert)
    return text


def _convert(item: Any) -> Any:
    if hasattr(item, "item") and callable(item.item):
        return item.item()
    if isinstance(item, set | frozenset | tuple):
        return list(item)
    return str(item)


def server_version() -> str:
    """agent-gym's version, which the server reports (OpenAPI, metadata, MCP)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agent-gym")
    except PackageNotFoundError:
        return "0.0.0"
