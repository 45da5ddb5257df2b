"""What never reaches a policy through `agent-gym serve` (the env's privileged info), how a
critic asks for it, and a session stepped before any reset. In process, through the ASGI
app; OpenEnv's client and Remote-v0 drive real servers in test_app.py and test_remote.py."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from starlette.testclient import TestClient

from agent_gym.cli.main import main
from agent_gym.serve.app import create_app
from agent_gym.serve.sessions import ServerConfig

CRITIC = "critic-s3cret"
POLICY = "policy-t0ken"
GSM8K: dict[str, Any] = {"env_id": "agent_gym/GSM8K-v0", "env_kwargs": {"max_turns": 2}}


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def test_no_observation_holds_privileged_info_and_only_the_critic_token_gets_it() -> None:
    with TestClient(create_app(ServerConfig(**GSM8K, critic_token=CRITIC))) as client:
        reset = client.post("/reset", json={"index": 0}).json()
        session_id = reset["observation"]["session_id"]
        assert "privileged" not in reset["observation"]["info"]
        asked = client.post("/privileged", json={"session_id": session_id,
                                                 "critic_token": CRITIC})
        assert asked.status_code == 200, asked.text
        oracle = asked.json()["privileged"]["oracle_actions"]
        assert oracle == ["The answer is \\boxed{31}."]
        assert oracle[0] not in str(reset)
        for wrong in ({}, {"critic_token": "critic-s3cre"}, {"critic_token": 1},
                      {"critic_token": "\ud800"}):
            # As JSON's escapes: a lone surrogate has no UTF-8 to send it as.
            refused = client.post("/privileged",
                                  content=json.dumps({"session_id": session_id, **wrong}))
            assert refused.status_code == 403, wrong
            assert refused.json()["detail"]["code"] == "UNAUTHORIZED"
        step = client.post("/step", json={"session_id": session_id,
                                          "action": {"text": "thinking"}}).json()
        assert "privileged" not in step["observation"]["info"]
        tools = client.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        assert "privileged" not in tools.text

        with client.websocket_connect("/ws") as ws:
            ws.send_json({"type": "reset", "data": {"index": 0}})
            observation = ws.receive_json()
            assert observation["type"] == "observation"
            assert "privileged" not in observation["data"]["observation"]["info"]
            ws.send_json({"type": "privileged", "data": {"critic_token": "guess"}})
            assert ws.receive_json()["data"]["code"] == "UNAUTHORIZED"
            ws.send_json({"type": "privileged", "data": {"critic_token": CRITIC}})
            assert ws.receive_json() == {"type": "privileged",
                                         "data": {"privileged": asked.json()["privileged"]}}
            ws.send_json({"type": "step", "data": {"text": "thinking"}})
            assert "privileged" not in ws.receive_json()["data"]["observation"]["info"]


def test_a_server_without_a_critic_token_gives_privileged_info_to_no_one() -> None:
    with TestClient(create_app(ServerConfig(**GSM8K))) as client:
        session_id = client.post("/reset", json={}).json()["observation"]["session_id"]
        for token in (None, "", "anything"):
            refused = client.post("/privileged", json={"session_id": session_id,
                                                       "critic_token": token})
            assert refused.status_code == 403
            assert "--critic-token-env" in refused.json()["detail"]["message"]
        with client.websocket_connect("/ws") as ws:
            ws.send_json({"type": "reset", "data": {}})
            ws.receive_json()
            ws.send_json({"type": "privileged", "data": {"critic_token": ""}})
            assert "--critic-token-env" in ws.receive_json()["data"]["message"]


def test_a_critic_needs_the_policy_token_too_and_the_critic_token_admits_no_one() -> None:
    config = ServerConfig(**GSM8K, token=POLICY, critic_token=CRITIC)
    with TestClient(create_app(config)) as client:
        session_id = client.post("/reset", json={}, headers=bearer(POLICY)
                                 ).json()["observation"]["session_id"]
        ask = {"session_id": session_id, "critic_token": CRITIC}
        for headers in ({}, bearer(CRITIC)):
            assert client.post("/privileged", json=ask, headers=headers).status_code == 401
        assert client.post("/privileged", json=ask, headers=bearer(POLICY)).status_code == 200
    with pytest.raises(ValueError, match="must differ"):
        ServerConfig(**GSM8K, token=POLICY, critic_token=POLICY)


def test_stepping_before_reset_is_refused_cleanly_with_no_traceback_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """It used to reach the env, whose Gymnasium wrapper raised ResetNeeded: logged with
    its traceback as a server failure. A client whose idle session was closed and that
    reconnected (OpenEnv's may) is in just this case, so the message names the timeout."""
    config = ServerConfig(**GSM8K, idle_timeout_s=90.0, critic_token=CRITIC)
    with TestClient(create_app(config)) as client, caplog.at_level(logging.WARNING):
        with client.websocket_connect("/ws") as ws:
            for frame in ({"type": "step", "data": {"text": "hello"}},
                          {"type": "privileged", "data": {"critic_token": CRITIC}}):
                ws.send_json(frame)
                error = ws.receive_json()
                assert error["type"] == "error" and error["data"]["code"] == "EXECUTION_ERROR"
                message = error["data"]["message"]
                assert "send reset first" in message
                assert "90 s" in message and "--idle-timeout" in message
            ws.send_json({"type": "reset", "data": {"index": 0}})
            assert ws.receive_json()["type"] == "observation"
        # Stepping past the end over HTTP: a conflict with the session's state, not a 400.
        session_id = client.post("/reset", json={"index": 0}).json()["observation"]["session_id"]
        for _ in range(2):
            client.post("/step", json={"session_id": session_id, "action": {"text": "x"}})
        over = client.post("/step", json={"session_id": session_id, "action": {"text": "x"}})
        assert over.status_code == 409 and "episode is over" in over.json()["detail"]["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# ------------------------------------------------------------------ the serve command
@pytest.fixture()
def uvicorn_runs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The apps `serve` would have run, without listening."""
    import uvicorn

    apps: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: apps.append(app))
    monkeypatch.setattr(sys, "setswitchinterval", lambda seconds: None)
    return apps


def test_serve_takes_the_critic_token_from_the_environment_and_refuses_bad_ones_in_one_line(
    uvicorn_runs: list[Any], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SERVE_TEST_CRITIC", CRITIC)
    monkeypatch.setenv("SERVE_TEST_POLICY", POLICY)
    assert main(["serve", "agent_gym/GSM8K-v0", "--critic-token-env", "SERVE_TEST_CRITIC"]) == 0
    assert uvicorn_runs[0].state.pool.config.critic_token == CRITIC
    capsys.readouterr()
    for argv, words in (
        (["--critic-token-env", "SERVE_TEST_UNSET"], "--critic-token-env SERVE_TEST_UNSET is "
                                                     "not set"),
        (["--token-env", "SERVE_TEST_POLICY", "--critic-token-env", "SERVE_TEST_POLICY"],
         "must differ"),
        (["--max-sessions", "0"], "max_sessions must be at least 1"),
        (["--idle-timeout", "nan"], "positive finite number"),  # the reaper would never wake
        (["--idle-timeout", "inf"], "positive finite number"),
    ):
        assert main(["serve", "agent_gym/GSM8K-v0", *argv]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], lines
    assert len(uvicorn_runs) == 1


def test_a_critic_beside_a_websocket_client_names_its_session_from_public_replies() -> None:
    """The session id a critic's `POST /privileged` needs: in every session's `state`
    reply, and in the reset observation of a session opened over HTTP that a WebSocket
    attached to (how openenv 0.4.2+'s MCP client plays). `agent_gym.serve.critic` asks with
    it over plain HTTP, while the client's connection goes on."""
    from websockets.sync.client import connect

    from agent_gym.serve.critic import privileged, privileged_sync
    from agent_gym.serve.remote import RemoteEnvError
    from tests.helpers.serve_process import frame, running_server

    with running_server("agent_gym/GSM8K-v0", "--critic-token-env", "AGENT_GYM_TEST_CRITIC",
                        env={"AGENT_GYM_TEST_CRITIC": CRITIC}) as url:
        ws_url = url.replace("http", "ws") + "/ws"
        with connect(ws_url) as ws:
            ws.send(frame("reset", {"index": 0}))
            assert "session_id" not in json.loads(ws.recv())["data"]["observation"]
            ws.send(frame("state"))
            session = json.loads(ws.recv())["data"]["session_id"]
            answers = privileged_sync(url, session, CRITIC)
            assert answers["oracle_actions"] == ["The answer is \\boxed{31}."]
            with pytest.raises(RemoteEnvError, match="critic token") as refused:
                privileged_sync(url.replace("http", "ws"), session, "guess")
            assert refused.value.code == "UNAUTHORIZED"
            ws.send(frame("step", {"text": answers["oracle_actions"][0]}))
            assert json.loads(ws.recv())["data"]["reward"] == 1.0
        with pytest.raises(RemoteEnvError) as gone:
            privileged_sync(url, session, CRITIC)
        assert gone.value.code == "SESSION_ERROR"

        opened = httpx.post(f"{url}/mcp", json={"jsonrpc": "2.0", "id": 1,
                                                "method": "openenv/session/create"})
        session = opened.json()["result"]["session_id"]
        with connect(f"{ws_url}?session_id={session}") as ws:
            ws.send(frame("reset", {"index": 1}))
            assert json.loads(ws.recv())["data"]["observation"]["session_id"] == session
            assert asyncio.run(privileged(url, session, CRITIC))["oracle_actions"]
