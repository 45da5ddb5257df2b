"""TEMPO's critic with a prefilled value tag: the prompt, the parse, and the embedded model."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import gymnasium
import pytest
from pytrio import ModelInput, SamplingParams
from pytrio.types import SampleResponse, SampleSequence

from agent_gym.render import ChatRenderer
from agent_gym_train.backends.local import LocalServiceClient
from agent_gym_train.critic import ANSWER_NOW, THINK_FIRST, VALUE_PREFILL, Critic
from tests.helpers.chat_templates import smollm2_tokenizer

CHAT = [{"role": "system", "content": "You are a robot."},
        {"role": "user", "content": "Your task is to: put a mug in the coffeemachine."}]


class ScriptedSampler:
    """Replies with fixed texts (one per sample) and records the sampling call."""

    def __init__(self, renderer: ChatRenderer, replies: list[tuple[str, str]]) -> None:
        self.renderer = renderer
        self.replies = replies
        self.params: SamplingParams | None = None

    async def sample_async(self, prompt: ModelInput, num_samples: int = 1,
                           sampling_params: SamplingParams = ...) -> SampleResponse:
        self.params = sampling_params
        sequences = []
        for text, reason in self.replies[:num_samples]:
            tokens = self.renderer.encode(text)
            sequences.append(SampleSequence(stop_reason=reason, tokens=tokens,
                                            logprobs=[-0.1] * len(tokens)))
        return SampleResponse(sequences=sequences, prompt_logprobs=[], input_tokens=0,
                              output_tokens=0)


def test_the_prompt_ends_with_the_opened_tag_and_asks_for_the_value_only() -> None:
    renderer = ChatRenderer(smollm2_tokenizer())
    prefilled = Critic(renderer, r_max=1.0, max_tokens=8, temperature=1.0)
    plain = Critic(renderer, r_max=1.0, max_tokens=8, temperature=1.0, prefill=False)
    tokens = prefilled.prompt(CHAT, 2, {"walkthrough": ["go to mug 1"]})
    reference = plain.prompt(CHAT, 2, {"walkthrough": ["go to mug 1"]})
    opened = renderer.encode(VALUE_PREFILL)
    assert tokens[-len(opened):] == opened
    assert renderer.tokenizer.decode(tokens).endswith("<|im_start|>assistant\n<value>")
    assert ANSWER_NOW in renderer.tokenizer.decode(tokens)
    assert THINK_FIRST in renderer.tokenizer.decode(reference)
    assert reference[-len(opened):] != opened


def test_a_prefilled_reply_parses_from_its_first_tokens_and_trains_only_them() -> None:
    renderer = ChatRenderer(smollm2_tokenizer())
    critic = Critic(renderer, r_max=1.0, max_tokens=8, temperature=1.0)
    prompt = critic.prompt(CHAT, 2, {})
    sampler = ScriptedSampler(renderer, [
        ("0.25</value>", "stop"),  # stopped at the closing tag
        ("0.5</value><|im_end|>", "stop"),
        ("0.5<|im_end|>", "stop"),  # ended without closing the tag: strict, a failure
        ("0.75</val", "length"),  # cut: a failure, whatever it says
        ("high</value>", "stop"),  # not a number
    ])
    samples = asyncio.run(critic.sample(sampler, prompt, 5, seed=0))
    assert [s.value for s in samples] == [0.25, 0.5, None, None, None]
    assert sampler.params is not None and "</value>" in sampler.params.stop
    for sample in samples:  # the prefill is prompt context: never a sampled, trained token
        (span,) = sample.sequence.spans
        assert list(sample.sequence.tokens[: span.start]) == prompt
        reply = renderer.completion_text(list(sample.sequence.completion(0)))
        assert not reply.startswith("<value>")


def test_the_embedded_model_answers_when_prefilled(tmp_path: Any) -> None:
    """SmolLM2-135M on real ALFWorld-v0 critic prompts, untrained, 8 tokens per reply:
    without the prefill none of its replies parsed (0/32, 64 tokens each, measured); with
    it at least a third do, which gives warm-up a signal to train on."""
    sampler = LocalServiceClient(checkpoint_dir=tmp_path).create_sampling_client("smollm2")
    renderer = ChatRenderer(sampler.get_tokenizer())
    critic = Critic(renderer, r_max=1.0, max_tokens=8, temperature=1.0)
    env = gymnasium.make("agent_gym/ALFWorld-v0")
    parsed = 0
    try:
        for index in range(2):
            _, info = env.reset(options={"index": index})
            prompt = critic.prompt(info["messages"], len(info["messages"]), info["privileged"])
            samples = asyncio.run(critic.sample(sampler, prompt, 8, seed=index))
            parsed += sum(s.value is not None for s in samples)
    finally:
        env.close()
    assert parsed >= 6, parsed


def test_the_target_reply_states_the_target_and_carries_the_current_logprobs() -> None:
    """Scored by a real sampler (the tiny model, SmolLM2's tokenizer): the reply's span
    holds exactly what ``compute_logprobs`` gives its tokens after the prompt."""
    sampler = LocalServiceClient().create_sampling_client("tiny")
    renderer = ChatRenderer(smollm2_tokenizer())
    critic = Critic(renderer, r_max=1.0, max_tokens=8, temperature=1.0)
    prompt = critic.prompt(CHAT, 2, {})
    reply = asyncio.run(critic.target_reply(sampler, prompt, 1 / 3))
    assert reply.value == 0.33
    (span,) = reply.sequence.spans
    assert list(reply.sequence.tokens[: span.start]) == prompt  # the prefill stays context
    assert renderer.tokenizer.decode(list(reply.sequence.completion(0))) == "0.33</value>"
    scored = sampler.compute_logprobs(ModelInput.from_ints(list(reply.sequence.tokens)))
    assert span.logprobs == pytest.approx(scored.result()[span.start:])
    # a target outside [0, R_max] (a TD return over R_max) is stated at the nearest bound
    assert asyncio.run(critic.target_reply(sampler, prompt, 1.7)).value == 1.0


class ScoredSampler:
    """Scores each reply stating a value by a fixed probability (on its last token)."""

    def __init__(self, renderer: ChatRenderer, prompt: list[int],
                 probabilities: dict[str, float]) -> None:
        self.renderer, self.prompt, self.probabilities = renderer, prompt, probabilities

    async def compute_logprobs_async(self, prompt: ModelInput) -> list[float | None]:
        tokens = prompt.to_ints()
        stated = self.renderer.tokenizer.decode(tokens[len(self.prompt):])
        chance = self.probabilities[stated.removesuffix("</value>")]
        return [None, *[0.0] * (len(tokens) - 2), math.log(chance)]


@pytest.mark.parametrize(("probabilities", "median"), [
    # mode 0, mean 0.5, but half the mass is at 0.75 or above: the median is 0.75
    ({"0": 0.45, "0.25": 0.01, "0.5": 0.01, "0.75": 0.13, "1": 0.40}, 0.75),
    ({"0": 0.2, "0.25": 0.2, "0.5": 0.2, "0.75": 0.2, "1": 0.2}, 0.5),
    ({"0": 0.7, "0.25": 0.0001, "0.5": 0.0001, "0.75": 0.0001, "1": 0.2997}, 0.0),
])
def test_the_median_readout_reads_the_middle_of_the_scored_replies(
    probabilities: dict[str, float], median: float
) -> None:
    renderer = ChatRenderer(smollm2_tokenizer())
    critic = Critic(renderer, r_max=1.0, max_tokens=8)
    prompt = critic.prompt(CHAT, 2, {})
    sampler = ScoredSampler(renderer, prompt, probabilities)
    assert asyncio.run(critic.median(sampler, prompt)) == median
    assert asyncio.run(critic.values(sampler, [prompt, None])) == [median, 0.0]
    doubled = Critic(renderer, r_max=2.0, max_tokens=8)
    stated = {str(2 * float(k)).removesuffix(".0"): p for k, p in probabilities.items()}
    scaled = ScoredSampler(renderer, doubled.prompt(CHAT, 2, {}), stated)
    assert asyncio.run(doubled.median(scaled, doubled.prompt(CHAT, 2, {}))) == 2 * median
