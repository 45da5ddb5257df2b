"""MCP as OpenEnv speaks it: JSON-RPC 2.0 over ``POST /mcp``, the ``/mcp`` WebSocket and
the ``mcp`` frame of ``/ws``, plus the ``list_tools`` / ``call_tool`` step actions that
OpenEnv's ``MCPToolClient`` sends on ``/ws`` (see ``agent_gym.serve.app``).

The tools are the env's own (``info["tools"]`` of a reset: Search's ``search``,
CodeInterpreter's ``code_interpreter``, ALFWorld's ``alfworld_step``) and ``answer``, a
reply without a tool call, which is how an episode ends with an answer (GSM8K has no other
tool). A call is one env step: it is written as the reply a model would write
(``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, or the ``answer``'s text as
is) and the env's own strict parser judges it, so an MCP client plays the very episode a
chat client plays and is scored alike. Its result is the step's observation payload,
built by ``wire.observation_payload``: privileged info never leaves through MCP either.

Sessions are the server's one session table: ``openenv/session/create`` opens one (its id
works on ``/step`` too, and a ``/ws?session_id=`` WebSocket attaches to it, as OpenEnv's
client does to reset it), ``agent_gym/reset`` resets one over MCP itself, and
``openenv/session/close`` closes it. On a WebSocket the session is the connection's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from agent_gym.actions.tools import format_tool_call
from agent_gym.serve.sessions import Session, SessionPool
from agent_gym.serve.wire import VALIDATION_ERROR, ProtocolError, server_version

log = logging.getLogger(__name__)

# MCP revisions whose handshake and tool calls this server answers (it uses nothing that
# differs between them); a client asking for another is offered the newest and decides.
MCP_PROTOCOL_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18")
REPLY_TOOL = "answer"
# The step actions of OpenEnv's MCPToolClient over /ws (openenv.core.env_server.mcp_types).
MCP_ACTION_TYPES = frozenset({"list_tools", "call_tool"})

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
SERVER_ERROR = -32000


class RpcError(Exception):
    """A JSON-RPC request the server refuses: ``code`` is JSON-RPC's, ``data`` the wire
    error's payload when a session call refused it."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.data = data


class UnknownTool(RpcError):
    """A call of a tool the env does not have (OpenEnv's ``tool_not_found``)."""


def reply_tool() -> dict[str, Any]:
    """The ``answer`` tool: the reply that carries no tool call."""
    return {"name": REPLY_TOOL,
            "description": "Reply without calling a tool: 'text' is your whole message, such "
            "as the final answer in the form the task asks for. It takes a turn, like any "
            "reply, and ends the episode when the env accepts it as an answer.",
            "inputSchema": {"type": "object",
                            "properties": {"text": {"type": "string",
                                                    "description": "your message"}},
                            "required": ["text"], "additionalProperties": False}}


def mcp_tools(env_tools: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """An env's tools (OpenAI function schemas) as MCP ``tools/list`` entries, and
    ``answer``. An env tool named ``answer`` would make a call ambiguous, so it is an
    error rather than a silent choice."""
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "inputSchema": t["function"]["parameters"]} for t in env_tools]
    if any(tool["name"] == REPLY_TOOL for tool in tools):
        raise RpcError(INTERNAL_ERROR, f"the env declares a tool named {REPLY_TOOL!r}, which "
                       "MCP here keeps for the reply without a tool call")
    return [*tools, reply_tool()]


def tool_action(name: Any, arguments: Any, env_tools: tuple[dict[str, Any], ...]) -> str:
    """The reply text that calls tool ``name``: what the env steps with. Only the form is
    checked here; the env's parser judges the arguments, as it would a model's."""
    if not isinstance(name, str) or not name:
        raise RpcError(INVALID_PARAMS, "tools/call needs 'name', a tool from tools/list")
    if not isinstance(arguments, Mapping):
        raise RpcError(INVALID_PARAMS, "tools/call 'arguments' must be an object")
    if name == REPLY_TOOL:
        text = arguments.get("text")
        if set(arguments) != {"text"} or not isinstance(text, str):
            raise RpcError(INVALID_PARAMS, f"{REPLY_TOOL!r} takes one argument, 'text', a "
                           "string")
        return text
    known = [tool["function"]["name"] for tool in env_tools]
    if name not in known:
        raise UnknownTool(INVALID_PARAMS, f"unknown tool {name!r}; the tools are "
                          f"{[*known, REPLY_TOOL]}")
    return format_tool_call(name, arguments)


def tool_result(payload: dict[str, Any]) -> dict[str, Any]:
    """A step's payload as MCP's ``CallToolResult``: the observation text as content, the
    payload (reward, done, info) as structured content, and as ``data``, which OpenEnv's
    client returns from ``call_tool``. A reply the env refused is a tool error."""
    observation = payload["observation"]
    return {"content": [{"type": "text", "text": observation["text"]}],
            "structuredContent": payload, "data": payload,
            "isError": bool(observation["info"].get("invalid", False))}


async def call_tool(pool: SessionPool, session: Session, params: Mapping[str, Any]
                    ) -> dict[str, Any]:
    """One env step through tool ``params["name"]``; its ``CallToolResult``."""
    catalogue = await pool.catalogue()
    text = tool_action(params.get("name"), params.get("arguments", {}), catalogue.tools)
    return tool_result(await pool.step(session, {"text": text}))


