"""TEMPO's generative critic: strict value parsing, a bounded prompt with privileged
information, sampling on the policy's weights, and terminal states worth zero."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agent_gym.render import ChatRenderer
from agent_gym_train.backends.local import LocalServiceClient
from agent_gym_train.critic import (
    HISTORY_TURNS,
    Critic,
    critic_messages,
    parse_value,
)
from tests.helpers import tempo_toy


@pytest.fixture(scope="module")
def sampler(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return LocalServiceClient().create_sampling_client(tempo_toy.value_model(tmp_path_factory))


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
    # the reference last, next to the question: what the critic compares the history with
    assert text.index("You arrive at place 29") < text.index("go to mug 1") < text.index(
        "How much reward")


def test_critic_samples_values_and_counts_cut_replies_as_failures(sampler: Any) -> None:
    renderer = ChatRenderer(sampler.get_tokenizer())
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "go to desk 1"}]
    critic = Critic(renderer, r_max=1.0, max_tokens=16, temperature=1.0)
    prompt = critic.prompt(chat, 2, {"answer": "7"})
    samples = asyncio.run(critic.sample(sampler, prompt, 16, seed=0))
    assert len(samples) == 16
    parsed = [s.value for s in samples if s.value is not None]
    assert len(parsed) >= 8 and len(set(parsed)) >= 2  # the toy speaks values, not one value
    assert all(s.sequence.tokens[: s.sequence.spans[0].start] == tuple(prompt) for s in samples)
    (value,) = asyncio.run(critic.values(sampler, [prompt]))
    assert 0.0 <= value <= 1.0
    short = Critic(renderer, r_max=1.0, max_tokens=3, temperature=1.0)  # every reply is cut
    assert all(s.value is None for s in asyncio.run(short.sample(sampler, prompt, 4, seed=0)))


def test_terminal_states_are_worth_zero_with_nothing_scored() -> None:
    critic = Critic(None, r_max=1.0, max_tokens=4)  # type: ignore[arg-type]
    assert asyncio.run(critic.values(object(), [None, None])) == [0.0, 0.0]  # type: ignore[arg-type]
