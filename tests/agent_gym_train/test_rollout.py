"""Rollouts: budgets, cut replies, shared first prompts, and branches restored from a
resume point (exact token prefix, checked chat, verified env replay)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import gymnasium
import pytest
from pytrio import ModelInput

from agent_gym.env.state import StateMismatchError
from agent_gym.render import ChatRenderer, window_messages
from agent_gym_train.backends.local import LocalServiceClient
from agent_gym_train.run.episode import build_datum
from agent_gym_train.run.rollout import RolloutConfig, RolloutError, rollout_group, rollout_metrics
from agent_gym_train.run.store import cut
from tests.helpers import grpo_toy, tempo_toy


@pytest.fixture(scope="module")
def digit_sampler(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = grpo_toy.save_tiny_model(tmp_path_factory.mktemp("toy-model"))
    return LocalServiceClient().create_sampling_client(model)


@pytest.fixture(scope="module")
def value_sampler(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return LocalServiceClient().create_sampling_client(tempo_toy.value_model(tmp_path_factory))


def test_rollout_never_scores_a_cut_reply(digit_sampler: Any) -> None:
    renderer = ChatRenderer(digit_sampler.get_tokenizer())
    config = RolloutConfig(group_size=16, max_turns=2, max_tokens=2, max_trajectory_tokens=64)
    episodes = asyncio.run(
        rollout_group(lambda: gymnasium.make(grpo_toy.ENV_ID), {"index": 0}, digit_sampler,
                      renderer, config, seed=3)
    )
    assert len(episodes) == 16
    cut_short = [e for e in episodes if e.end_reason == "max_tokens"]
    assert cut_short, "with 2 tokens per reply some replies must be cut"
    for episode in episodes:
        assert 1 <= episode.turns <= 2
        replies = [episode.sequence.completion(i) for i in range(episode.turns)]
        assert all(renderer.is_finished(reply) for reply in replies[:-1])
        if episode.end_reason == "max_tokens":
            assert not renderer.is_finished(replies[-1])
            assert episode.reward == 0.0
            # the cut reply was never shown to the env: the transcript ends with it
            assert episode.messages[-1]["role"] == "assistant"
        build_datum(episode.sequence, 1.0)
    first_prompts = {e.sequence.tokens[: e.sequence.spans[0].start] for e in episodes}
    assert len(first_prompts) == 1  # all branches shared the first prompt
    metrics = rollout_metrics(episodes)
    assert metrics["cut_rate"] == len(cut_short) / 16 and metrics["episodes"] == 16
    assert sum(metrics["end_reasons"].values()) == 16


def test_a_cut_reply_can_be_shown_to_the_env_and_the_episode_goes_on(digit_sampler: Any) -> None:
    """With ``cut_continues`` a cut reply is closed (the end of turn is context, not sample),
    the env judges its text and the episode lives on to its turn budget."""
    renderer = ChatRenderer(digit_sampler.get_tokenizer())
    config = RolloutConfig(group_size=8, max_turns=3, max_tokens=1, max_trajectory_tokens=256,
                           cut_continues=True)
    episodes = asyncio.run(
        rollout_group(lambda: grpo_toy.SayDigitEnv(max_turns=3), {"index": 0}, digit_sampler,
                      renderer, config, seed=3)
    )
    assert all(e.end_reason != "max_tokens" for e in episodes)
    assert sum(e.cut_replies for e in episodes) > 0
    for episode in episodes:
        replies = [episode.sequence.completion(i) for i in range(episode.turns)]
        assert episode.cut_replies == sum(not renderer.is_finished(r) for r in replies)
        assert all(len(r) == 1 for r in replies)  # the closing tokens were never sampled
        if episode.end_reason == "max_turns":
            assert episode.turns == 3
        # every reply, cut or not, was answered by the env
        assert [m["role"] for m in episode.messages[-2:]] == ["assistant", "user"]
        build_datum(episode.sequence, 1.0)
    assert rollout_metrics(episodes)["cut_replies"] == sum(e.cut_replies for e in episodes)


def test_trajectory_budget_is_respected(digit_sampler: Any) -> None:
    renderer = ChatRenderer(digit_sampler.get_tokenizer())
    config = RolloutConfig(group_size=8, max_turns=5, max_tokens=8, max_trajectory_tokens=24)
    episodes = asyncio.run(
        rollout_group(lambda: grpo_toy.SayDigitEnv(max_turns=5), {"index": 1}, digit_sampler,
                      renderer, config, seed=5)
    )
    for episode in episodes:
        assert len(episode.sequence.tokens) <= 24
    too_small = RolloutConfig(group_size=2, max_trajectory_tokens=3)
    starved = asyncio.run(
        rollout_group(lambda: grpo_toy.SayDigitEnv(), None, digit_sampler, renderer, too_small)
    )
    assert [e.end_reason for e in starved] == ["trajectory_budget"] * 2
    assert all(e.turns == 0 for e in starved)
    assert rollout_metrics([])["reward_mean"] is None


def test_restored_branches_continue_the_saved_tokens_and_are_checked(value_sampler: Any) -> None:
    sampler = value_sampler
    renderer = ChatRenderer(sampler.get_tokenizer())
    config = RolloutConfig(group_size=6, max_turns=1, max_tokens=12, max_trajectory_tokens=512,
                           keep_states=True)
    make_env = grpo_toy.SayDigitEnv
    first = asyncio.run(rollout_group(make_env, {"index": 0}, sampler, renderer, config, seed=1))
    stopped = [e for e in first if e.end_reason == "max_turns"]
    assert stopped, [e.end_reason for e in first]
    point = cut(stopped[0], 1, version=0)
    assert point.observation == "no"

    # the sampled prefix tokens are where the spans say: the same policy scores them as sampled
    logprobs = sampler.compute_logprobs(ModelInput.from_ints(list(point.sequence.tokens))).result()
    assert point.sequence.score(logprobs) == pytest.approx(point.sequence.logprob_sum, abs=1e-3)

    branches = asyncio.run(rollout_group(make_env, point, sampler, renderer, config, seed=2))
    for episode in branches:
        assert episode.start is point
        assert episode.sequence.tokens[: len(point.sequence.tokens)] == point.sequence.tokens
        assert episode.sequence.spans[0].start == len(point.sequence.tokens)  # prefix: context
        assert episode.messages[: len(point.messages)] == list(point.messages)
        assert episode.end_reason in ("terminated", "truncated", "max_tokens")  # 2 turns at most
        assert episode.env_state.actions[:1] == point.state.actions

    tampered = dataclasses.replace(point, messages=(*point.messages[:-1],
                                                    {"role": "user", "content": "yes"}))
    with pytest.raises(RolloutError, match="shows 'no', the saved state showed 'yes'"):
        asyncio.run(rollout_group(make_env, tampered, sampler, renderer, config))
    messages = [dict(m) for m in point.messages]
    messages[1]["content"] = "something else"
    with pytest.raises(RolloutError, match="differs from the saved one at message 1"):
        asyncio.run(rollout_group(make_env, dataclasses.replace(point, messages=tuple(messages)),
                                  sampler, renderer, config))
    wrong = dataclasses.replace(point.state, digests=(point.state.digests[0], "0" * 16))
    with pytest.raises(StateMismatchError):
        asyncio.run(rollout_group(make_env, dataclasses.replace(point, state=wrong), sampler,
                                  renderer, config))


def test_history_window_cuts_restart_the_prompt_as_eval_cuts_it(digit_sampler: Any) -> None:
    """Past the window every turn restarts the token-continuous prompt from exactly the chat
    eval would show (agent_gym.render.window_messages); each piece trains as a Datum."""
    renderer = ChatRenderer(digit_sampler.get_tokenizer())
    config = RolloutConfig(group_size=8, max_turns=5, max_tokens=16,
                           max_trajectory_tokens=512, history_window=1)
    episodes = asyncio.run(rollout_group(
        lambda: gymnasium.make(grpo_toy.ENV_ID, max_turns=5), {"index": 3}, digit_sampler,
        renderer, config, seed=1))
    long = [e for e in episodes if e.turns >= 3]
    assert long, "some branches must play past the window"
    for episode in episodes:
        opening = episode.messages[: episode.opening_messages]
        assert len(episode.earlier) == max(0, episode.turns - 2)
        assert sum(len(s.spans) for s in episode.sequences) == episode.turns
        # The transcript is whole: every reply and answer, cut or not.
        assert sum(m["role"] == "assistant" for m in episode.messages) == episode.turns
        for piece, sequence in enumerate(episode.sequences[1:], start=1):
            turn = piece + 1  # the turn (0-based) whose prompt this piece opened with
            shown = window_messages(episode.messages[: episode.opening_messages + 2 * turn],
                                    episode.opening_messages, 1)
            assert shown[: len(opening)] == opening and len(shown) == len(opening) + 2
            assert list(sequence.tokens[: sequence.spans[0].start]) == renderer.prompt(shown)
        for sequence in episode.sequences:
            build_datum(sequence, 1.0)
    with pytest.raises(ValueError, match="keep_states"):
        RolloutConfig(history_window=2, keep_states=True)
