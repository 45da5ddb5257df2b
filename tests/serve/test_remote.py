"""agent_gym/Remote-v0 against a real `agent-gym serve`: the local env contract, remotely."""

from __future__ import annotations

from typing import Any

import gymnasium
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("websockets")

import agent_gym
from agent_gym.env.state import StateError
from agent_gym.serve.remote import RemoteEnvError, ws_url
from tests.helpers.serve_process import running_server

KWARGS = {"max_turns": 5}


@pytest.fixture(scope="module")
def search_url() -> Any:
    with running_server("agent_gym/Search-v0", "--env-arg", "max_turns=5") as url:
        yield url


def oracle_run(env: gymnasium.Env, task_index: int) -> list[tuple]:
    obs, info = env.reset(options={"index": task_index})
    seen: list[tuple] = [(obs, info["task_id"])]
    for action in info["privileged"]["oracle_actions"]:
        obs, reward, terminated, truncated, step_info = env.step(action)
        seen.append((obs, reward, terminated, truncated, step_info["invalid"]))
        if terminated or truncated:
            break
    return seen


def test_remote_env_plays_exactly_like_the_local_env(search_url: str) -> None:
    remote = gymnasium.make("agent_gym/Remote-v0", url=search_url)
    local = gymnasium.make("agent_gym/Search-v0", **KWARGS)
    try:
        for index in (0, 5):
            assert oracle_run(remote, index) == oracle_run(local, index)
    finally:
        remote.close()
        local.close()


def test_states_travel_between_remote_and_local(search_url: str) -> None:
    remote = gymnasium.make("agent_gym/Remote-v0", url=search_url)
    try:
        _, info = remote.reset(options={"index": 3})
        first = info["privileged"]["oracle_actions"][0]
        obs, *_ = remote.step(first)
        state = remote.unwrapped.save_state()
        assert state.env_id == "agent_gym/Search-v0" and state.actions == (first,)
        # Remote state -> a local env built from the same settings.
        local, local_obs, local_info = agent_gym.make_from_state(state)
        assert local_obs == obs and local_info["turn"] == 1
        local_step_obs = local.step("thinking, no answer yet")[0]
        # Local state -> a new remote session.
        other = gymnasium.make("agent_gym/Remote-v0", url=search_url)
        try:
            restored, restored_info = other.reset(options={"state": local.unwrapped.save_state()})
            assert restored_info["turn"] == 2
            assert restored == local_step_obs
            # A state from an env with other settings is refused by the server.
            wrong = gymnasium.make("agent_gym/Search-v0", max_turns=6)
            wrong.reset(options={"index": 3})
            with pytest.raises(StateError, match="never takes env settings"):
                other.reset(options={"state": wrong.unwrapped.save_state()})
            wrong.close()
        finally:
            other.close()
        local.close()
    finally:
        remote.close()


def test_async_vector_env_of_remote_envs_branches_one_state(search_url: str) -> None:
    seed_env = gymnasium.make("agent_gym/Remote-v0", url=search_url)
    seed_env.reset(options={"index": 1})
    seed_env.step("I will look it up later.")
    state = seed_env.unwrapped.save_state()
    seed_env.close()
    vec = gymnasium.make_vec("agent_gym/Remote-v0", num_envs=2, vectorization_mode="async",
                             url=search_url)
    try:
        observations, infos = vec.reset(options={"state": state})
        assert observations[0] == observations[1]
        assert list(infos["turn"]) == [1, 1]
    finally:
        vec.close()


def test_remote_errors(search_url: str) -> None:
    assert ws_url("http://h:1") == "ws://h:1/ws" and ws_url("https://h/") == "wss://h/ws"
    env = gymnasium.make("agent_gym/Remote-v0", url=search_url)
    try:
        with pytest.raises(RemoteEnvError, match="EXECUTION_ERROR"):
            env.unwrapped.step("before reset")  # past Gymnasium's own order check
        with pytest.raises(ValueError, match="unknown reset option"):
            env.unwrapped.reset(options={"colour": 1})
        env.reset(options={"index": 0})
        assert env.step("hello")[4]["turn"] == 1  # the session survived the errors
    finally:
        env.close()


def test_eval_runs_on_a_served_env_as_on_a_local_one(search_url: str, tmp_path: Any) -> None:
    """`agent-gym eval agent_gym/Remote-v0 --env-arg url=...`: same episodes, same scores."""
    import json

    from agent_gym.cli.main import main

    remote_out, local_out = tmp_path / "remote", tmp_path / "local"
    assert main(["eval", "agent_gym/Remote-v0", "--env-arg", f"url={search_url}",
                 "--episodes", "3", "--quiet", "--out", str(remote_out)]) == 0
    assert main(["eval", "agent_gym/Search-v0", "--env-arg", "max_turns=5", "--episodes", "3",
                 "--quiet", "--out", str(local_out)]) == 0

    def scores(run: Any) -> list[tuple]:
        rows = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
        return sorted((r["episode"], r["task_id"], r["reward"], r["turns"]) for r in rows)

    assert scores(remote_out) == scores(local_out)
