"""`agent-gym serve` driven by the published OpenEnv client (the `openenv` package) over WebSocket and
by OpenEnv's own HTTP validator and request/response models over HTTP, for all four envs."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx
import pytest

openenv = pytest.importorskip("openenv")
pytest.importorskip("fastapi")

from openenv import GenericEnvClient  # noqa: E402
from openenv.cli._validation import validate_running_environment  # noqa: E402
from openenv.core.env_server.types import (  # noqa: E402
    EnvironmentMetadata,
    HealthResponse,
    ResetResponse,
    SchemaResponse,
    State,
    StepResponse,
)
from websockets.asyncio.client import connect  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402

from agent_gym.cli.main import build_parser  # noqa: E402
from tests.helpers.serve_process import frame, running_server  # noqa: E402

CRITIC = "critic-s3cret"  # the critic token of every server here but the idle one
WITH_CRITIC: dict[str, Any] = {"env": {"AGENT_GYM_TEST_CRITIC": CRITIC}}
CRITIC_FLAG = ("--critic-token-env", "AGENT_GYM_TEST_CRITIC")

ENVS: dict[str, tuple[str, ...]] = {
    "agent_gym/GSM8K-v0": ("--env-arg", "max_turns=2"),
    "agent_gym/CodeInterpreter-v0": ("--env-arg", "max_turns=4"),
    "agent_gym/Search-v0": ("--env-arg", "max_turns=5"),
    "agent_gym/ALFWorld-v0": ("--env-arg", "max_turns=12"),
}


@pytest.fixture(scope="module", params=list(ENVS))
def server(request: pytest.FixtureRequest) -> Any:
    with running_server(request.param, *ENVS[request.param], *CRITIC_FLAG, **WITH_CRITIC) as url:
        yield request.param, url


async def critic_privileged(url: str, reset: dict[str, Any]) -> dict[str, Any]:
    """What a critic gets: its own session on the same task, asking with the token."""
    async with connect(url.replace("http", "ws") + "/ws") as ws:
        await ws.send(frame("reset", reset))
        assert json.loads(await ws.recv())["type"] == "observation"
        await ws.send(frame("privileged", {"critic_token": CRITIC}))
        reply = json.loads(await ws.recv())
        assert reply["type"] == "privileged", reply
        return reply["data"]["privileged"]


def assert_withheld(reply: Any, privileged: dict[str, Any], played: int = 0) -> None:
    """No ``privileged`` key anywhere in ``reply``, and no oracle action in any of its text
    but the ``played`` first ones, which the client sent (a restore's history has them)."""
    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            assert "privileged" not in value, value.keys()
            for item in value.values():
                yield from walk(item)
        elif isinstance(value, list):
            for item in value:
                yield from walk(item)
        elif isinstance(value, str):
            yield value

    texts = list(walk(reply))
    assert privileged["oracle_actions"]
    for action in privileged["oracle_actions"][played:]:
        assert not [text for text in texts if action in text], action


async def play(url: str, reset: dict[str, Any], actions: list[str]) -> list[tuple]:
    """Reset, then take ``actions``: [(text, reward, done, terminated, truncated), ...]."""
    async with GenericEnvClient(base_url=url) as env:
        result = await env.reset(**reset)
        seen = [(result.observation["text"], result.reward, result.done)]
        for action in actions:
            result = await env.step({"text": action})
            obs = result.observation
            seen.append((obs["text"], result.reward, result.done, obs["terminated"],
                         obs["truncated"]))
            if result.done:
                break
        return seen


def test_openenv_client_plays_restores_and_runs_sessions_concurrently(server: Any) -> None:
    env_id, url = server

    async def scenario() -> None:
        async with GenericEnvClient(base_url=url) as env:
            first = await env.reset(index=0, episode_id="ep-1")
            assert not first.done and first.reward is None
            info = first.observation["info"]
            assert info["task_id"] and info["messages"][0]["role"] == "system"
            privileged = await critic_privileged(url, {"index": 0})
            oracle = privileged["oracle_actions"]
            assert_withheld(first.observation, privileged)
            # One step, then save the mid-episode state through the `state` message.
            after_one = await env.step({"text": oracle[0]})
            assert_withheld(after_one.observation, privileged)
            state = await env.state()
            assert state["episode_id"] == "ep-1" and state["step_count"] == 1
            assert State.model_validate(state).step_count == 1
            assert state["env_state"]["env_id"] == env_id
            assert len(state["env_state"]["actions"]) == 1
            rest = []
            result = after_one
            for action in oracle[1:]:
                if result.done:
                    break
                result = await env.step({"text": action})
                rest.append((result.observation["text"], result.reward, result.done))
            assert result.done and result.reward and result.reward > 0, "the oracle wins"
            # The episode is over: another step is refused with an error frame, not a crash.
            with pytest.raises(RuntimeError, match="EXECUTION_ERROR"):
                await env.step({"text": oracle[-1]})

        # A new session restored from the mid-episode state continues identically.
        async with GenericEnvClient(base_url=url) as branch:
            restored = await branch.reset(state=state["env_state"])
            assert restored.observation["text"] == after_one.observation["text"]
            assert restored.observation["info"]["turn"] == 1
            assert restored.observation["info"]["restored_depth"] == 1
            assert_withheld(restored.observation, privileged, played=1)
            again = []
            for action in oracle[1 : 1 + len(rest)]:
                result = await branch.step({"text": action})
                again.append((result.observation["text"], result.reward, result.done))
            assert again == rest

        # Concurrent sessions on different tasks do not see each other's episodes.
        tasks = range(3)
        results = await asyncio.gather(*(play(url, {"index": i}, []) for i in tasks))
        singles = [await play(url, {"index": i}, []) for i in tasks]
        assert results == singles
        assert len({r[0][0] for r in results}) == 3

    asyncio.run(scenario())


def test_http_endpoints_match_openenv_models(server: Any) -> None:
    env_id, url = server
    report = validate_running_environment(url)
    assert report["passed"], json.dumps(report["criteria"], indent=1)
    with httpx.Client(base_url=url, timeout=60) as http:
        SchemaResponse.model_validate(http.get("/schema").json())
        HealthResponse.model_validate(http.get("/health").json())
        meta = EnvironmentMetadata.model_validate(http.get("/metadata").json())
        assert meta.name == env_id
        reset = http.post("/reset", json={"seed": 1})
        assert reset.status_code == 200
        body = reset.json()
        session_id = body["observation"]["session_id"]
        ResetResponse.model_validate(body)
        # Only an explicit request with the critic token gets the answers.
        for refused in ({"session_id": session_id},
                        {"session_id": session_id, "critic_token": "guess"}):
            denied = http.post("/privileged", json=refused)
            assert denied.status_code == 403 and denied.json()["detail"]["code"] == "UNAUTHORIZED"
        asked = http.post("/privileged", json={"session_id": session_id, "critic_token": CRITIC})
        assert asked.status_code == 200, asked.text
        privileged = asked.json()["privileged"]
        assert_withheld(body, privileged)
        for action in privileged["oracle_actions"]:
            step = http.post("/step", json={"action": {"text": action}, "session_id": session_id,
                                            "request_id": "r1", "timeout_s": 30.0})
            assert step.status_code == 200, step.text
            StepResponse.model_validate(step.json())
            assert_withheld(step.json(), privileged)
            if step.json()["done"]:
                break
        assert step.json()["done"] and step.json()["reward"] > 0
        state = http.get("/state", params={"session_id": session_id}).json()
        State.model_validate(state)
        assert state["step_count"] == len(state["env_state"]["actions"]) >= 1
        # An HTTP restore into a second session replays to the same observation.
        second = http.post("/reset", json={"state": state["env_state"]}).json()
        assert second["observation"]["text"] == step.json()["observation"]["text"]
        for sid in (session_id, second["observation"]["session_id"]):
            assert http.post("/close", json={"session_id": sid}).status_code == 200
        unknown = http.post("/step", json={"action": {"text": "x"}, "session_id": session_id})
        assert unknown.status_code == 404 and unknown.json()["detail"]["code"] == "SESSION_ERROR"


# ------------------------------------------------------------------ errors and limits
@pytest.fixture(scope="module")
def gsm8k() -> Any:
    with running_server("agent_gym/GSM8K-v0", "--env-arg", "max_turns=2",
                        "--max-request-bytes", "4096", *CRITIC_FLAG, **WITH_CRITIC) as url:
        yield url


def test_malformed_frames_get_error_frames_and_the_session_goes_on(gsm8k: str) -> None:
    async def scenario() -> None:
        async with connect(gsm8k.replace("http", "ws") + "/ws") as ws:
            async def ask(raw: str) -> dict[str, Any]:
                await ws.send(raw)
                return json.loads(await ws.recv())

            cases = {
                "{not json": "INVALID_JSON",
                "[1, 2]": "VALIDATION_ERROR",
                frame("dance"): "UNKNOWN_TYPE",
                frame("step", {"text": "before any reset"}): "EXECUTION_ERROR",
                frame("privileged"): "UNAUTHORIZED",
                frame("privileged", {"critic_token": CRITIC}): "EXECUTION_ERROR",  # no episode
                frame("step", {"txt": "typo"}): "VALIDATION_ERROR",
                frame("step", "not an object"): "VALIDATION_ERROR",
                frame("reset", {"seed": -1}): "VALIDATION_ERROR",
                frame("reset", {"index": 10_000}): "VALIDATION_ERROR",
                frame("reset", {"colour": "red"}): "VALIDATION_ERROR",
                frame("reset", {"state": {"env_id": "x"}}): "STATE_REFUSED",
                frame("step", {"text": "x" * 5000}): "REQUEST_TOO_LARGE",
            }
            for raw, code in cases.items():
                reply = await ask(raw)
                assert reply["type"] == "error", raw
                assert reply["data"]["code"] == code, (raw, reply)
                assert reply["data"]["message"]
            state = await ask(frame("state"))
            assert state["data"].pop("session_id")  # the session's name, for a critic
            assert state == {"type": "state", "data": {
                "episode_id": None, "step_count": 0, "env_state": None, "num_tasks": 54,
                "max_turns": 2}}
            reset = await ask(frame("reset", {"index": 2}))
            assert reset["type"] == "observation" and not reset["data"]["done"]
            step = await ask(frame("step", {"text": "The answer is \\boxed{1}."}))
            assert step["type"] == "observation" and step["data"]["done"], step

    asyncio.run(scenario())
    assert httpx.get(f"{gsm8k}/health").json() == {"status": "healthy"}


def test_http_errors(gsm8k: str) -> None:
    with httpx.Client(base_url=gsm8k) as http:
        too_big = http.post("/reset", content=b"{" + b" " * 5000 + b"}",
                            headers={"content-type": "application/json"})
        assert too_big.status_code == 413
        assert too_big.json()["detail"]["code"] == "REQUEST_TOO_LARGE"
        assert http.post("/reset", content=b"{oops").json()["detail"]["code"] == "INVALID_JSON"
        missing = http.post("/step", json={"action": {"text": "x"}})
        assert missing.status_code == 400
        assert http.get("/state", params={"session_id": "nope"}).status_code == 404
        assert http.post("/mcp", content=b"{bad").json()["error"]["code"] == -32700
        listed = http.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        # GSM8K has no tool of its own: MCP's reply without a tool call is all it offers.
        assert [tool["name"] for tool in listed.json()["result"]["tools"]] == ["answer"]


def test_restore_never_takes_env_settings_from_the_client(gsm8k: str) -> None:
    """A state saved from an env with other settings is refused, whatever it claims."""

    async def scenario() -> None:
        async with GenericEnvClient(base_url=gsm8k) as env:
            await env.reset(index=0)
            await env.step({"text": "thinking"})
            state = (await env.state())["env_state"]
        forged = {**state, "env_kwargs": {**state["env_kwargs"], "max_turns": 50,
                                          "reward_correct": 100.0}}
        other_env = {**state, "env_id": "agent_gym/CodeInterpreter-v0"}
        diverged = {**state, "digests": [state["digests"][0], "0" * 16]}
        async with GenericEnvClient(base_url=gsm8k) as env:
            for bad, words in ((forged, "never takes env settings"),
                               (other_env, "this server hosts"),
                               (diverged, "replay diverged at step 1")):
                with pytest.raises(RuntimeError, match="STATE_REFUSED") as caught:
                    await env.reset(state=bad)
                assert words in str(caught.value)
            # The refusals left the session usable.
            ok = await env.reset(state=state)
            assert ok.observation["info"]["turn"] == 1

    asyncio.run(scenario())


def test_capacity_idle_reaping_and_token() -> None:
    token = "s3cret-token"
    with running_server("agent_gym/GSM8K-v0", "--max-sessions", "2", "--idle-timeout", "0.6",
                        "--token-env", "SERVE_TEST_TOKEN",
                        env={"SERVE_TEST_TOKEN": token}) as url:
        auth = {"Authorization": f"Bearer {token}"}
        ws_url = url.replace("http", "ws") + "/ws"

        async def scenario() -> None:
            async with connect(ws_url) as ws:  # no token
                reply = json.loads(await ws.recv())
                assert reply["data"]["code"] == "UNAUTHORIZED"
            async with connect(ws_url, additional_headers=auth) as one, \
                    connect(ws_url, additional_headers=auth) as two:
                await one.send(frame("reset", {"index": 0}))
                await two.send(frame("reset", {"index": 1}))
                assert json.loads(await one.recv())["type"] == "observation"
                assert json.loads(await two.recv())["type"] == "observation"
                async with connect(ws_url, additional_headers=auth) as three:
                    refused = json.loads(await three.recv())
                    assert refused["data"]["code"] == "CAPACITY_REACHED"
                    assert refused["data"]["max_sessions"] == 2
                # Left idle past the timeout, a session is closed and its client told why.
                await asyncio.sleep(1.5)
                reaped = json.loads(await one.recv())
                assert reaped["data"]["code"] == "SESSION_ERROR"
                assert "idle" in reaped["data"]["message"]
                with pytest.raises(ConnectionClosed):
                    await one.recv()

        asyncio.run(scenario())
        with httpx.Client(base_url=url) as http:
            assert http.post("/reset", json={}).status_code == 401
            assert http.post("/reset", json={}, headers={"Authorization": "Bearer no"}
                             ).status_code == 401
            opened = http.post("/reset", json={"index": 0}, headers=auth)
            assert opened.status_code == 200
            sid = opened.json()["observation"]["session_id"]
            import time

            time.sleep(1.5)
            gone = http.get("/state", params={"session_id": sid}, headers=auth)
            assert gone.status_code == 404 and "idle" in gone.json()["detail"]["message"]


def test_an_idle_session_closed_by_the_server_names_the_timeout_to_openenvs_client() -> None:
    """OpenEnv's client learns that its session is gone when it next sends; what it then
    reports is the close frame's reason (or, a client that reconnects, the new session's
    refusal to step before a reset), and both name the timeout and the setting."""
    with running_server("agent_gym/GSM8K-v0", "--idle-timeout", "0.3") as url:

        async def scenario() -> None:
            async with GenericEnvClient(base_url=url) as env:
                await env.reset(index=0)
                # The client's own connection, closed by the server's reaper.
                await asyncio.wait_for(env._ws.wait_closed(), timeout=60)
                with pytest.raises(Exception) as caught:
                    await env.step({"text": "thinking"})
            assert re.search(r"0\.3 s.*serve --idle-timeout", str(caught.value)), caught.value

        asyncio.run(scenario())


def test_binds_loopback_unless_told(gsm8k: str) -> None:
    args = build_parser().parse_args(["serve", "agent_gym/GSM8K-v0"])
    assert args.host == "127.0.0.1" and args.max_sessions >= 64
    port = int(gsm8k.rsplit(":", 1)[1])
    listening = []
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.split(":")[1], 16) == port:
                listening.append(local.split(":")[0])
    assert listening == ["0100007F"]  # 127.0.0.1, not 0.0.0.0


