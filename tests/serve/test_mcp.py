"""MCP as OpenEnv speaks it, against real `agent-gym serve` servers: OpenEnv's own
`MCPToolClient` plays a whole episode of each env through the env's tools (on openenv 0.4.1
by `list_tools` / `call_tool` step actions on /ws; from 0.4.2 on the same calls go over
HTTP /mcp to a session its /ws attaches to, so this file runs unchanged on both), and the
JSON-RPC methods, the /ws `mcp` frame and the /mcp WebSocket answer as MCP and OpenEnv
expect. No MCP reply holds privileged info."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

pytest.importorskip("openenv")
pytest.importorskip("fastapi")

from openenv.core.mcp_client import MCPToolClient
from starlette.testclient import TestClient
from websockets.asyncio.client import connect

from agent_gym.actions.tools import ToolSpec, parse_tool_call
from agent_gym.serve.app import create_app
from agent_gym.serve.sessions import ServerConfig
from tests.helpers.serve_process import frame, running_server
from tests.serve.episodes import PRIVILEGED_KEYS, SERVED, TOOLS

CRITIC = "critic-s3cret"


@pytest.fixture(scope="module", params=list(SERVED))
def server(request: pytest.FixtureRequest) -> Any:
    with running_server(request.param, *SERVED[request.param], "--critic-token-env",
                        "AGENT_GYM_TEST_CRITIC", env={"AGENT_GYM_TEST_CRITIC": CRITIC}) as url:
        yield request.param, url


async def oracle_actions(url: str, index: int) -> list[str]:
    """The oracle's replies for task ``index``, as a critic gets them: its own session."""
    async with connect(url.replace("http", "ws") + "/ws") as ws:
        await ws.send(frame("reset", {"index": index}))
        assert json.loads(await ws.recv())["type"] == "observation"
        await ws.send(frame("privileged", {"critic_token": CRITIC}))
        return json.loads(await ws.recv())["data"]["privileged"]["oracle_actions"]


def as_tool_call(reply: str, tools: list[Any]) -> tuple[str, dict[str, Any]]:
    """An oracle reply as the MCP call that writes it: its tool call, or ``answer``."""
    specs = [ToolSpec(t.name, t.description, t.input_schema) for t in tools]
    call = parse_tool_call(reply, specs)
    return ("answer", {"text": reply}) if call is None else (call.name, call.arguments)


def assert_no_privileged(reply: Any) -> None:
    text = json.dumps(reply, default=str)
    for key in PRIVILEGED_KEYS:
        assert f'"{key}"' not in text, key


def test_openenvs_mcp_client_plays_each_env_through_its_tools(server: Any) -> None:
    env_id, url = server

    async def scenario() -> float:
        oracle = await oracle_actions(url, 0)
        async with MCPToolClient(base_url=url) as env:
            opening = await env.reset(index=0)
            assert_no_privileged(opening.observation.model_dump())
            tools = await env.list_tools()
            assert [tool.name for tool in tools] == TOOLS[env_id]
            total, done = 0.0, False
            for reply in oracle:
                name, arguments = as_tool_call(reply, tools)
                result = await env.call_tool(name, **arguments)
                assert_no_privileged(result)
                total += result["reward"]
                done = result["done"]
                if done:
                    break
            assert done
            # A call of a tool the env lacks is the client's tool error, not a dead session.
            with pytest.raises(RuntimeError, match="unknown tool"):
                await env.call_tool("teleport", where="kitchen")
            return total

    assert asyncio.run(scenario()) == 1.0


@pytest.mark.parametrize("server", ["agent_gym/Search-v0"], indirect=True)
def test_http_mcp_session_reset_over_an_attached_websocket(server: Any) -> None:
    """OpenEnv's production path, step by step: a session made over HTTP /mcp, its episode
    reset on a /ws attached to it, the tools called over HTTP, then closed (on one env: the
    client test plays all four)."""
    _, url = server

    def rpc(http: httpx.Client, method: str, **params: Any) -> dict[str, Any]:
        reply = http.post("/mcp", json={"jsonrpc": "2.0", "id": 7, "method": method,
                                        "params": params}).json()
        assert reply["id"] == 7
        return reply

    async def scenario() -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            session_id = rpc(http, "openenv/session/create")["result"]["session_id"]
            ws_url = url.replace("http", "ws") + f"/ws?session_id={session_id}"
            async with connect(ws_url) as ws:
                await ws.send(frame("reset", {"index": 0}))
                opening = json.loads(await ws.recv())
                assert opening["type"] == "observation"
                # One WebSocket at a time: a second is told why and hung up on.
                async with connect(ws_url) as second:
                    refused = json.loads(await second.recv())
                    assert refused["data"]["code"] == "SESSION_ERROR"
                    assert "already has a WebSocket" in refused["data"]["message"]
                found = rpc(http, "tools/call", session_id=session_id, name="search",
                            arguments={"query": "History of Caldmoor"})["result"]
                assert found["isError"] is False and "Caldmoor" in found["content"][0]["text"]
                assert found["data"]["observation"]["info"]["turn"] == 1
                await ws.send(frame("state"))
                assert json.loads(await ws.recv())["data"]["step_count"] == 1
            # The WebSocket went; the session it attached to stays for its opener.
            answered = rpc(http, "tools/call", session_id=session_id, name="answer",
                           arguments={"text": "<answer>970</answer>"})["result"]
            assert answered["data"]["reward"] == 1.0 and answered["data"]["done"]
            closed = rpc(http, "openenv/session/close", session_id=session_id)
            assert closed["result"] == {"session_id": session_id, "closed": True}
            gone = rpc(http, "tools/call", session_id=session_id, name="answer",
                       arguments={"text": "x"})
            assert gone["error"]["data"]["code"] == "SESSION_ERROR"

    asyncio.run(scenario())


