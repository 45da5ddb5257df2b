"""`agent_gym.adapters.openenv.AgentGymEnvironment`, the in-process OpenEnv `Environment`:
used directly as NeMo-Gym and SkyRL use one, and served by OpenEnv's own `create_app`,
driven by OpenEnv's own client. Privileged info stays out of every observation."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("openenv")
uvicorn = pytest.importorskip("uvicorn")

from openenv import GenericEnvClient  # noqa: E402
from openenv.core.env_server.http_server import create_app  # noqa: E402
from openenv.core.env_server.interfaces import Environment  # noqa: E402
from openenv.core.env_server.types import Observation, State  # noqa: E402

from agent_gym.adapters.openenv import (  # noqa: E402
    AgentGymAction,
    AgentGymEnvironment,
    AgentGymObservation,
)

GSM8K = "agent_gym/GSM8K-v0"
ANSWER = "The answer is \\boxed{31}."  # task 0's


def no_privileged(observation: Any) -> bool:
    text = json.dumps(observation if isinstance(observation, dict) else
                      observation.model_dump())
    return '"privileged"' not in text and "reference_answer" not in text


def test_in_process_episode_restore_and_critic() -> None:
    env = AgentGymEnvironment(GSM8K, max_turns=2)
    try:
        assert isinstance(env, Environment)
        opening = env.reset(index=0, episode_id="e1")
        assert isinstance(opening, Observation) and not opening.done
        assert no_privileged(opening)
        assert env.privileged()["reference_answer"] == "31"  # a critic asks explicitly
        wrong = env.step(AgentGymAction(text="Let me think."))
        assert no_privileged(wrong) and not wrong.done and wrong.info["turn"] == 1
        state = env.state
        assert isinstance(state, State)
        assert (state.episode_id, state.step_count, state.num_tasks) == ("e1", 1, 54)
        right = env.step(AgentGymAction(text=ANSWER))
        assert right.done and right.reward == 1.0 and right.terminated
        restored = env.reset(state=state.env_state)
        assert restored.text == wrong.text and restored.info["restored_depth"] == 1
        with pytest.raises(ValueError, match="split 'test' is not served"):
            env.reset(split="test", index=0)
        with pytest.raises(ValueError, match="never takes env settings from a client"):
            other = dict(state.env_state, env_kwargs={**state.env_state["env_kwargs"],
                                                      "max_turns": 9})
            env.reset(state=other)
        assert env.get_task("all", 3) == {"id": "agsm-003", "index": 3}
        assert env.list_splits() == ["all"] and env.num_tasks("all") == 54
        with pytest.raises(IndexError):
            env.get_task("all", 54)
        assert env.get_metadata().name == GSM8K
    finally:
        env.close()
    fresh = AgentGymEnvironment(GSM8K)
    with pytest.raises(ValueError, match="reset first"):
        fresh.step(AgentGymAction(text=ANSWER))
    fresh.close()


@contextlib.contextmanager
def served(app: Any) -> Iterator[str]:
    """``app`` under uvicorn in a thread on a free loopback port, stopped on exit."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # OpenEnv's server logs its own WebSocket teardown as an error after a client leaves.
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def test_openenvs_own_server_and_client_play_and_restore() -> None:
    app = create_app(AgentGymEnvironment.factory(GSM8K, max_turns=2), AgentGymAction,
                     AgentGymObservation, env_name="GSM8K-v0", max_concurrent_envs=4)

    async def scenario(url: str) -> None:
        async with GenericEnvClient(base_url=url) as env:
            opening = await env.reset(split="all", index=0)
            assert no_privileged(opening.observation)
            wrong = await env.step({"text": "Let me think."})
            assert wrong.reward == 0.0 and not wrong.done
            state = await env.state()
            result = await env.step({"text": ANSWER})
            assert result.done and result.reward == 1.0 and no_privileged(result.observation)
        async with GenericEnvClient(base_url=url) as branch:
            restored = await branch.reset(state=state["env_state"])
            assert restored.observation["text"] == wrong.observation["text"]
            again = await branch.step({"text": ANSWER})
            assert again.reward == 1.0

    with served(app) as url:
        asyncio.run(scenario(url))
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.get("/GSM8K-v0/splits").json() == [{"name": "all",
                                                             "type": "validation"}]
            task = http.post("/GSM8K-v0/task", json={"split": "all", "index": 2}).json()
            assert task == {"task": {"id": "agsm-002", "index": 2}}
            assert http.post("/GSM8K-v0/task", json={"split": "all", "index": 99}
                             ).status_code == 400
            assert http.get("/metadata").json()["name"] == GSM8K