def test_a_lone_surrogate_in_an_action_plays_and_the_session_stays_usable(gsm8k: str) -> None:
    """JSON's "\\ud800" decodes to a lone surrogate, which has no UTF-8 form: /step used to
    answer 500 after playing it, /state 500 ever after, and a WebSocket session dropped.
    Replies now carry it as JSON's escape, over both transports alike, and a state holding
    it restores."""
    action = "thinking \ud800 out loud"
    with httpx.Client(base_url=gsm8k, timeout=60) as http:
        opened = http.post("/reset", json={"index": 0}).json()
        session_id = opened["observation"]["session_id"]
        # As JSON's escape: the surrogate has no UTF-8 to send it as.
        step = http.post("/step", content=json.dumps({"session_id": session_id,
                                                      "action": {"text": action}}))
        assert step.status_code == 200, step.text
        state = http.get("/state", params={"session_id": session_id})
        assert state.status_code == 200, state.text
        env_state = state.json()["env_state"]
        assert env_state["actions"] == [action]
        restored = http.post("/reset", content=json.dumps({"state": env_state}))
        assert restored.status_code == 200, restored.text
        assert restored.json()["observation"]["text"] == step.json()["observation"]["text"]
        again = http.post("/step", json={"session_id": session_id, "action": {"text": "ok"}})
        assert again.status_code == 200 and again.json()["done"]  # max_turns=2

    async def over_websocket() -> None:
        async with connect(gsm8k.replace("http", "ws") + "/ws") as ws:
            async def ask(kind: str, data: object = None) -> dict[str, Any]:
                await ws.send(frame(kind, data))
                return json.loads(await ws.recv())

            assert (await ask("reset", {"index": 0}))["type"] == "observation"
            played = await ask("step", {"text": action})
            assert played["type"] == "observation", played
            assert played["data"]["observation"]["text"] == step.json()["observation"]["text"]
            saved = await ask("state")
            assert saved["type"] == "state"
            for key in ("actions", "digests"):
                assert saved["data"]["env_state"][key] == env_state[key]
            assert (await ask("reset", {"state": env_state}))["type"] == "observation"
            assert (await ask("step", {"text": "ok"}))["data"]["done"]

    asyncio.run(over_websocket())


def test_serve_says_where_it_listens_and_logs_each_request_when_verbose() -> None:
    import subprocess
    import sys

    from tests.helpers.serve_process import free_port

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "agent_gym.cli", "serve", "agent_gym/GSM8K-v0", "--port",
         str(port), "--verbose"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(300):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert httpx.post(f"http://127.0.0.1:{port}/reset", json={}, timeout=30).status_code == 200
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=30)
    assert f"agent_gym/GSM8K-v0 on http://127.0.0.1:{port}" in output
    assert '"POST /reset HTTP/1.1" 200' in output


def test_serve_without_its_extra_names_it_in_one_line_whatever_the_arguments() -> None:
    import subprocess
    import sys

    for args in (["agent_gym/GSM8K-v0", "--port", "9"], ["--help"]):
        code = ("import sys; sys.modules['fastapi'] = None\n"
                f"from agent_gym.cli.main import main; sys.exit(main(['serve', *{args!r}]))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.strip().splitlines() == [
            "agent-gym serve: error: agent-gym serve needs FastAPI: install the 'serve' extra "
            "(in the agent-gym checkout: pip install -e '.[serve]')"]
