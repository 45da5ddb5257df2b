"""The sampler policies ``agent-gym eval`` runs (agent_gym_train.policies): token-continuous prompts,
as in training; context limits; seeds."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from agent_gym.eval.policies import PolicyInput, make_policy
from agent_gym.eval.run import EvalConfig, evaluate
from agent_gym_train.backends import make_service
from agent_gym_train.policies import SamplerPolicy

GSM8K = "agent_gym/GSM8K-v0"
OPENING = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Name a colour."},
]
FOLLOW_UPS = ["Name another one.", "And one more."]


class RecordingSampler:
    """The real local sampler, keeping every prompt it is given for the assertions."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.prompts: list[list[int]] = []
        self.completions: list[list[int]] = []

    def get_tokenizer(self) -> Any:
        return self.client.get_tokenizer()

    async def sample_async(self, model_input: Any, num_samples: int, sampling_params: Any) -> Any:
        self.prompts.append(model_input.to_ints())
        response = await self.client.sample_async(
            model_input, num_samples=num_samples, sampling_params=sampling_params
        )
        self.completions.append(list(response.sequences[0].tokens))
        return response


@pytest.fixture(scope="module")
def sampler() -> Any:
    return make_service("local", threads=1).create_sampling_client("smollm2")


def _play(policy: SamplerPolicy) -> list[str]:
    """A greedy three-turn chat, each reply followed by a user turn."""
    messages = [dict(m) for m in OPENING]
    replies = []
    for turn in range(len(FOLLOW_UPS) + 1):
        reply = asyncio.run(policy.act(PolicyInput(list(messages), [], turn)))
        replies.append(reply.text)
        messages.append({"role": "assistant", "content": reply.text})
        if turn < len(FOLLOW_UPS):
            messages.append({"role": "user", "content": FOLLOW_UPS[turn]})
    return replies


def test_turn_prompts_extend_the_previous_prompt_and_reply(sampler: Any) -> None:
    recorder = RecordingSampler(sampler)
    policy = SamplerPolicy("local:smollm2", recorder, max_tokens=12)
    replies = _play(policy)
    prompts, completions = recorder.prompts, recorder.completions
    assert len(prompts) == 3
    for turn in range(2):
        # The sampled tokens are in the next prompt verbatim, right after the prompt.
        sent = prompts[turn] + completions[turn]
        assert len(prompts[turn + 1]) > len(sent)
        assert prompts[turn + 1][: len(sent)] == sent
    # Greedy outputs are what re-rendering the whole transcript every turn gave: for this
    # template and text the continued prompt is token for token the full render.
    messages = [dict(m) for m in OPENING]
    for turn, reply in enumerate(replies):
        assert prompts[turn] == policy.renderer.prompt(messages)
        messages.append({"role": "assistant", "content": reply})
        if turn < len(FOLLOW_UPS):
            messages.append({"role": "user", "content": FOLLOW_UPS[turn]})


def test_a_prompt_past_the_models_context_ends_the_episode(tmp_path: Path) -> None:
    policy = make_policy("local:tiny", max_tokens=8)
    assert policy.context_length == policy.client.context_length  # the model's positions
    config = EvalConfig(GSM8K, "local:tiny", episodes=1, max_tokens=8)
    asyncio.run(evaluate(config, policy, tmp_path / "fits", progress=False))
    first = json.loads((tmp_path / "fits" / "episodes.jsonl").read_text().splitlines()[0])
    # A context one token longer than the opening prompt leaves room for one token: the
    # reply is cut. One token shorter: the episode ends context_length, scored, no error.
    policy.context_length = first["prompt_tokens"] + 1
    summary = asyncio.run(evaluate(config, policy, tmp_path / "cut", progress=False))
    assert summary.end_reasons == {"max_tokens": 1} and summary.mean_tokens == 1
    assert summary.finish_reasons == {"length": 1}
    policy.context_length = first["prompt_tokens"]
    summary = asyncio.run(evaluate(config, policy, tmp_path / "over", progress=False))
    assert summary.errors == 0 and summary.end_reasons == {"context_length": 1}
    record = json.loads((tmp_path / "over" / "episodes.jsonl").read_text().splitlines()[0])
    assert record["turns"] == 0 and record["reward"] == 0.0
    assert "context is" in record["context_error"]
