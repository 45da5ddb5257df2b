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
CRITIC = "critic-s3cret"


@pytest.fixture(scope="module")
def search_url() -> Any:
    with pytest.MonkeyPatch.context() as patch:  # the clients read the tokens from here
        patch.setenv("AGENT_GYM_TEST_CRITIC", CRITIC)
        patch.setenv("AGENT_GYM_TEST_GUESS", "guess")
        with running_server("agent_gym/Search-v0", "--env-arg", "max_turns=5",
                            "--critic-token-env", "AGENT_GYM_TEST_CRITIC",
                            env={"AGENT_GYM_TEST_CRITIC": CRITIC}) as url:
            yield url


def critic_env(url: str) -> gymnasium.Env:
    """A Remote-v0 env of the critic's: its resets carry the privileged info."""
    return gymnasium.make("agent_gym/Remote-v0", url=url,
                          critic_token_env="AGENT_GYM_TEST_CRITIC")


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
    remote = critic_env(search_url)
    local = gymnasium.make("agent_gym/Search-v0", **KWARGS)
    try:
        for index in (0, 5):
            assert oracle_run(remote, index) == oracle_run(local, index)
    finally:
        remote.close()
        local.close()


def test_states_travel_between_remote_and_local(search_url: str) -> None:
    remote = critic_env(search_url)
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


def test_a_policys_remote_env_gets_no_privileged_info_and_a_critics_asks_for_it(
    search_url: str,
) -> None:
    local = gymnasium.make("agent_gym/Search-v0", **KWARGS)
    policy = gymnasium.make("agent_gym/Remote-v0", url=search_url)
    critic = critic_env(search_url)
    guesser = gymnasium.make("agent_gym/Remote-v0", url=search_url,
                             critic_token_env="AGENT_GYM_TEST_GUESS")
    try:
        _, expected = local.reset(options={"index": 4})
        oracle = expected["privileged"]["oracle_actions"]
        _, info = policy.reset(options={"index": 4})
        assert info["privileged"] == {}
        step_info = policy.step(oracle[0])[4]
        assert "privileged" not in step_info
        restored = policy.unwrapped.save_state()
        assert policy.reset(options={"state": restored})[1]["privileged"] == {}
        assert critic.reset(options={"index": 4})[1]["privileged"] == expected["privileged"]
        assert critic.reset(options={"state": restored})[1]["privileged"] == \
            expected["privileged"]
        with pytest.raises(RemoteEnvError, match="UNAUTHORIZED"):
            guesser.reset(options={"index": 4})
        with pytest.raises(ValueError, match=r"AGENT_GYM_TEST_UNSET.*not set"):
            gymnasium.make("agent_gym/Remote-v0", url=search_url,
                           critic_token_env="AGENT_GYM_TEST_UNSET")
    finally:
        for env in (local, policy, critic, guesser):
            env.close()


def test_the_eval_oracle_needs_the_critic_token_on_a_served_env(
    search_url: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from agent_gym.cli.main import main

    assert main(["eval", "agent_gym/Remote-v0", "--env-arg", f"url={search_url}",
                 "--episodes", "1", "--quiet", "--out", str(tmp_path / "run")]) == 1
    assert "the oracle got no privileged info" in capsys.readouterr().err


def test_eval_runs_on_a_served_env_as_on_a_local_one(search_url: str, tmp_path: Any) -> None:
    """`agent-gym eval agent_gym/Remote-v0 --env-arg url=... --env-arg critic_token_env=VAR`
    (the oracle's privileged info, asked for as a critic): same episodes, same scores, and
    the run's files name the variable, never the token."""
    import json

    from agent_gym.cli.main import main

    remote_out, local_out = tmp_path / "remote", tmp_path / "local"
    assert main(["eval", "agent_gym/Remote-v0", "--env-arg", f"url={search_url}",
                 "--env-arg", "critic_token_env=AGENT_GYM_TEST_CRITIC",
                 "--episodes", "3", "--quiet", "--out", str(remote_out)]) == 0
    assert main(["eval", "agent_gym/Search-v0", "--env-arg", "max_turns=5", "--episodes", "3",
                 "--quiet", "--out", str(local_out)]) == 0

    def scores(run: Any) -> list[tuple]:
        rows = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
        return sorted((r["episode"], r["task_id"], r["reward"], r["turns"]) for r in rows)

    assert scores(remote_out) == scores(local_out)
    assert not any(CRITIC in path.read_text() for path in remote_out.iterdir())


def test_a_reply_this_client_cannot_trust_is_a_remote_env_error() -> None:
    """A server's reply is read as untrusted JSON: NaN, or nesting past any reply of the
    protocol, is refused in one line rather than passed on as a reward or a recursion."""
    import threading

    from websockets.sync.server import serve

    from agent_gym.serve.remote import RemoteTextEnv

    replies = iter(['{"type": "observation", "data": {"reward": NaN}}', "[" * 5000 + "]" * 5000])

    def answer(websocket: Any) -> None:
        for _, reply in zip(websocket, replies, strict=False):  # then the client's close
            websocket.send(reply)

    with serve(answer, "127.0.0.1", 0) as server:
        thread = threading.Thread(target=server.serve_forever)
        thread.start()
        try:
            env = RemoteTextEnv(f"http://127.0.0.1:{server.socket.getsockname()[1]}")
            for words in ("non-finite number NaN", "nested deeper"):
                with pytest.raises(RemoteEnvError, match="INVALID_REPLY") as caught:
                    env.step("hello")
                assert words in str(caught.value)
            env.close()
        finally:
            server.shutdown()
            thread.join()
