"""Async multi-turn rollouts of a sampler in agent_gym environments.

A *group* is N branches of one task. All branches reset to the same task and open with the
same chat, so they share the first prompt and its first sampling call (``num_samples=N``:
one prefill for all of them); from then on each branch continues on its own, turn by turn,
with token-continuous prompts (``agent_gym.render``). Environment calls run in worker
threads so slow tools (sandboxes, search, ALFWorld) overlap with sampling.

Budgets: ``max_turns`` replies per branch, ``max_tokens`` per reply and
``max_trajectory_tokens`` for the whole sequence (prompt plus everything after it). A reply
that does not end with the template's stop token was cut by a budget: it is never shown to
the environment, so it can never be scored as an answer. The episode ends there with
``end_reason="max_tokens"`` and ``cut_reward`` added to what the env already paid.

Macro-steps (TEMPO) use the same engine: ``resume`` starts every branch from a saved env
state and the exact prompt tokens that led there instead of from a fresh task, each
restored branch must reproduce the saved chat message for message (the env's replay
already checks every observation digest), and ``max_turns`` is the macro-step's horizon.
With ``keep_states`` each episode records its final env state and, when it stopped at the
horizon, the prompt to continue from.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import gymnasium
from pytrio import ModelInput, SamplingParams
from pytrio.types import SampleResponse, SampleSequence

from agent_gym.render import ChatRenderer, Conversation
from agent_gym.state import EnvState
from trainers.episode import Episode, Turn

EnvFactory = Callable[[], gymnasium.Env]


class Sampler(Protocol):
    """What rollouts need from a sampling client (pytrio's or the local one)."""

    async def sample_async(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams = ...,
    ) -> SampleResponse: ...


def env_factory(env_id: str, env_kwargs: Mapping[str, Any], ray: str | None) -> EnvFactory:
    """Envs in this process, or each in a Ray actor (``ray``: ``"local"`` or an address).

    With Ray the env work (engines, sandboxes) spreads over the cluster while sampling
    stays asynchronous in this process.
    """
    if ray is None:
        return functools.partial(gymnasium.make, env_id, **env_kwargs)
    from agent_gym.distributed import remote_env_factory

    return remote_env_factory(env_id, dict(env_kwargs), ray)


class EnvPool:
    """Environments kept open across rollout groups; call it as the ``make_env`` factory.

    ``rollout_group`` makes its branches' envs and closes them when the group ends. With a
    pool, "make" hands out an idle env (building one only when none is idle) and "close"
    gives it back, so an expensive env (an ALFWorld engine loads its game and a private
    copy of fast-downward) is built once per concurrent branch, not once per group. Call
    ``close()`` on the pool when done.
    """

    def __init__(self, make_env: EnvFactory) -> None:
        self._make = make_env
        self._idle: list[gymnasium.Env] = []
        self._built: list[gymnasium.Env] = []
        self._lock = threading.Lock()

    def __call__(self) -> gymnasium.Env:
        with self._lock:
            env = self._idle.pop() if self._idle else None
        if env is None:
            env = self._make()
            with self._lock:
                self._built.append(env)
        return _Borrowed(env, self._give_back)

    def _give_back(self, env: gymnasium.Env) -> None:
        with self._lock:
            self._idle.append(env)

    def close(self) -> None:
        with self._lock:
            built, self._built, self._idle = self._built, [], []
        for env in built:
            env.close()


class _Borrowed(gymnasium.Wrapper):
    """A pooled env whose ``close`` returns it to the pool instead of closing it."""

    def __init__(self, env: gymnasium.Env, give_back: Callable[[gymnasium.Env], None]) -> None:
        super().__init__(env)
        self._give_back = give_back

    def close(self) -> None:
        self._give_back(self.env)


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
    keep_states: bool = False

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.max_turns < 1 or self.max_tokens < 1:
            raise ValueError("group_size, max_turns and max_tokens must be at least 1")
        if self.max_trajectory_tokens < 2:
            raise ValueError("max_trajectory_tokens must be at least 2")


@dataclass(frozen=True)
class Resume:
    """A point to continue branches from: a saved env state, the exact prompt tokens the
    policy had there (ending with a generation prompt) and the chat they render, whose last
    message is the observation the saved episode showed."""

    state: EnvState
    tokens: Sequence[int]
    messages: Sequence[Mapping[str, Any]]

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError("a resume point needs its prompt tokens")
        if not self.messages or "content" not in self.messages[-1]:
            raise ValueError("a resume point needs the chat ending with the saved observation")


async def rollout_group(
    make_env: EnvFactory,
    reset_options: Mapping[str, Any] | None,
    sampler: Sampler,
    renderer: ChatRenderer,
    config: RolloutConfig,
    *,
    seed: int = 0,
    resume: Resume | None = None,
) -> list[Episode]:
    """Roll out ``config.group_size`` branches of one task (or from ``resume``)."""
    if resume is not None and reset_options:
        raise ValueError("pass either reset_options or resume, not both")
    options = {"state": resume.state} if resume is not None else dict(reset_options or {})
    envs = await asyncio.gather(
        *(asyncio.to_thread(make_env) for _ in range(config.group_size))
    )
    try:
        openings = await asyncio.gather(
            *(asyncio.to_thread(env.reset, seed=seed, options=dict(options)) for env in envs)
        )
        info = openings[0][1]
        for _, other in openings[1:]:
            if (other["task_id"], other["messages"]) != (info["task_id"], info["messages"]):
                raise RolloutError("branches of one group opened with different tasks or chats")
        if resume is None:
            root = Conversation.start(renderer, info["messages"], info.get("tools"))
        else:
            for index, (observation, restored) in enumerate(openings):
                _check_restored(index, observation, restored, resume)
            root = Conversation(
                renderer, [dict(m) for m in info["messages"]],
                [dict(t) for t in info.get("tools") or ()], list(resume.tokens),
                [dict(m) for m in resume.messages],
            )
        room = config.max_trajectory_tokens - len(root.tokens)
        if room < 1:
            return [
                _episode(env, info, root, renderer, config, [], [], config.cut_reward,
                         "trajectory_budget", 0, None, None)
                for env in envs
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
                    _branch(env, root.fork(), sequence, info, sampler, renderer, config, seed,
                            index)
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
    resets: Sequence[Mapping[str, Any] | Resume | None],
    sampler: Sampler,
    renderer: ChatRenderer,
    config: RolloutConfig,
    *,
    seeds: Sequence[int],
    concurrency: int = 8,
) -> list[list[Episode]]:
    """Several groups at once (at most ``concurrency`` in flight), in input order.

    Each entry of ``resets`` is a group's reset options or a ``Resume`` point.
    """
    if len(resets) != len(seeds):
        raise ValueError("one seed per group is needed")
    gate = asyncio.Semaphore(concurrency)

    async def one(start: Mapping[str, Any] | Resume | None, seed: int) -> list[Episode]:
        async with gate:
            if isinstance(start, Resume):
                return await rollout_group(make_env, None, sampler, renderer, config,
                                           seed=seed, resume=start)
            return await rollout_group(make_env, start, sampler, renderer, config, seed=seed)

    return list(await asyncio.gather(*(one(o, s) for o, s in zip(resets, seeds, strict=True))))


def _check_restored(
    branch: int, observation: str, info: Mapping[str, Any], resume: Resume
) -> None:
    """A restored branch must show exactly the chat the saved one showed, observation
    included: the digests the env checked are short hashes, this compares the text."""
    saved = list(resume.messages)
    if observation != saved[-1]["content"]:
        raise RolloutError(
            f"restored branch {branch} of {resume.state.task_id} at turn {resume.state.depth} "
            f"shows {observation[:200]!r}, the saved state showed "
            f"{str(saved[-1]['content'])[:200]!r}"
        )
    replayed = [*info["messages"], *info.get("history", ())]
    if replayed != saved:
        first = next(
            (i for i, (a, b) in enumerate(zip(replayed, saved, strict=False)) if a != b),
            min(len(replayed), len(saved)),
        )
        raise RolloutError(
            f"restored branch {branch} of {resume.state.task_id} rebuilt a chat that differs "
            f"from the saved one at message {first}"
        )


async def _branch(
    env: gymnasium.Env,
    conversation: Conversation,
    sequence: SampleSequence,
    opening: Mapping[str, Any],
    sampler: Sampler,
    renderer: ChatRenderer,
    config: RolloutConfig,
    seed: int,
    branch: int,
) -> Episode:
    turns: list[Turn] = []
    rewards: list[float] = []
    invalid = 0
    while True:
        turns.append(
            Turn(list(conversation.tokens), list(sequence.tokens), list(sequence.logprobs),
                 sequence.stop_reason)
        )
        if not renderer.is_finished(sequence.tokens):
            return _episode(env, opening, conversation, renderer, config, turns, rewards,
                            config.cut_reward, "max_tokens", invalid, sequence.tokens, None)
        action = renderer.completion_text(sequence.tokens)
        _, step_reward, terminated, truncated, info = await asyncio.to_thread(env.step, action)
        rewards.append(float(step_reward))
        invalid += int(bool(info.get("invalid", False)))
        message = info["message"]
        end = (
            "terminated" if terminated
            else "truncated" if truncated
            else "max_turns" if len(turns) >= config.max_turns
            else None
        )
        if end is not None:
            episode = _episode(env, opening, conversation, renderer, config, turns, rewards,
                               0.0, end, invalid, sequence.tokens, message)
            if end == "max_turns" and config.keep_states:
                episode.next_prompt = list(conversation.append(sequence.tokens, [message]))
            return episode
        prompt = conversation.append(sequence.tokens, [message])
        room = config.max_trajectory_tokens - len(prompt)
        if room < 1:
            return _episode(env, opening, conversation, renderer, config, turns, rewards, 0.0,
                            "trajectory_budget", invalid, None, None)
        response = await sampler.sample_async(
            ModelInput.from_ints(prompt),
            num_samples=1,
            sampling_params=_params(config, renderer, min(config.max_tokens, room), seed,
                                    branch, len(turns)),
        )
        sequence = response.sequences[0]


def _episode(
    env: gymnasium.Env,
    opening: Mapping[str, Any],
    conversation: Conversation,
    renderer: ChatRenderer,
    config: RolloutConfig,
    turns: list[Turn],
    rewards: list[float],
    penalty: float,
    end_reason: str,
    invalid: int,
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
    return Episode(
        opening["task_id"], turns, sum(rewards) + penalty, end_reason, messages, invalid,
        step_rewards=list(rewards),
        opening_messages=len(conversation.opening),
        privileged=dict(opening.get("privileged") or {}),
        env_state=env.unwrapped.save_state() if config.keep_states else None,
    )


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
