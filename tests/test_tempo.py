"""TEMPO: the signal formulas on hand-made numbers, the critic's parser, the state store,
restored branches, and short end-to-end runs (with resume) on a toy env."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import pytest
from pytrio import ModelInput

from agent_gym.render import ChatRenderer
from agent_gym.state import EnvState, StateMismatchError
from tests import grpo_toy, tempo_toy
from trainers.backends.local import LocalServiceClient
from trainers.cli import register
from trainers.critic import (
    HISTORY_TURNS,
    Critic,
    critic_messages,
    critic_rewards,
    gather_values,
    parse_value,
)
from trainers.episode import Episode, Turn
from trainers.rollout import RolloutConfig, RolloutError, rollout_group
from trainers.store import MacroState, StateStore, StoreError, cut, fresh_quota
from trainers.tempo import (
    Args,
    actor_update,
    centred,
    macro_returns,
    main,
    parse_args,
    plot,
    prefix_weight,
    train,
    value_corr,
    value_gap_zero_reward,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tempo_toy.value_model(tmp_path_factory)


@pytest.fixture(scope="module")
def sampler(model: str) -> Any:
    return LocalServiceClient().create_sampling_client(model)


# ----------------------------------------------------------------------- formulas
def test_actor_signal_on_hand_made_numbers() -> None:
    # three branches: env rewards 0, 1, 0; critic values at their ends 0.5, 0 (terminal), 0.2
    returns = macro_returns([0.0, 1.0, 0.0], [0.5, 0.0, 0.2])
    assert returns.tolist() == pytest.approx([0.5, 1.0, 0.2])
    assert returns.mean() == pytest.approx(1.7 / 3)  # G
    advantages = centred(returns)
    assert advantages is not None
    assert advantages.tolist() == pytest.approx([0.5 - 1.7 / 3, 1.0 - 1.7 / 3, 0.2 - 1.7 / 3])
    weight, clipped = prefix_weight(-10.0, -10.5, cap=2.0)
    assert (weight, clipped) == (pytest.approx(math.exp(0.5)), False)
    assert (advantages * weight).tolist() == pytest.approx(
        [(r - 1.7 / 3) * math.exp(0.5) for r in (0.5, 1.0, 0.2)]
    )


def test_degenerate_groups_are_recognised() -> None:
    assert centred([0.3, 0.3, 0.3]) is None
    assert centred(macro_returns([1.0, 0.0], [0.0, 1.0])) is None  # equal returns
    assert centred([0.0, 1e-9]) is not None


def test_critic_reward_on_hand_made_numbers() -> None:
    raw = critic_rewards([0.2, None, 0.8, 0.5], target=0.5, r_max=1.0)
    assert raw.tolist() == pytest.approx([-0.3, -1.0, -0.3, 0.0])  # failure: -1 before centring
    assert centred(raw).tolist() == pytest.approx([0.1, -0.6, 0.1, 0.4])  # mean -0.4
    assert critic_rewards([2.0, 4.0], target=1.0, r_max=4.0).tolist() == [-0.25, -0.75]
    assert centred(critic_rewards([None, None], 0.5, 1.0)) is None  # all failed: skipped


def test_prefix_weight_is_truncated_at_the_cap() -> None:
    assert prefix_weight(-10.0, -11.0, cap=2.0) == (2.0, True)  # e^1 > 2
    assert prefix_weight(-11.0, -10.0, cap=2.0) == (pytest.approx(math.exp(-1)), False)
    assert prefix_weight(-5.0, -5.0, cap=2.0) == (1.0, False)
    assert prefix_weight(0.0, -math.log(2.0), cap=2.0) == (2.0, True)  # exactly at the cap


def test_value_corr_and_value_gap() -> None:
    assert value_corr([0.1, 0.5, 0.9], [0.0, 0.5, 1.0]) == pytest.approx(1.0)
    assert value_corr([0.9, 0.1], [0.0, 1.0]) == pytest.approx(-1.0)
    assert value_corr([0.5, 0.5], [0.0, 1.0]) is None
    assert value_corr([0.5], [1.0]) is None
    groups = [
        ([0.0, 0.0, 1.0], [0.2, 0.6, 0.0]),  # zero-reward branches' values 0.2, 0.6: gap 0.4
        ([1.0, 1.0], [0.0, 0.0]),  # no zero-reward branch: not counted
        ([0.0, 0.0], [0.3, 0.3]),  # gap 0
    ]
    assert value_gap_zero_reward(groups) == pytest.approx(0.2)
    assert value_gap_zero_reward([([1.0], [0.0])]) is None


# ----------------------------------------------------------------------- critic
@pytest.mark.parametrize(
    ("text", "r_max", "expected"),
    [
        ("I think <value>0.42</value>", 1.0, 0.42),
        ("<value>0.1</value> on second thought <value>0.9</value>", 1.0, 0.9),  # last match
        ("<value>0.3</value> <value>high</value>", 1.0, None),  # the last one decides
        ("<value> .5 </value>", 1.0, 0.5),
        ("<value>1</value>", 1.0, 1.0),
        ("<value>0</value>", 1.0, 0.0),
        ("<value>1.5</value>", 1.0, None),  # out of [0, r_max]
        ("<value>1.5</value>", 2.0, 1.5),
        ("<value>-0.1</value>", 1.0, None),
        ("<value>1e-1</value>", 1.0, None),
        ("<value>nan</value>", 1.0, None),
        ("<value>50%</value>", 1.0, None),
        ("<value>0.5", 1.0, None),
        ("the value is 0.5", 1.0, None),
        ("<value></value>", 1.0, None),
    ],
)
def test_value_parsing_is_strict(text: str, r_max: float, expected: float | None) -> None:
    assert parse_value(text, r_max) == expected


def test_critic_prompt_shows_privileged_info_and_condenses_history() -> None:
    opening = [{"role": "system", "content": "You are a robot."},
               {"role": "user", "content": "Your task is to: put a clean mug in the coffeemachine."}]
    history = []
    for t in range(30):
        history += [{"role": "assistant", "content": "x" * 5000 + f" go to place {t}"},
                    {"role": "tool", "content": f"You arrive at place {t}. " + "y" * 5000}]
    privileged = {"walkthrough": ["go to mug 1", "take mug 1"], "oracle_actions": ["<tool_call>"]}
    system, user = critic_messages([*opening, *history], 2, privileged, r_max=1.0)
    assert system["role"] == "system" and "<value>" in system["content"]
    text = user["content"]
    assert "put a clean mug in the coffeemachine" in text
    assert "go to mug 1; take mug 1" in text
    assert "oracle_actions" not in text and "You are a robot" not in text
    assert f"({30 - HISTORY_TURNS} earlier turns not shown)" in text
    assert "go to place 29" in text and "You arrive at place 29" in text  # tail / head kept
    assert "go to place 3 " not in text
    assert len(text) < 9000  # bounded whatever the episode's length


def test_critic_samples_values_and_counts_cut_replies_as_failures(sampler: Any) -> None:
    renderer = ChatRenderer(sampler.get_tokenizer())
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "go to desk 1"}]
    critic = Critic(renderer, r_max=1.0, max_tokens=16, temperature=1.0)
    prompt = critic.prompt(chat, 2, {"answer": "7"})
    samples = asyncio.run(critic.sample(sampler, prompt, 16, seed=0))
    assert len(samples) == 16
    parsed = [s.value for s in samples if s.value is not None]
    assert len(parsed) >= 8 and len(set(parsed)) >= 2  # the toy speaks values, not one value
    assert all(s.turn.prompt_tokens == prompt for s in samples)
    value, _ = asyncio.run(critic.value(sampler, prompt, 4, seed=1))
    assert 0.0 <= value <= 1.0
    short = Critic(renderer, r_max=1.0, max_tokens=3, temperature=1.0)  # every reply is cut
    assert all(s.value is None for s in asyncio.run(short.sample(sampler, prompt, 4, seed=0)))


def test_terminal_endpoints_are_worth_zero_without_sampling() -> None:
    critic = Critic(None, r_max=1.0, max_tokens=4, temperature=1.0)  # type: ignore[arg-type]
    values = asyncio.run(gather_values(critic, object(), [None, None], 2, [0, 1]))  # type: ignore[arg-type]
    assert values == [(0.0, []), (0.0, [])]


# ----------------------------------------------------------------------- store
def macro_state(version: int, index: int = 0) -> MacroState:
    state = EnvState("agent_gym_tests/None", {}, f"task-{index}", None, ("a",), ("d0", "d1"))
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                {"role": "user", "content": "no"}]
    return MacroState(state, [1, 2, 3, 4], messages, 1, {}, version, [(1, 2)], -0.5)


def test_fresh_quota() -> None:
    assert [fresh_quota(4, f) for f in (0.25, 0.5, 0.75, 1.0)] == [1, 2, 3, 4]
    assert fresh_quota(3, 0.5) == 2  # rounds up: never less than the fraction
    assert fresh_quota(10, 0.01) == 1  # at least one fresh task
    with pytest.raises(ValueError):
        fresh_quota(4, 0.0)


def test_store_never_starves_fresh_tasks_and_consumes_states() -> None:
    store = StateStore(capacity=1000, staleness=100)
    store.add(macro_state(0, i) for i in range(100))
    rng = np.random.default_rng(0)
    seen: set[str] = set()
    for _ in range(20):
        drawn, stale = store.draw(4, 0.25, version=1, rng=rng)
        assert len(drawn) == 3 and stale == 0  # one group of four left to a fresh task
        ids = {s.state.task_id for s in drawn}
        assert len(ids) == 3 and not ids & seen  # consumed: never drawn twice
        seen |= ids
    assert len(store) == 100 - 60
    assert store.draw(4, 1.0, version=1, rng=rng) == ([], 0)  # all fresh
    small = StateStore(capacity=10, staleness=1)
    small.add([macro_state(0)])
    drawn, _ = small.draw(8, 0.25, version=0, rng=rng)
    assert len(drawn) == 1 and len(small) == 0  # fewer states than slots: the rest is fresh


def test_store_evicts_fifo_and_drops_stale_states() -> None:
    store = StateStore(capacity=3, staleness=2)
    assert store.add(macro_state(v, v) for v in range(5)) == 2
    assert [s.version for s in store] == [2, 3, 4]  # the two oldest went
    assert store.drop_stale(version=5) == 1  # version 2 is 3 versions old
    assert [s.version for s in store] == [3, 4]
    drawn, stale = store.draw(4, 0.25, version=6, rng=np.random.default_rng(0))
    assert stale == 1 and [s.version for s in drawn] == [4]


def test_store_round_trips_through_json_and_rejects_bad_files() -> None:
    store = StateStore(capacity=5, staleness=3)
    store.add(macro_state(v, v) for v in range(4))
    again = StateStore.from_json(store.to_json(), capacity=5, staleness=3)
    assert [s.to_dict() for s in again] == [s.to_dict() for s in store]
    smaller = StateStore.from_json(store.to_json(), capacity=2, staleness=3)
    assert [s.version for s in smaller] == [2, 3]
    with pytest.raises(StoreError, match="not valid JSON"):
        StateStore.from_json("{", 5, 3)
    with pytest.raises(StoreError, match="version"):
        StateStore.from_json('{"states": []}', 5, 3)
    broken = json.loads(store.to_json())
    broken["states"][0]["sampled"] = [[3, 2]]
    with pytest.raises(StoreError, match="out of order"):
        StateStore.from_json(json.dumps(broken), 5, 3)
    broken["states"][0]["sampled"] = [[1, 2]]
    del broken["states"][0]["version"]
    with pytest.raises(StoreError, match="fields"):
        StateStore.from_json(json.dumps(broken), 5, 3)


def hand_made_episode(start: MacroState | None = None) -> Episode:
    """Turn 1 samples [4 5] after prompt [1 2 3]; the env adds [6 7]; turn 2 samples [8 9]."""
    before = start.messages if start else [{"role": "system", "content": "s"},
                                           {"role": "user", "content": "task"}]
    actions = (*(start.state.actions if start else ()), "a1", "a2")
    return Episode(
        "t",
        [Turn([1, 2, 3], [4, 5], [-0.1, -0.2], "stop"),
         Turn([1, 2, 3, 4, 5, 6, 7], [8, 9], [-0.3, -0.4], "stop")],
        reward=0.5, end_reason="max_turns",
        messages=[*before, {"role": "assistant", "content": "a1"}, {"role": "tool", "content": "o1"},
                  {"role": "assistant", "content": "a2"}, {"role": "tool", "content": "o2"}],
        step_rewards=[0.0, 0.5], opening_messages=2, privileged={"answer": "x"},
        env_state=EnvState("e", {}, "t", 7, actions, tuple(f"d{i}" for i in range(len(actions) + 1))),
        next_prompt=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
    )


def test_actor_datums_carry_the_weighted_advantage_on_sampled_tokens_only() -> None:
    won = dataclasses.replace(hand_made_episode(), reward=1.0)
    lost = dataclasses.replace(hand_made_episode(), reward=0.0)
    cut_short = dataclasses.replace(hand_made_episode(), reward=0.0, end_reason="max_tokens")
    # R = (1 + 0, 0 + 0.7, 0 + 0) -> G = 1.7 / 3; w = 1.5
    datums, target = actor_update([won, lost, cut_short], [0.0, 0.7, 0.0], weight=1.5)
    assert target == pytest.approx(1.7 / 3)
    for datum, ret in zip(datums, (1.0, 0.7, 0.0), strict=True):
        advantages = datum.loss_fn_inputs["advantages"].data
        targets = datum.loss_fn_inputs["target_tokens"].data
        sampled = [a for a, t in zip(advantages, targets, strict=True) if t != -100]
        assert sampled == pytest.approx([(ret - 1.7 / 3) * 1.5] * 4)  # tokens 4 5 8 9
        assert all(a == 0 for a, t in zip(advantages, targets, strict=True) if t == -100)
    assert actor_update([won, lost], [0.0, 1.0], weight=1.0) == (None, 1.0)  # degenerate


def test_cutting_macro_states_from_an_episode() -> None:
    episode = hand_made_episode()
    middle = cut(episode, 1, None, version=3)
    assert middle.tokens == [1, 2, 3, 4, 5, 6, 7]
    assert middle.sampled == [(3, 5)] and middle.old_logprob_sum == pytest.approx(-0.3)
    assert middle.state.actions == ("a1",) and middle.state.digests == ("d0", "d1")
    assert [m["content"] for m in middle.messages] == ["s", "task", "a1", "o1"]
    assert middle.observation == "o1" and middle.turn == 1 and middle.version == 3
    end = cut(episode, 2, None, version=3)
    assert end.tokens == episode.next_prompt
    assert end.sampled == [(3, 5), (7, 9)] and end.old_logprob_sum == pytest.approx(-1.0)
    assert end.state == episode.env_state and end.privileged == {"answer": "x"}
    with pytest.raises(StoreError, match="between 1 and"):
        cut(episode, 3, None, version=3)
    with pytest.raises(StoreError, match="keep_states"):
        cut(dataclasses.replace(episode, env_state=None), 1, None, version=3)
    with pytest.raises(StoreError, match="no prompt to resume"):
        cut(dataclasses.replace(episode, next_prompt=None, end_reason="truncated"), 2, None, 3)
    with pytest.raises(StoreError, match="token-continuous"):
        bad = dataclasses.replace(episode, turns=[episode.turns[0], Turn([1, 2, 3, 9, 9], [8], [-1.0], "stop")])
        cut(bad, 2, None, 3)


def test_cut_chains_onto_the_state_an_episode_resumed_from() -> None:
    start = dataclasses.replace(
        macro_state(1), tokens=[1, 2, 3], sampled=[(1, 2)], old_logprob_sum=-2.0,
        messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "task"},
                  {"role": "assistant", "content": "a0"}, {"role": "tool", "content": "o0"}],
        opening=2, state=EnvState("e", {}, "t", 7, ("a0",), ("d0", "d1")),
    )
    state = cut(hand_made_episode(start), 1, start, version=4)
    assert state.sampled == [(1, 2), (3, 5)] and state.old_logprob_sum == pytest.approx(-2.3)
    assert state.state.actions == ("a0", "a1") and state.turn == 2
    assert [m["content"] for m in state.messages][2:] == ["a0", "o0", "a1", "o1"]


# ----------------------------------------------------------------------- restored branches
def test_restored_branches_continue_the_saved_tokens_and_are_checked(sampler: Any) -> None:
    renderer = ChatRenderer(sampler.get_tokenizer())
    config = RolloutConfig(group_size=6, max_turns=1, max_tokens=12, max_trajectory_tokens=512,
                           keep_states=True)
    make_env = grpo_toy.SayDigitEnv
    first = asyncio.run(rollout_group(make_env, {"index": 0}, sampler, renderer, config, seed=1))
    stopped = [e for e in first if e.end_reason == "max_turns"]
    assert stopped, [e.end_reason for e in first]
    state = cut(stopped[0], 1, None, version=0)
    assert state.observation == "no"

    # the sampled prefix tokens are where `sampled` says: the same policy scores them as sampled
    logprobs = sampler.compute_logprobs(ModelInput.from_ints(state.tokens)).result()
    assert state.sampled_logprob_sum(logprobs) == pytest.approx(state.old_logprob_sum, abs=1e-3)

    branches = asyncio.run(rollout_group(make_env, None, sampler, renderer, config, seed=2,
                                         resume=state.resume()))
    for episode in branches:
        assert episode.turns[0].prompt_tokens == state.tokens  # the exact token prefix
        assert episode.messages[: len(state.messages)] == state.messages
        assert episode.end_reason in ("terminated", "truncated", "max_tokens")  # 2 turns at most
        assert episode.env_state.actions[:1] == state.state.actions

    tampered = dataclasses.replace(state, messages=[*state.messages[:-1],
                                                    {"role": "user", "content": "yes"}])
    with pytest.raises(RolloutError, match="shows 'no', the saved state showed 'yes'"):
        asyncio.run(rollout_group(make_env, None, sampler, renderer, config,
                                  resume=tampered.resume()))
    messages = [dict(m) for m in state.messages]
    messages[1]["content"] = "something else"
    with pytest.raises(RolloutError, match="differs from the saved one at message 1"):
        asyncio.run(rollout_group(make_env, None, sampler, renderer, config,
                                  resume=dataclasses.replace(state, messages=messages).resume()))
    wrong = dataclasses.replace(state.state, digests=(state.state.digests[0], "0" * 16))
    with pytest.raises(StateMismatchError):
        asyncio.run(rollout_group(make_env, None, sampler, renderer, config,
                                  resume=dataclasses.replace(state, state=wrong).resume()))
    with pytest.raises(ValueError, match="either"):
        asyncio.run(rollout_group(make_env, {"index": 0}, sampler, renderer, config,
                                  resume=state.resume()))


# ----------------------------------------------------------------------- end to end
def toy_args(model: str, out: Path, **overrides: Any) -> Args:
    settings: dict[str, Any] = {
        "env_id": grpo_toy.ENV_ID, "model": model, "lora_rank": 0, "warmup_updates": 2,
        "td_updates": 4, "batch_size": 2, "horizon": 1, "branches": 4, "critic_samples": 4,
        "endpoint_samples": 2, "fresh_fraction": 0.5, "learning_rate": 1e-3, "max_tokens": 12,
        "critic_max_tokens": 12, "max_trajectory_tokens": 1024, "out": str(out),
        "progress": False, "save_every": 1,
    }
    return Args(**(settings | overrides))


class CountingService:
    """The local service, recording every forward_backward and optim_step call."""

    def __init__(self) -> None:
        self.service = LocalServiceClient()
        self.calls: list[tuple[str, int]] = []

    def create_full_training_client(self, *args: Any, **kwargs: Any) -> Any:
        return CountingTraining(self.service.create_full_training_client(*args, **kwargs), self)

    def create_training_client_from_state_with_optimizer(self, path: str) -> Any:
        client = self.service.create_training_client_from_state_with_optimizer(path)
        return CountingTraining(client, self)


class CountingTraining:
    def __init__(self, inner: Any, owner: CountingService) -> None:
        self.inner, self.owner = inner, owner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward_backward(self, datums: list[Any], *args: Any) -> Any:
        self.owner.calls.append(("forward_backward", len(datums)))
        return self.inner.forward_backward(datums, *args)

    def optim_step(self, adam: Any) -> Any:
        self.owner.calls.append(("optim_step", 0))
        return self.inner.optim_step(adam)


def test_end_to_end_on_a_toy_env(model: str, tmp_path: Path) -> None:
    service = CountingService()
    history = train(toy_args(model, tmp_path), service)
    assert [row["step"] for row in history] == list(range(6))
    warmup, td = history[:2], history[2:]
    for row in warmup:  # critic datums only
        assert row["phase"] == "warmup" and "actor/datums" not in row
        assert row["datums"] == row["critic/datums"]
    for row in td:
        assert row["phase"] == "td" and row["td/fresh_states"] >= 1
        assert row["datums"] == row["actor/datums"] + row["critic/datums"]
        assert 0 <= row["actor/degenerate_group_rate"] <= 1
        for key in ("critic/abs_error_mean", "critic/value_corr", "critic/parse_failure_rate",
                    "actor/value_gap_zero_reward", "td/store_size", "is/weight_mean",
                    "is/clip_rate"):
            assert key in row
    assert sum(row["td/restored_states"] for row in td) >= 2
    assert any(row["actor/datums"] and row["critic/datums"] for row in td)
    assert all(row["is/weight_mean"] is not None for row in td if row["td/restored_states"])
    # one forward_backward with all of an update's datums, then one optim_step
    expected = [call for row in history if row["datums"]
                for call in (("forward_backward", row["datums"]), ("optim_step", 0))]
    assert service.calls == expected

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 6
    saved = json.loads((tmp_path / "checkpoint.json").read_text())
    assert saved["step"] == 6 and saved["store"] == "store-000006.json"
    assert sorted(p.name for p in tmp_path.glob("store-*.json")) == ["store-000006.json"]
    store = StateStore.from_json((tmp_path / saved["store"]).read_text(), 100, 100)
    assert len(store) == history[-1]["td/store_size"]

    image = plot(tmp_path)
    assert image == tmp_path / "metrics.png" and image.stat().st_size > 10_000


def test_resume_continues_weights_store_and_metrics(model: str, tmp_path: Path) -> None:
    straight = train(toy_args(model, tmp_path / "straight", td_updates=3))
    first = train(toy_args(model, tmp_path / "killed", td_updates=1))  # stops after update 3
    assert len(first) == 3
    resumed = train(toy_args(model, tmp_path / "killed", td_updates=3, resume=True))
    assert [row["step"] for row in resumed] == [3, 4]
    for mine, reference in zip(resumed, straight[3:], strict=True):
        for key in ("td/restored_states", "td/store_size", "reward_mean", "critic/abs_error_mean",
                    "is/weight_mean", "datums"):
            assert mine[key] == pytest.approx(reference[key]), key
        assert mine["loss"] == pytest.approx(reference["loss"], abs=1e-5)
    lines = (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(5))
    with pytest.raises(ValueError, match="used env_id"):
        train(toy_args(model, tmp_path / "killed", env_id="agent_gym/GSM8K-v0", resume=True))


def test_cli_arguments_and_plot_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    parsed = parser.parse_args(["train", "tempo", "--horizon", "3", "--help"])
    assert parsed.argv == ["--horizon", "3", "--help"]
    assert parser.parse_args(["train", "plot", "runs/x"]).argv == ["runs/x"]
    args = parse_args(["--horizon", "3", "--branches", "8", "--no-prefix-is",
                       "--env-kwargs", '{"max_turns": 20}'])
    assert (args.horizon, args.branches, args.prefix_is, args.env_kwargs) == (
        3, 8, False, {"max_turns": 20})
    for bad in (["--branches", "1"], ["--critic-samples", "1"], ["--fresh-fraction", "0"],
                ["--temperature", "0.7"], ["--no-prefix-is", "--temperature", "0.7"],
                ["--staleness", "0"], ["--batch-size", "1", "--fresh-fraction", "0.5"],
                ["--is-cap", "0.5"], ["--r-max", "0"], ["--backend", "nowhere"],
                ["--warmup-updates", "0", "--td-updates", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    with pytest.raises(FileNotFoundError):
        plot(tmp_path)
    with pytest.raises(SystemExit):
        main(["plot", str(tmp_path)])
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "phase": "warmup",
                                                        "critic/abs_error_mean": 0.4}) + "\n")
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "p.png")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "p.png")
    assert (tmp_path / "p.png").is_file()


def test_prefix_correction_can_be_switched_off(model: str, tmp_path: Path) -> None:
    history = train(toy_args(model, tmp_path, prefix_is=False, warmup_updates=1, td_updates=2))
    td = [row for row in history if row["phase"] == "td"]
    assert any(row["td/restored_states"] for row in td)
    assert all(row["is/weight_mean"] is None and row["is/clip_rate"] is None for row in td)


def test_tempo_runs_any_registered_env(model: str, tmp_path: Path) -> None:
    """GSM8K with several turns: nothing in TEMPO is specific to one environment."""
    assert "agent_gym/GSM8K-v0" in gymnasium.registry
    history = train(toy_args(model, tmp_path, env_id="agent_gym/GSM8K-v0",
                             env_kwargs={"max_turns": 3}, warmup_updates=1, td_updates=2,
                             branches=2, critic_samples=2, endpoint_samples=1))
    assert len(history) == 3
    assert sum(row["td/stored"] for row in history) > 0


def test_tempo_through_pytrio_client_code(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same run against pytrio's own TrainingClient and SamplingClient (sampling,
    compute_logprobs for the prefix weights, one forward_backward and optim_step per update,
    checkpoints), served by the test double of the remote side."""
    import pytrio.client.sampling
    import pytrio.client.training
    from pytrio.protocol.actor.events.event import EventType

    from tests.pytrio_double import FakePytrioServer, FakeServiceClient

    server = FakePytrioServer({"agent-gym/value-tiny": model}, tmp_path / "remote")
    monkeypatch.setattr(pytrio.client.training, "get_tokenizer", server.tokenizer)
    monkeypatch.setattr(pytrio.client.sampling, "get_tokenizer", server.tokenizer)
    args = toy_args("agent-gym/value-tiny", tmp_path / "run", backend="pytrio", lora_rank=4,
                    warmup_updates=1, td_updates=3, save_every=2)
    history = train(args, service=FakeServiceClient(server))
    assert any(row.get("td/restored_states") and row["is/weight_mean"] is not None
               for row in history)
    trained = sum(1 for row in history if row["datums"])
    assert trained and server.count(EventType.TRAINER_OPTIMIZE_STEP) == trained
    assert len(server.groups) == trained  # one forward_backward per update
    assert server.count(EventType.TRAINER_SAVE_STATE) == 2
