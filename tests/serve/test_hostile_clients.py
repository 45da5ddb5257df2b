"""`agent-gym serve` against careless or hostile clients: lone surrogates, deeply nested
JSON, a slow step beside other requests, bearer tokens that are not ASCII, the API's docs,
and a server started where others can reach it. In process, through the ASGI app."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import sys
import threading
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from starlette.testclient import TestClient

from agent_gym.cli.main import main
from agent_gym.serve.app import create_app
from agent_gym.serve.sessions import ServerConfig
from agent_gym.serve.wire import dumps

GSM8K = ServerConfig("agent_gym/GSM8K-v0", {"max_turns": 3})
DEEP = "[" * 100_000 + "]" * 100_000  # far past Python's recursion limit


def test_replies_holding_a_lone_surrogate_encode_and_read_back_the_same() -> None:
    reply = {"text": "a \ud800 b", "info": {"message": "é ok"}}
    text = dumps(reply)
    text.encode("utf-8")  # what every transport does with it
    assert json.loads(text) == reply
    assert dumps({"text": "é"}) == '{"text": "é"}'  # other text stays as it is


# ------------------------------------------------------------------ the event loop
def test_a_slow_step_runs_off_the_event_loop_so_health_answers_meanwhile() -> None:
    """Quick steps first (which used to move a session onto the event loop), then one
    that blocks until released: /health answers while it is in progress."""
    config = ServerConfig("agent_gym/Search-v0", {"max_turns": 20})

    async def scenario() -> None:
        app = create_app(config)
        pool = app.state.pool
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://serve") as http:
                opened = await http.post("/reset", json={"index": 0})
                session_id = opened.json()["observation"]["session_id"]
                env = pool.sessions[session_id].env.unwrapped
                real_step, threads = env.step, []
                entered, release = threading.Event(), threading.Event()

                def step(text: str) -> Any:
                    threads.append(threading.get_ident())
                    if text == "slow":
                        entered.set()
                        release.wait(timeout=10)  # bounded, so the old code fails, not hangs
                    return real_step(text)

                env.step = step  # type: ignore[method-assign]

                async def play(text: str) -> httpx.Response:
                    return await http.post("/step", json={"session_id": session_id,
                                                          "action": {"text": text}})

                for _ in range(5):
                    assert (await play("thinking")).status_code == 200
                slow = asyncio.create_task(play("slow"))
                assert await asyncio.to_thread(entered.wait, 10)
                health = await http.get("/health")
                assert health.json() == {"status": "healthy"}
                assert not slow.done(), "the slow step ended before /health was answered"
                release.set()
                assert (await slow).status_code == 200
                assert threading.get_ident() not in threads
        finally:
            await pool.shutdown()

    asyncio.run(scenario())


def test_a_large_request_is_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checking a body of megabytes (a long state to restore) takes tens of milliseconds,
    which on the event loop would hold up every other client."""
    from agent_gym.serve import replies as served

    real_parse, parsed_where = served.parse, {}

    def parse(text: str | bytes) -> Any:
        parsed_where[len(text)] = threading.get_ident()
        return real_parse(text)

    monkeypatch.setattr(served, "parse", parse)

    async def scenario() -> None:
        app = create_app(GSM8K)
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://serve") as http:
                small = b'{"index": 0}'
                large = small[:-1] + b" " * served.INLINE_PARSE_BYTES + b"}"
                for body in (small, large):
                    assert (await http.post("/reset", content=body)).status_code == 200
        finally:
            await app.state.pool.shutdown()
        assert parsed_where[len(small)] == threading.get_ident()
        assert parsed_where[len(large)] != threading.get_ident()

    asyncio.run(scenario())


# ------------------------------------------------------------------ nested JSON
def test_deeply_nested_json_is_refused_as_invalid_json_and_the_session_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    nested_state = json.dumps({"state": {"env_id": "agent_gym/GSM8K-v0",
                                         "env_kwargs": json.loads("[" * 70 + "]" * 70)}})
    with TestClient(create_app(GSM8K)) as client, caplog.at_level(logging.ERROR):
        for path in ("/reset", "/step"):
            for body in (DEEP, nested_state):
                reply = client.post(path, content=body)
                assert reply.status_code == 400, (path, reply.text)
                assert reply.json()["detail"]["code"] == "INVALID_JSON"
                assert "nested deeper" in reply.json()["detail"]["message"]
        rpc = client.post("/mcp", content=DEEP).json()
        assert rpc["error"]["code"] == -32700 and "nested deeper" in rpc["error"]["message"]
        with client.websocket_connect("/ws") as ws:
            ws.send_text(DEEP)
            assert ws.receive_json()["data"]["code"] == "INVALID_JSON"
            ws.send_json({"type": "reset", "data": {"index": 0}})
            assert ws.receive_json()["type"] == "observation"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# ------------------------------------------------------------------ tokens and docs
TOKEN = "s3cret-jeton-\u00e9"  # a token may be any text; the header carries its UTF-8


def bearer(token: str | bytes) -> dict[str, bytes]:
    raw = token if isinstance(token, bytes) else token.encode("utf-8")
    return {"authorization": b"Bearer " + raw}


