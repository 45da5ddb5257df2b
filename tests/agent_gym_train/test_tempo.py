"""TEMPO: the signal formulas on hand-made numbers, actor datums, and short end-to-end runs
(with resume) on a toy env. The critic, the store and restored rollouts have test files of
their own."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import pytest

from agent_gym_train.advantages import group_advantages
from agent_gym_train.backends.local import LocalServiceClient
from agent_gym_train.cli import register
from agent_gym_train.critic import (
    CriticSample,
    best_constant_error,
    critic_fit,
    replay,
    value_corr,
    value_gap_zero_reward,
)
from agent_gym_train.plot import plot
from agent_gym_train.run.episode import TokenSequence
from agent_gym_train.run.store import StateStore
from agent_gym_train.tempo import (
    Args,
    actor_update,
    macro_returns,
    monte_carlo_targets,
    parse_args,
    prefix_weight,
    train,
)
from tests.agent_gym_train.test_store import hand_made_episode
from tests.helpers import grpo_toy, tempo_toy


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tempo_toy.value_model(tmp_path_factory)


# ----------------------------------------------------------------------- formulas
def test_actor_signal_on_hand_made_numbers() -> None:
    # three branches: env rewards 0, 1, 0; critic values at their ends 0.5, 0 (terminal), 0.2
    returns = macro_returns([0.0, 1.0, 0.0], [0.5, 0.0, 0.2])
    assert returns.tolist() == pytest.approx([0.5, 1.0, 0.2])
    assert returns.mean() == pytest.approx(1.7 / 3)  # G
    advantages = group_advantages(returns)
    assert advantages is not None
    assert advantages.tolist() == pytest.approx([0.5 - 1.7 / 3, 1.0 - 1.7 / 3, 0.2 - 1.7 / 3])
    weight, clipped = prefix_weight(-10.0, -10.5, cap=2.0)
    assert (weight, clipped) == (pytest.approx(math.exp(0.5)), False)
    assert (advantages * weight).tolist() == pytest.approx(
        [(r - 1.7 / 3) * math.exp(0.5) for r in (0.5, 1.0, 0.2)]
    )


def test_degenerate_groups_are_recognised() -> None:
    assert group_advantages(macro_returns([1.0, 0.0], [0.0, 1.0])) is None  # equal returns
    assert group_advantages(macro_returns([0.0, 0.0], [0.0, 1e-9])) is not None


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


# ----------------------------------------------------------------------- actor
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


def test_the_critic_trains_each_states_target_reply_and_is_judged_by_its_estimates() -> None:
    reply = TokenSequence((1, 2)).extend([1, 2], [3, 4], [-0.5, -0.1])
    greedy = TokenSequence((1, 2)).extend([1, 2], [3], [-0.5])
    # two start states, targets 0 and 1; the median readout says 0.25 and 0.75; the greedy
    # replies state a value at the first state and none at the second
    datums, metrics = critic_fit(
        [CriticSample(reply, 0.0), CriticSample(reply, 1.0)], [0.25, 0.75], [0.0, 1.0],
        [CriticSample(greedy, 0.5), CriticSample(greedy, None)])
    assert len(datums) == metrics["critic/datums"] == 2
    for datum in datums:  # weight 1 on the reply's tokens, nothing on the prompt's
        assert set(datum.loss_fn_inputs) == {"target_tokens", "weights"}
        assert datum.loss_fn_inputs["weights"].data == [0.0, 1.0, 1.0]
        assert datum.loss_fn_inputs["target_tokens"].data == [-100, 3, 4]
    assert metrics["critic/abs_error_mean"] == pytest.approx(0.25)
    # targets 0 and 1: the best constant (their median, 0.5) misses each by 0.5
    assert metrics["critic/abs_error_constant"] == pytest.approx(0.5)
    assert metrics["critic/parsed"] == metrics["critic/states"] == 2
    assert metrics["critic/value_corr"] == pytest.approx(1.0)
    assert metrics["critic/per_state"] == [[0.0, 1, 0.25], [1.0, 1, 0.75]]
    assert metrics["critic/samples"] == 2 and metrics["critic/parse_failure_rate"] == 0.5
    nothing, empty = critic_fit([], [], [], [])
    assert nothing == [] and empty["critic/abs_error_mean"] is None


def test_one_constant_for_every_update_is_the_median_of_all_their_targets() -> None:
    # update 1: one state, target 0, 2 parsed samples; update 2: target 1, 1 parsed sample.
    # Fitted to each update alone a constant is exact twice; one constant for both is the
    # median of 0, 0, 1 and misses the third sample by 1.
    first, second = [[0.0, 2, 0.1]], [[1.0, 1, 0.9]]
    assert best_constant_error(first) == best_constant_error(second) == 0.0
    assert best_constant_error(first + second) == pytest.approx(1 / 3)
    assert best_constant_error([[0.5, 0, None]]) is None  # nothing parsed


def test_warmup_values_the_openings_and_the_boundaries() -> None:
    # hand-made episodes: two turns, rewards 0 then 0.5; a second branch that won 1 at once
    two_turns = hand_made_episode()
    one_turn = TokenSequence((1, 2, 3)).extend([1, 2, 3], [4, 5], [-0.1, -0.2])
    at_once = dataclasses.replace(two_turns, sequence=one_turn, reward=1.0, step_rewards=[1.0],
                                  messages=two_turns.messages[:4], end_reason="terminated")
    asked = monte_carlo_targets([[two_turns, at_once]], horizon=1)
    # the opening is worth the mean of both returns; turn 1 of the long one its last 0.5;
    # the short one ended at its only turn, so it has no boundary
    assert [(e is two_turns, k, target) for e, k, target in asked] == [
        (True, 0, pytest.approx(0.75)), (True, 1, pytest.approx(0.5))]
    assert [k for _, k, _ in monte_carlo_targets([[two_turns]], horizon=2)] == [0]


# ----------------------------------------------------------------------- end to end
def toy_args(model: str, out: Path, **overrides: Any) -> Args:
    settings: dict[str, Any] = {
        "env_id": grpo_toy.ENV_ID, "model": model, "lora_rank": 0, "warmup_updates": 2,
        "td_updates": 4, "batch_size": 2, "horizon": 1, "branches": 4, "fresh_fraction": 0.5, "learning_rate": 1e-3, "max_tokens": 12,
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
    for row in history:  # the critic's target replies, by cross-entropy, with the replayed
        assert row["supervised_datums"] == row["critic/datums"] + row["critic/replayed"]
        assert row["critic/datums"] == row["critic/parsed"] == row["critic/states"]
    for row in warmup:  # the critic alone
        assert row["phase"] == "warmup" and "actor/datums" not in row and row["datums"] == 0
    for row in td:
        assert row["phase"] == "td" and row["td/fresh_states"] >= 1
        assert row["datums"] == row["actor/datums"]
        assert 0 <= row["actor/degenerate_group_rate"] <= 1
        for key in ("critic/abs_error_mean", "critic/value_corr", "critic/parse_failure_rate",
                    "actor/value_gap_zero_reward", "td/store_size", "is/weight_mean",
                    "is/clip_rate"):
            assert key in row
    assert sum(row["td/restored_states"] for row in td) >= 2
    assert any(row["actor/datums"] for row in td)
    assert all(row["is/weight_mean"] is not None for row in td if row["td/restored_states"])
    # the actor's datums (if any), then the critic's, then one optim_step
    expected = [call for row in history
                for call in ([("forward_backward", row["datums"])] if row["datums"] else [])
                + [("forward_backward", row["supervised_datums"]), ("optim_step", 0)]]
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


def test_critic_replay_retrains_earlier_warmup_states_every_later_update(
    model: str, tmp_path: Path
) -> None:
    service = CountingService()
    history = train(toy_args(model, tmp_path, warmup_updates=3, td_updates=2, critic_replay=3),
                    service)
    warm = [row["critic/states"] for row in history if row["phase"] == "warmup"]
    for step, row in enumerate(history):
        pool = sum(warm[:step])  # warm-up states fitted before this update
        assert row["critic/replayed"] == min(3, pool)
        assert row["supervised_datums"] == row["critic/datums"] + row["critic/replayed"]
    assert history[-1]["critic/replayed"] == 3
    with pytest.raises(SystemExit):
        parse_args(["--critic-replay", "-1"])
    # killed after the warm-up and resumed: the pool comes back with the store
    killed = tmp_path / "killed"
    settings = {"warmup_updates": 2, "critic_replay": 50}
    first = train(toy_args(model, killed, td_updates=0, **settings))
    pool = sum(row["critic/states"] for row in first)
    resumed = train(toy_args(model, killed, td_updates=1, **settings))
    assert [row["step"] for row in resumed] == [2] and resumed[0]["critic/replayed"] == pool


def test_replay_draws_so_the_update_fits_the_pools_mix_of_targets() -> None:
    pool = [(f"zero {i}", 0.0) for i in range(6)] + [("one 0", 1.0), ("one 1", 1.0)]
    rng = np.random.default_rng(0)
    # this update found two ones: the pool's mix (a quarter ones) over 6 datums asks for
    # 4.5 -> 4 zeros and 1.5 -> 2 ones, which it holds already, so 4 zeros are replayed
    assert all(d.startswith("zero") for d in replay(pool, 4, [1.0, 1.0], rng))
    # found zeros: both ones come back, the rest are zeros
    assert sum(d.startswith("one") for d in replay(pool, 3, [0.0] * 5, rng)) == 2
    # leftover places are drawn at random, never twice; a larger count is the whole pool
    assert sorted(replay(pool, 20, [], rng)) == sorted(d for d, _ in pool)
    assert replay([], 4, [0.0], rng) == [] and replay(pool, 0, [0.0], rng) == []


def test_resume_continues_weights_store_and_metrics(model: str, tmp_path: Path) -> None:
    straight = train(toy_args(model, tmp_path / "straight", td_updates=3))
    first = train(toy_args(model, tmp_path / "killed", td_updates=1))  # stops after update 3
    assert len(first) == 3
    resumed = train(toy_args(model, tmp_path / "killed", td_updates=3))
    assert [row["step"] for row in resumed] == [3, 4]
    for mine, reference in zip(resumed, straight[3:], strict=True):
        for key in ("td/restored_states", "td/store_size", "reward_mean", "critic/abs_error_mean",
                    "is/weight_mean", "datums"):
            # Float figures agree to float precision, not bit for bit: the resumed sampler's
            # prefix cache is empty, so its prompts are prefilled in other pieces. The prefix
            # importance weight is the exp of a sum of logprob differences over a whole
            # prefix, where those differences add up (one clean run measured 1.1e-4).
            rel = 1e-3 if key == "is/weight_mean" else 1e-4
            assert mine[key] == pytest.approx(reference[key], rel=rel), key
        assert mine["loss"] == pytest.approx(reference["loss"], abs=1e-5)
    lines = (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(5))
    with pytest.raises(ValueError, match="holds a run with env_id"):
        train(toy_args(model, tmp_path / "killed", env_id="agent_gym/GSM8K-v0"))


def test_cli_arguments() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    parsed = parser.parse_args(["train", "tempo", "--horizon", "3", "--help"])
    assert parsed.argv == ["--horizon", "3", "--help"]
    args = parse_args(["--horizon", "3", "--branches", "8", "--env-kwargs", '{"max_turns": 20}'])
    assert (args.horizon, args.branches, args.env_kwargs) == (3, 8, {"max_turns": 20})
    assert (args.env_id, args.batch_size, args.max_turns) == ("agent_gym/ALFWorld-v0", 4, None)
    assert args.critic_replay == 8
    for bad in (["--branches", "1"], ["--fresh-fraction", "0"], ["--temperature", "0.7"],
                ["--critic-loss", "reward"], ["--critic-readout", "samples"],
                ["--staleness", "0"], ["--batch-size", "1", "--fresh-fraction", "0.5"],
                ["--is-cap", "0.5"], ["--r-max", "0"], ["--backend", "nowhere"],
                ["--warmup-updates", "0", "--td-updates", "0"], ["--batch-size", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_tempo_runs_any_registered_env(model: str, tmp_path: Path) -> None:
    """GSM8K with several turns: nothing in TEMPO is specific to one environment."""
    assert "agent_gym/GSM8K-v0" in gymnasium.registry
    history = train(toy_args(model, tmp_path, env_id="agent_gym/GSM8K-v0",
                             env_kwargs={"max_turns": 3}, warmup_updates=1, td_updates=2,
                             branches=2))
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

    from tests.helpers.pytrio_double import FakePytrioServer, FakeServiceClient

    server = FakePytrioServer({"agent-gym/value-tiny": model}, tmp_path / "remote")
    monkeypatch.setattr(pytrio.client.training, "get_tokenizer", server.tokenizer)
    monkeypatch.setattr(pytrio.client.sampling, "get_tokenizer", server.tokenizer)
    args = toy_args("agent-gym/value-tiny", tmp_path / "run", backend="pytrio", lora_rank=4,
                    warmup_updates=1, td_updates=3, save_every=2)
    history = train(args, service=FakeServiceClient(server))
    assert any(row.get("td/restored_states") and row["is/weight_mean"] is not None
               for row in history)
    # every update trains the critic; an update with actor datums sends them first
    assert server.count(EventType.TRAINER_OPTIMIZE_STEP) == len(history)
    assert len(server.groups) == len(history) + sum(1 for row in history if row["datums"])
    assert server.count(EventType.TRAINER_SAVE_STATE) == 2


def test_warmup_finds_boundary_states_when_every_reply_is_cut(tmp_path: Path) -> None:
    """Search-v0 with a random model and one token per reply: every reply is cut. Shown to
    the env, the cut replies are invalid searches, the episodes reach their turn budget and
    turn H is a state (had a cut ended its episode, warm-up would have found none, as the
    embedded model's did on ALFWorld-v0)."""
    args = Args(env_id="agent_gym/Search-v0", env_kwargs={"max_turns": 4}, model="tiny",
                lora_rank=0, warmup_updates=1, td_updates=0, batch_size=2, horizon=2,
                branches=2, max_tokens=1, critic_max_tokens=2, max_trajectory_tokens=4096,
                out=str(tmp_path), progress=False)
    went_on = train(args)[0]
    assert went_on["cut_replies"] == 4 * 4 and went_on["end_reasons"] == {"truncated": 4}
    assert went_on["warmup/boundary_states"] == 4 and went_on["td/stored"] == 4
    assert went_on["critic/states"] == 4