# ------------------------------------------------------------------ in process
@pytest.fixture(scope="module")
def search() -> Any:
    config = ServerConfig("agent_gym/Search-v0", {"max_turns": 5})
    with TestClient(create_app(config)) as client:
        yield client


def call(client: TestClient, method: str, request_id: Any = 1, **params: Any) -> Any:
    return client.post("/mcp", json={"jsonrpc": "2.0", "id": request_id, "method": method,
                                     "params": params}).json()


def test_initialize_ping_tools_list_and_notifications(search: TestClient) -> None:
    hello = call(search, "initialize", protocolVersion="2025-03-26",
                 clientInfo={"name": "t", "version": "0"}, capabilities={})["result"]
    assert hello["protocolVersion"] == "2025-03-26"
    assert hello["capabilities"] == {"tools": {"listChanged": False}}
    assert hello["serverInfo"]["name"] == "agent-gym agent_gym/Search-v0"
    assert call(search, "initialize", protocolVersion="1999-01-01")["result"][
        "protocolVersion"] == "2025-06-18"
    assert call(search, "ping", request_id="p")["result"] == {}
    tools = call(search, "tools/list")["result"]["tools"]
    assert [tool["name"] for tool in tools] == ["search", "answer"]
    assert tools[0]["inputSchema"]["required"] == ["query"]
    note = search.post("/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"})
    assert note.status_code == 202 and note.content == b""


def test_rpc_refusals_are_json_rpc_errors(search: TestClient) -> None:
    def error(reply: Any) -> tuple[int, str]:
        return reply["error"]["code"], reply["error"]["message"]

    assert error(search.post("/mcp", content=b"{nope").json())[0] == -32700
    assert error(search.post("/mcp", json=[1, 2]).json())[0] == -32600
    assert error(search.post("/mcp", json={}).json())[0] == -32600  # openenv validate's probe
    assert error(call(search, "resources/list"))[0] == -32601
    assert error(call(search, "tools/call", name="search", arguments={"query": "x"})) == (
        -32602, "over HTTP, name the session: 'session_id' from openenv/session/create (or "
        "/reset's observation.session_id)")
    session_id = call(search, "openenv/session/create")["result"]["session_id"]
    before = call(search, "tools/call", session_id=session_id, name="answer",
                  arguments={"text": "x"})["error"]
    assert before["code"] == -32000 and before["data"]["code"] == "EXECUTION_ERROR"
    assert "send reset first" in before["message"]
    call(search, "agent_gym/reset", session_id=session_id, index=0)
    for name, arguments, why in (
        ("teleport", {}, "unknown tool 'teleport'; the tools are ['search', 'answer']"),
        ("answer", {"text": 3}, "'answer' takes one argument, 'text', a string"),
        ("search", [1], "tools/call 'arguments' must be an object"),
    ):
        assert error(call(search, "tools/call", session_id=session_id, name=name,
                          arguments=arguments)) == (-32602, why)
    # Arguments the schema refuses reach the env, whose parser judges them as a model's.
    judged = call(search, "tools/call", session_id=session_id, name="search",
                  arguments={"q": "Caldmoor"})["result"]
    assert judged["isError"] is True and judged["data"]["observation"]["info"]["invalid"]
    split = call(search, "agent_gym/reset", session_id=session_id, split="test", index=0)
    assert split["error"]["code"] == -32602 and "split 'test' is not served" in \
        split["error"]["message"]


def test_the_ws_mcp_frame_and_the_mcp_websocket_use_the_connections_session(
        search: TestClient) -> None:
    with search.websocket_connect("/ws") as ws:
        ws.send_json({"type": "reset", "data": {"index": 0}})
        assert_no_privileged(ws.receive_json())
        ws.send_json({"type": "mcp", "data": {"jsonrpc": "2.0", "id": 3, "method":
                                              "tools/call", "params": {
                                                  "name": "answer",
                                                  "arguments": {"text": "<answer>970</answer>"}}}})
        reply = ws.receive_json()
        assert reply["type"] == "mcp" and reply["data"]["id"] == 3
        assert reply["data"]["result"]["data"]["reward"] == 1.0
        ws.send_json({"type": "mcp", "data": {"jsonrpc": "2.0", "method": "notifications/x"}})
        ws.send_json({"type": "mcp", "data": {"jsonrpc": "2.0", "id": 4, "method":
                                              "openenv/session/create"}})
        own = ws.receive_json()["data"]["result"]["session_id"]  # no reply to the note
        ws.send_json({"type": "mcp", "data": {"jsonrpc": "2.0", "id": 5, "method":
                                              "openenv/session/close",
                                              "params": {"session_id": own}}})
        assert ws.receive_json()["data"]["error"]["code"] == -32600

    pool = search.app.state.pool
    before = len(pool.sessions)
    with search.websocket_connect("/mcp") as ws:
        ws.send_json({"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        assert [t["name"] for t in ws.receive_json()["result"]["tools"]] == ["search", "answer"]
        ws.send_json({"jsonrpc": "2.0", "id": 2, "method": "agent_gym/reset",
                      "params": {"index": 0}})
        opening = ws.receive_json()["result"]
        assert opening["observation"]["info"]["task_id"] and not opening["done"]
        assert_no_privileged(opening)
        ws.send_json({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {
            "name": "search", "arguments": {"query": "History of Caldmoor"}}})
        found = ws.receive_json()["result"]
        assert_no_privileged(found)
        assert found["data"]["observation"]["info"]["turn"] == 1
        ws.send_text("{not json")
        assert ws.receive_json()["error"]["code"] == -32700
    assert len(pool.sessions) == before  # the connection's session went with it
