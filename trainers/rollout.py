"""Async multi-turn rollouts of a sampler in agent_gym environments.

A *group* is N branches of one task. All branches reset to the same task and open with the
same chat, so they share the first prompt and its first sampling call (``num_samples=N``:
one prefill for all of them); from then on each branch continues on its own, turn by turn,
with token-continuous prompts (``trainers.render``). Environment calls run in worker
threads so slow tools (sandboxes, search, ALFWorld) overlap with sampling.

Budgets: ``max_turns`` replies per branch, ``max_tokens`` per reply and
``max_trajectory_tokens`` for the whole sequence (prompt plus everything after it). A reply
that does not end with the template's stop token was cut by a budget: it is never shown to
the environment, so it can never be scored as an answer. The episode ends there with
``end_reason="max_tokens"`` and ``cut_reward`` added to what the env already paid.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import gymnasium
from pytrio import ModelInput, SamplingParams
from pytrio.types import SampleResponse, SampleSequence

from trainers.episode import Episode, Turn
from trainers.render import ChatRenderer, Conversation

EnvFactory = Callable[[], gymnasium.Env]


class Sampler(Protocol):
    """What rollouts need from a sampling client (pytrio's or the local one)."""

    async def sample_async(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams = ...,
    ) -> SampleResponse: ...


class RolloutError(RuntimeError):
    """The environment or sampler broke the rollout contract."""


@dataclass(frozen=True)
class RolloutConfig:
    """Budgets and sampling settings of one rollout group."""

    group_size: int = 8
    max_turns: int = 1
    max_tokens: int = 512
    max_trajectory_tokens: int = 8192
    temperature: float = 1.0
    top_p: float = 1.0
    cut_reward: float = 0.0

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.max_turns < 1 or self.max_tokens < 1:
            raise ValueError("group_size, max_turns and max_tokens must be at least 1")
        if self.max_trajectory_tokens < 2:
            raise ValueError("max_trajectory_tokens must be at least 2")


async def rollout_group(
    make_env: EnvFactory,
    reset_options: Mapping[str, Any] | None,
    sampler: Sampler,
    renderer: ChatRenderer,
    config: RolloutConfig,
    *,
    seed: int = 0,
) -> list[Episode]:
    """Roll out ``config.group_size`` branches of one task; returns their episodes."""
    envs = await asyncio.gather(
        *(asyncio.to_thread(make_env) for _ in range(config.group_size))
    )
    try:
        openings = await asyncio.gather(
            *(asyncio.to_thread(env.reset, seed=seed, options=dict(reset_options or {}))
              for env in envs)
        )
        info = openings[0][1]
        for _, other in openings[1:]:
            if (other["task_id"], other["messages"]) != (info["task_id"], info["messages"]):
                raise RolloutError("branches of one group opened with different tasks or chats")
        root = Conversation.start(renderer, info["messages"], info.get("tools"))
        room = config.max_trajectory_tokens - len(root.tokens)
        if room < 1:
            return [
                Episode(info["task_id"], [], config.cut_reward, "trajectory_budget", root.messages)
                for _ in envs
            ]
        first = await sampler.sample_async(
            ModelInput.from_ints(root.tokens),
            num_samples=config.group_size,
            sampling_params=_params(config, renderer, min(config.max_tokens, room), seed, 0, 0),
        )
        if len(first.sequences) != config.group_size:
            raise RolloutError(
                f"asked for {config.group_size} samples, got {len(first.sequences)}"
            )
        return list(
            await asyncio.gather(
                *(
                    _branch(env, root.fork(), sequence, info["task_id"], sampler, renderer,
                            config, seed, index)
                    for index, (env, sequence) in enumerate(
                        zip(envs, first.sequences, strict=True)
                    )
                )
            )
        )
    finally:
        for env in envs:
            env.close()


async def rollout_groups(
    make_env: EnvFactory,
    resets: Sequence[Mapping[str, Any] | None],
    sampler: Sampler,
    renderer: ChatRenderer,
    config: RolloutConfig,
    *,
    seeds: Sequence[int],
    concurrency: int = 8,
) -> list[list[Episode]]:
    """Several groups at once (at most ``concurrency`` in flight), in input order."""
    if len(resets) != len(seeds):
        raise ValueError("one seed per group is needed")
    gate = asyncio.Semaphore(concurrency)

    async def one(options: Mapping[str, Any] | None, seed: int) -> list[Episode]:
        async with gate:
            return await rollout_group(make_env, options, sampler, renderer, config, seed=seed)

    return list(await asyncio.gather(*(one(o, s) for o, s in zip(resets, seeds, strict=True))))


async def _branch(
    env: gymnasium.Env,
    conversation: Conversation,
    sequence: SampleSequence,
    task_id: str,
    sampler: Sampler,
    renderer: ChatRenderer,
    config: RolloutConfig,
    seed: int,
    branch: int,
) -> Episode:
    turns: list[Turn] = []
    reward = 0.0
    invalid = 0
    while True:
        turns.append(
            Turn(list(conversation.tokens), list(sequence.tokens), list(sequence.logprobs),
                 sequence.stop_reason)
        )
        if not renderer.is_finished(sequence.tokens):
            return _episode(task_id, turns, reward + config.cut_reward, "max_tokens", invalid,
                            conversation, renderer, sequence.tokens, None)
        action = renderer.completion_text(sequence.tokens)
        _, step_reward, terminated, truncated, info = await asyncio.to_thread(env.step, action)
        reward += float(step_reward)
        invalid += int(bool(info.get("invalid", False)))
        message = info["message"]
        end = (
            "terminated" if terminated
            else "truncated" if truncated
            else "max_turns" if len(turns) >= config.max_turns
            else None
        )
        if end is not None:
            return _episode(task_id, turns, reward, end, invalid, conversation, renderer,
                            sequence.tokens, message)
        prompt = conversation.append(sequence.tokens, [message])
        room = config.max_trajectory_tokens - len(prompt)
        if room < 1:
            return _episode(task_id, turns, reward, "trajectory_budget", invalid, conversation,
                            renderer, None, None)
        response = await sampler.sample_async(
            ModelInput.from_ints(prompt),
            num_samples=1,
            sampling_params=_params(config, renderer, min(config.max_tokens, room), seed,
                                    branch, len(turns)),
        )
        sequence = response.sequences[0]


def _episode(
    task_id: str,
    turns: list[Turn],
    reward: float,
    end_reason: str,
    invalid: int,
    conversation: Conversation,
    renderer: ChatRenderer,
    last_completion: Sequence[int] | None,
    last_message: Mapping[str, Any] | None,
) -> Episode:
    messages = list(conversation.messages)
    if last_completion is not None:
        messages.append(
            {"role": "assistant", "content": renderer.completion_text(last_completion)}
        )
    if last_message is not None:
        messages.append(dict(last_message))
    return Episode(task_id, turns, reward, end_reason, messages, invalid)


def _params(
    config: RolloutConfig, renderer: ChatRenderer, max_tokens: int, seed: int, branch: int,
    turn: int,
) -> SamplingParams:
    # Seeds depend only on (group seed, branch, turn), not on scheduling order, so a rerun
    # on a deterministic backend reproduces every sample.
    key = hashlib.blake2b(f"{seed}/{branch}/{turn}".encode(), digest_size=4).digest()
    return SamplingParams(
        max_tokens=max_tokens,
        seed=int.from_bytes(key, "little") & 0x7FFFFFFF,
        stop=list(renderer.stop_tokens),
        temperature=config.temperature,
        top_p=config.top_p,
    )