async def rpc_reply(pool: SessionPool, request: Any, session: Session | None = None
                    ) -> dict[str, Any] | None:
    """The JSON-RPC response to ``request``; None for a notification, which gets none.
    ``session`` is the WebSocket's own; over HTTP a call names one in ``session_id``."""
    if not isinstance(request, dict) or request.get("jsonrpc") != "2.0" or \
            not isinstance(request.get("method"), str):
        request_id = request.get("id") if isinstance(request, dict) else None
        return rpc_error(request_id, INVALID_REQUEST,
                         "Invalid Request: expected a JSON-RPC 2.0 request with a 'method'")
    if "id" not in request:
        return None
    request_id = request["id"]
    try:
        params = request.get("params", {})
        if not isinstance(params, dict):
            raise RpcError(INVALID_PARAMS, "params must be an object")
        result = await _dispatch(pool, request["method"], params, session)
    except RpcError as exc:
        return rpc_error(request_id, exc.code, str(exc), exc.data)
    except ProtocolError as exc:  # a session's refusal: its wire code goes in the data
        code = INVALID_PARAMS if exc.code == VALIDATION_ERROR else SERVER_ERROR
        return rpc_error(request_id, code, str(exc), {"code": exc.code, **exc.extra})
    except Exception as exc:  # an env bug ends the call, not the server
        log.exception("MCP %s failed", request["method"])
        return rpc_error(request_id, INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")
    return {"jsonrpc": "2.0", "id": request_id, "result": result}


async def _dispatch(pool: SessionPool, method: str, params: dict[str, Any],
                    session: Session | None) -> Any:
    if method == "initialize":
        return initialize_result(pool, params)
    if method == "ping":
        return {}
    if method == "tools/list":
        return {"tools": mcp_tools((await pool.catalogue()).tools)}
    if method == "openenv/session/create":
        return {"session_id": (session or await pool.open()).session_id}
    if method == "openenv/session/close":
        target = pool.get(params.get("session_id"))
        if target is session:
            raise RpcError(INVALID_REQUEST, "this WebSocket's own session closes with it")
        await pool.close(target)
        return {"session_id": target.session_id, "closed": True}
    if method == "tools/call":
        return await call_tool(pool, _session(pool, params, session), params)
    if method == "agent_gym/reset":
        data = {key: value for key, value in params.items() if key != "session_id"}
        return await pool.reset(_session(pool, params, session), data)
    raise RpcError(METHOD_NOT_FOUND, f"Method not found: {method}; served: initialize, ping, "
                   "tools/list, tools/call, openenv/session/create, openenv/session/close, "
                   "agent_gym/reset")


def _session(pool: SessionPool, params: Mapping[str, Any], session: Session | None
             ) -> Session:
    """The WebSocket's session, or the one an HTTP call names."""
    if session is not None:
        return session
    if "session_id" not in params:
        raise RpcError(INVALID_PARAMS, "over HTTP, name the session: 'session_id' from "
                       "openenv/session/create (or /reset's observation.session_id)")
    return pool.get(params["session_id"])


def initialize_result(pool: SessionPool, params: Mapping[str, Any]) -> dict[str, Any]:
    """MCP's handshake: the protocol revision, that tools are served, and how a session's
    episode starts."""
    asked = params.get("protocolVersion")
    return {
        "protocolVersion": asked if asked in MCP_PROTOCOL_VERSIONS else MCP_PROTOCOL_VERSIONS[-1],
        "capabilities": {"tools": {"listChanged": False}},
        "serverInfo": {"name": f"agent-gym {pool.config.env_id}", "version": server_version()},
        "instructions": f"Each session is one {pool.config.env_id} episode at a time: start "
        "one with agent_gym/reset (or a reset frame on /ws), then call the tools; "
        f"'{REPLY_TOOL}' replies without a tool call.",
    }


async def step_action(pool: SessionPool, session: Session, action: Mapping[str, Any]
                      ) -> dict[str, Any]:
    """OpenEnv ``MCPToolClient``'s step actions on ``/ws``, answered as its client parses
    them: ``list_tools`` with the tools, ``call_tool`` with the step's reward and done and
    the tool's result (or a tool error, which that client raises)."""
    if action.get("type") == "list_tools":
        tools = mcp_tools((await pool.catalogue()).tools)
        return {"observation": {"tools": tools}, "reward": None, "done": False}
    name = action.get("tool_name")
    try:
        result = await call_tool(pool, session, {"name": name,
                                                 "arguments": action.get("arguments", {})})
    except RpcError as exc:
        kind = "tool_not_found" if isinstance(exc, UnknownTool) else "invalid_args"
        return {"observation": {"tool_name": name, "result": None,
                                "error": {"error_type": kind, "message": str(exc)}},
                "reward": None, "done": False}
    payload = result["data"]
    return {"observation": {"tool_name": name, "result": result, "error": None},
            "reward": payload["reward"], "done": payload["done"]}


def is_mcp_action(data: Any) -> bool:
    return isinstance(data, dict) and data.get("type") in MCP_ACTION_TYPES


def rpc_error(request_id: Any, code: int, message: str, data: Any = None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": "2.0", "id": request_id, "error": error}
