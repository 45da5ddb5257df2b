"""Envs in Ray actors, on a local 2-CPU Ray started once for this module."""

import asyncio
import json
import time
from pathlib import Path

import gymnasium
import pytest

ray = pytest.importorskip("ray")

from agent_gym.eval.config import EvalConfig  # noqa: E402
from agent_gym.eval.policies import OraclePolicy, make_policy  # noqa: E402
from agent_gym.eval.run import evaluate  # noqa: E402
from agent_gym.serve.distributed import RayVectorEnv, RemoteEnv  # noqa: E402

GSM8K = "agent_gym/GSM8K-v0"


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_vector_env_contract_with_next_step_autoreset() -> None:
    vec = RayVectorEnv(GSM8K, num_envs=2, env_kwargs={"max_turns": 2})
    try:
        observations, infos = vec.reset(seed=4)
        local = gymnasium.make(GSM8K, max_turns=2)
        assert observations[0] == local.reset(seed=4)[0]
        assert observations[1] == local.reset(seed=5)[0]
        references = infos["privileged"]["reference_answer"]
        _, rewards, terminated, truncated, infos = vec.step(
            [f"\\boxed{{{references[0]}}}", "thinking"]
        )
        assert list(rewards) == [1.0, 0.0]
        assert list(terminated) == [True, False] and not truncated.any()
        # Next step: env 0 autoresets (its action is ignored), env 1 answers its last turn.
        observations, rewards, terminated, truncated, infos = vec.step(["ignored", "\\boxed{0}"])
        assert infos["turn"][0] == 0 and "messages" in infos
        assert list(terminated) == [False, True]
    finally:
        vec.close()


def test_restore_travels_between_actors_as_env_state() -> None:
    vec = RayVectorEnv(GSM8K, num_envs=2, env_kwargs={"max_turns": 3})
    try:
        vec.reset(seed=1)
        vec.step(["first thought", "other thought"])
        saved = vec.save_states()
        # Both actors restore the state saved in actor 0: two branches of one episode.
        observations, infos = vec.reset(options={"state": saved[0]})
        assert list(infos["turn"]) == [1, 1]
        assert observations[0] == observations[1]
        observations, infos = vec.reset(options={"states": saved[::-1]})
        assert [s.task_id for s in vec.save_states()] == [s.task_id for s in saved[::-1]]
        # A state saved in an actor restores in this process too.
        local = gymnasium.make(GSM8K, max_turns=3)
        assert local.reset(options={"state": saved[1]})[1]["turn"] == 1
    finally:
        vec.close()


def test_a_killed_actor_is_reported_replaced_and_its_episode_truncated() -> None:
    vec = RayVectorEnv(GSM8K, num_envs=2, env_kwargs={"max_turns": 3})
    try:
        vec.reset(seed=0)
        ray.kill(vec.actors[1])
        # ray.kill is asynchronous (a call sent at once may still be answered): wait until
        # the actor is really gone before stepping.
        deadline = time.monotonic() + 30
        while True:
            try:
                ray.get(vec.actors[1].spaces.remote(), timeout=30)
            except ray.exceptions.RayActorError:
                break
            assert time.monotonic() < deadline, "the killed actor kept answering"
            time.sleep(0.1)
        _, _, terminated, truncated, infos = vec.step(["thinking", "thinking"])
        assert list(truncated) == [False, True] and not terminated.any()
        assert infos["actor_died"][1] and not infos["actor_died"][0]
        # The replacement autoresets on the next step and then plays normally.
        observations, _, _, _, infos = vec.step(["more", "ignored"])
        assert observations[1] and infos["turn"][1] == 0
        assert vec.step(["a", "b"])[4]["turn"][1] == 1
    finally:
        vec.close()


def test_eval_through_ray_equals_the_single_process_run(tmp_path: Path) -> None:
    config = EvalConfig(GSM8K, "oracle", episodes=6, seed=2)
    asyncio.run(evaluate(config, OraclePolicy(), tmp_path / "local", progress=False))
    asyncio.run(
        evaluate(config, OraclePolicy(), tmp_path / "ray", concurrency=2, progress=False,
                 make_env=lambda: RemoteEnv(GSM8K, {}))
    )

    def results(run: Path) -> list[tuple]:
        lines = (run / "episodes.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        return sorted((r["episode"], r["task_id"], r["reward"], r["final_state"]["digests"][-1])
                      for r in records)

    assert results(tmp_path / "local") == results(tmp_path / "ray")


def test_grpo_creates_its_env_actors_once_per_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent_gym_train.grpo import Args, train

    created: list[RemoteEnv] = []
    closed: list[RemoteEnv] = []
    remote_resets: list[dict] = []
    real_init, real_reset, real_close = RemoteEnv.__init__, RemoteEnv.reset, RemoteEnv.close

    def counting_init(self: RemoteEnv, *args: object, **kwargs: object) -> None:
        created.append(self)
        real_init(self, *args, **kwargs)

    def counting_reset(self: RemoteEnv, **kwargs: object) -> tuple:
        remote_resets.append(kwargs)
        return real_reset(self, **kwargs)

    def counting_close(self: RemoteEnv) -> None:
        closed.append(self)
        real_close(self)

    monkeypatch.setattr(RemoteEnv, "__init__", counting_init)
    monkeypatch.setattr(RemoteEnv, "reset", counting_reset)
    monkeypatch.setattr(RemoteEnv, "close", counting_close)
    args = Args(
        env_id=GSM8K, env_kwargs={"max_turns": 2}, model="tiny", lora_rank=4, steps=3,
        batch_size=2, group_size=2, max_tokens=4, max_trajectory_tokens=512,
        out=str(tmp_path / "grpo"), progress=False, ray="local",
    )
    history = train(args)
    assert [row["step"] for row in history] == [0, 1, 2]
    assert len(remote_resets) == 3 * 4  # every branch (2 tasks x 2) of every step in an actor
    assert len(created) == 4  # one actor per concurrent branch, for the whole run
    assert sorted(map(id, closed)) == sorted(map(id, created))  # and all end with the run


def test_a_ray_actor_imports_the_plugins_that_register_a_third_party_env() -> None:
    """``agent-gym eval --ray --import MODULE``: the env is registered by the caller's module,
    which the actor's process never imported on its own."""
    env = RemoteEnv("agent_gym_tests/SayDigit-v0", {}, plugins=["tests.helpers.grpo_toy"])
    try:
        observation, _ = env.reset(seed=0)
        assert env.step(observation)[1] == 1.0
    finally:
        env.close()


def test_random_through_ray_phrases_its_actions_in_the_envs_protocol(tmp_path: Path) -> None:
    """The actor's env protocol travels to the caller, as a local env's is read: random on
    ALFWorld's tool protocol plays valid calls, not refused bare commands."""
    pytest.importorskip("textworld")
    config = EvalConfig("agent_gym/ALFWorld-v0", "random", episodes=1,
                        env_kwargs={"max_turns": 3})
    asyncio.run(evaluate(config, make_policy("random"), tmp_path / "run", progress=False,
                         make_env=lambda: RemoteEnv(config.env_id, config.env_kwargs)))
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "episodes.jsonl")
                 .read_text().splitlines()]
    assert record["turns"] == 3 and record["invalid_actions"] == 0