def test_with_a_token_every_route_but_health_needs_it_the_docs_included() -> None:
    with TestClient(create_app(ServerConfig("agent_gym/GSM8K-v0", token=TOKEN))) as client:
        for path in ("/docs", "/redoc", "/openapi.json", "/metadata", "/schema"):
            refused = client.get(path)
            assert refused.status_code == 401, path
            assert refused.json()["detail"]["code"] == "UNAUTHORIZED"
            assert refused.headers["www-authenticate"] == "Bearer"
            assert client.get(path, headers=bearer(TOKEN)).status_code == 200, path
        assert client.get("/health").status_code == 200
    with TestClient(create_app(GSM8K)) as client:  # no token: the docs are open
        assert client.get("/openapi.json").status_code == 200


@pytest.mark.parametrize("given", ["\u00e9t\u00e9", "\u2603" * 3, "s3cret-jeton-e"])
def test_a_wrong_bearer_token_is_unauthorized_whatever_its_characters(
    given: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Non-ASCII ones used to be a 500 with a logged traceback (HTTP) or a dropped
    WebSocket; a latin-1 header byte is a wrong token too."""
    with TestClient(create_app(ServerConfig("agent_gym/GSM8K-v0", token=TOKEN))) as client, \
            caplog.at_level(logging.ERROR):
        for headers in (bearer(given), bearer(given.encode("utf-8").decode("latin-1")),
                        {"authorization": b"Bearer \xff\xfe"}):
            for reply in (client.post("/reset", json={}, headers=headers),
                          client.post("/mcp", json={}, headers=headers)):
                assert reply.status_code == 401, reply.text
                assert reply.json()["detail"]["code"] == "UNAUTHORIZED"
            with client.websocket_connect("/ws", headers=headers) as ws:
                assert ws.receive_json()["data"]["code"] == "UNAUTHORIZED"
        with client.websocket_connect("/ws", headers=bearer(TOKEN)) as ws:
            ws.send_json({"type": "reset", "data": {"index": 0}})
            assert ws.receive_json()["type"] == "observation"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_the_token_is_also_taken_as_the_password_of_http_basic() -> None:
    """What `requests` sends from a netrc file (so `openenv validate --url` reaches a
    tokened server): any user name, the token as password; a wrong or garbled one is 401."""
    def basic(credentials: bytes) -> dict[str, bytes]:
        return {"authorization": b"Basic " + base64.b64encode(credentials)}

    with TestClient(create_app(ServerConfig("agent_gym/GSM8K-v0", token=TOKEN))) as client:
        assert client.get("/metadata", headers=basic(b"anyone:" + TOKEN.encode())).is_success
        for headers in (basic(b"anyone:guess"), basic(TOKEN.encode()),
                        {"authorization": b"Basic not*base64"},
                        {"authorization": b"Digest " + TOKEN.encode()}):
            assert client.get("/metadata", headers=headers).status_code == 401, headers


# ------------------------------------------------------------------ exposure
@pytest.fixture()
def uvicorn_runs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Where `serve` would have listened, without listening (nor touching this process's
    GIL switch interval)."""
    import uvicorn

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: calls.append(kwargs))
    monkeypatch.setattr(sys, "setswitchinterval", lambda seconds: None)
    return calls


def test_serve_refuses_a_reachable_host_without_a_token_in_one_line(
    uvicorn_runs: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    for host in ("0.0.0.0", "::", "192.168.1.5", "myhost.example"):
        assert main(["serve", "agent_gym/GSM8K-v0", "--host", host]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("agent-gym serve: error: --host"), lines
        assert "--token-env" in lines[0] and "--allow-unauthenticated" in lines[0]
    assert uvicorn_runs == []


def test_serve_listens_beyond_loopback_with_a_token_or_when_told_loudly(
    uvicorn_runs: list[dict[str, Any]], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for host in ("127.0.0.1", "localhost", "::1"):
        assert main(["serve", "agent_gym/GSM8K-v0", "--host", host]) == 0
        assert "WARNING" not in capsys.readouterr().err
    monkeypatch.setenv("SERVE_TEST_TOKEN", "t0ken")
    assert main(["serve", "agent_gym/GSM8K-v0", "--host", "0.0.0.0",
                 "--token-env", "SERVE_TEST_TOKEN"]) == 0
    assert "WARNING" not in capsys.readouterr().err
    assert main(["serve", "agent_gym/GSM8K-v0", "--host", "0.0.0.0",
                 "--allow-unauthenticated"]) == 0
    assert "WARNING: listening on 0.0.0.0 with no token" in capsys.readouterr().err
    assert [call["host"] for call in uvicorn_runs] == [
        "127.0.0.1", "localhost", "::1", "0.0.0.0", "0.0.0.0"]
    monkeypatch.delenv("SERVE_TEST_TOKEN")
    assert main(["serve", "agent_gym/GSM8K-v0", "--token-env", "SERVE_TEST_TOKEN"]) == 2
    assert capsys.readouterr().err.strip() == (
        "agent-gym serve: error: --token-env SERVE_TEST_TOKEN is not set")
