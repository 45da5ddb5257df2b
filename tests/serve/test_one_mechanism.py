"""The server and the in-process OpenEnv `Environment` share one set of episode calls and
one task list (`serve.sessions.Episode`, `TaskList`): whatever the server refuses, the
in-process env refuses in the very same words. And `/ws` and `/mcp` share one WebSocket
lifecycle (`app.hold_session`): a session a WebSocket opened closes with it, even while
another WebSocket is attached to it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("openenv")
pytest.importorskip("fastapi")

from starlette.testclient import TestClient

from agent_gym.adapters.openenv import AgentGymAction, AgentGymEnvironment
from agent_gym.serve.app import create_app
from agent_gym.serve.sessions import ServerConfig

GSM8K = "agent_gym/GSM8K-v0"


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    # No idle timeout: the server's "reset first" then says nothing about reaping.
    with TestClient(create_app(ServerConfig(GSM8K, idle_timeout_s=None))) as test_client:
        yield test_client


def over_ws(*frames: tuple[str, Any]) -> Callable[[TestClient], str]:
    """The server's refusal of the last of ``frames`` on one /ws session."""

    def send(client: TestClient) -> str:
        with client.websocket_connect("/ws") as ws:
            for kind, data in frames:
                ws.send_json({"type": kind, "data": data})
                reply = ws.receive_json()
        assert reply["type"] == "error", reply
        return reply["data"]["message"]

    return send


def over_http(path: str, body: dict[str, Any]) -> Callable[[TestClient], str]:
    def send(client: TestClient) -> str:
        reply = client.post(path, json=body)
        assert reply.status_code == 400, reply.text
        return reply.json()["detail"]["message"]

    return send


def started(env: AgentGymEnvironment) -> AgentGymEnvironment:
    env.reset(index=0)
    return env


RESET = ("reset", {"index": 0})
CASES: dict[str, tuple[Callable[[AgentGymEnvironment], Any], Callable[[TestClient], str],
                       type[Exception]]] = {
    "step before any reset": (lambda env: env.step(AgentGymAction(text="hi")),
                              over_ws(("step", {"text": "hi"})), ValueError),
    "text not a string": (lambda env: started(env).step({"text": 5}),
                          over_ws(RESET, ("step", {"text": 5})), ValueError),
    "unknown action field": (lambda env: started(env).step({"text": "x", "tool": "y"}),
                             over_ws(RESET, ("step", {"text": "x", "tool": "y"})), ValueError),
    "split not served on reset": (lambda env: env.reset(split="test", index=0),
                                  over_ws(("reset", {"split": "test", "index": 0})),
                                  ValueError),
    "split not served in the task API": (
        lambda env: env.num_tasks("train"),
        over_http("/GSM8K-v0/num_tasks", {"split": "train"}), ValueError),
    "task index out of range": (lambda env: env.get_task("all", 54),
                                over_http("/GSM8K-v0/task", {"split": "all", "index": 54}),
                                IndexError),
    "range bound not a number": (
        lambda env: env.get_task_range("all", "1"),
        over_http("/GSM8K-v0/task_range", {"split": "all", "start": "1"}), ValueError),
}


@pytest.mark.parametrize("case", list(CASES))
def test_in_process_env_refuses_as_the_server_does(client: TestClient, case: str) -> None:
    in_process, served, kind = CASES[case]
    env = AgentGymEnvironment(GSM8K)
    try:
        with pytest.raises(kind) as refusal:
            in_process(env)
    finally:
        env.close()
    assert str(refusal.value) == served(client)


@pytest.mark.parametrize(("path", "create"), [
    ("/ws", lambda rpc: {"type": "mcp", "data": rpc}),
    ("/mcp", lambda rpc: rpc),
])
def test_a_websockets_own_session_closes_with_it_while_another_is_attached(
    client: TestClient, path: str, create: Callable[[dict[str, Any]], dict[str, Any]]
) -> None:
    with contextlib.ExitStack() as opener_lifetime:
        opener = opener_lifetime.enter_context(client.websocket_connect(path))
        opener.send_json(create({"jsonrpc": "2.0", "id": 1,
                                 "method": "openenv/session/create"}))
        reply = opener.receive_json()
        session_id = (reply.get("data") or reply)["result"]["session_id"]
        with client.websocket_connect(f"/ws?session_id={session_id}") as attached:
            opener_lifetime.close()  # the WebSocket that opened the session goes
            attached.send_json({"type": "reset", "data": {"index": 0}})
            refused = attached.receive_json()
            assert refused["type"] == "error"
            assert refused["data"]["code"] == "SESSION_ERROR"
            assert "unknown" in refused["data"]["message"]
