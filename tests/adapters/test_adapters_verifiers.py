"""verifiers and GEM, each with its real package.

verifiers (0.4.0, ``verifiers.v1``) reaches Gym-style envs through its OpenEnv taskset: it
reads the server's ``/schema``, turns each model reply into an action with its own
``parse_action`` and steps OpenEnv's ``GenericEnvClient`` until ``done``, summing rewards.
The test drives ``agent-gym serve`` exactly that way, with verifiers' own pieces. GEM's own
wrappers and vector env run agent_gym envs through ``agent_gym.adapters.gem``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.helpers.serve_process import running_server

vf_openenv = pytest.importorskip("verifiers.v1.tasksets.openenv.taskset")
gem_core = pytest.importorskip("gem.core")


@pytest.fixture(scope="module")
def search_url() -> Any:
    with running_server("agent_gym/Search-v0", "--env-arg", "max_turns=5") as url:
        yield url


def test_verifiers_openenv_taskset_plays_agent_gym_serve(search_url: str) -> None:
    from openenv import GenericEnvClient

    config = vf_openenv.OpenEnvConfig(base_url=search_url, resets=[{"index": 0}, {"index": 7}])
    tasks = list(vf_openenv.OpenEnvTaskset(config).load())
    assert [t.data.reset for t in tasks] == [{"index": 0}, {"index": 7}]
    action_schema = httpx.get(f"{search_url}/schema").json()["action"]
    # verifiers' generic-MCP detour is for servers whose action schema is OpenEnv's bare
    # Action; agent_gym's names its one required field, so replies go in as they are.
    assert action_schema["title"] not in {"Action", "CallToolAction", "ListToolsAction"}

    async def episode(task: Any) -> tuple[float, bool]:
        total = 0.0
        async with GenericEnvClient(base_url=task.data.base_url) as client:
            result = await client.reset(**task.data.reset)
            replies = result.observation["info"]["privileged"]["oracle_actions"]
            for reply in replies:  # the model's turns, here the env's own solution
                result = await client.step(vf_openenv.parse_action(reply, action_schema))
                total += result.reward or 0.0
                if result.done:
                    break
        return total, result.done

    assert [asyncio.run(episode(t)) for t in tasks] == [(1.0, True), (1.0, True)]
    # A plain-text reply (not JSON) becomes {"text": reply}, as the env expects.
    assert vf_openenv.parse_action("Answer: 970", action_schema) == {"text": "Answer: 970"}


def test_gem_wrappers_and_vector_env_run_agent_gym_envs() -> None:
    from gem.vector.sync_vector_env import SyncVectorEnv
    from gem.wrappers.episode_tracking_wrapper import EpisodeTrackingWrapper

    from agent_gym.adapters.gem import GemEnv

    env = EpisodeTrackingWrapper(GemEnv("agent_gym/GSM8K-v0", max_turns=2))
    obs, info = env.reset(3)  # GEM's wrappers pass the seed positionally
    assert obs == info["messages"][1]["content"] and info["step_counter"] == 0
    reference = info["privileged"]["reference_answer"]
    _, _, terminated, _, info = env.step("no answer yet")
    assert not terminated and info["cumulative_rewards"] == 0.0
    twin = env.unwrapped.spawn(same_state=True)  # GEM's copy-at-this-point, via restore
    for copy in (env, twin):
        obs, reward, terminated, *_ = copy.step(f"\\boxed{{{reference}}}")
        assert terminated and reward == 1.0

    vec = SyncVectorEnv(["agent_gym/GSM8K-v0"] * 2,
                        [lambda: GemEnv("agent_gym/GSM8K-v0", {"index": 0})] * 2)
    observations, _ = vec.reset(seed=0)
    assert observations[0] == observations[1]
    _, rewards, terminated, _, _ = vec.step(["\\boxed{0}", "\\boxed{0}"])
    assert list(terminated) == [True, True] and list(rewards) == [0.0, 0.0]
