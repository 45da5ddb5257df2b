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
``end_reason="max_tokens"`` and ``cut_reward`` added to what the env already paid. With
``cut_continues`` a cut reply is instead closed with the template's end of turn (context,
not sample) and shown to the env like any reply, and the episode goes on: for a small model
at a CPU reply budget most replies are cut, so ending on the first cut means no episode
ever lives past a few turns (TEMPO's warm-up needs episodes that reach turn H). The env
judges the cut text as it stands (usually an invalid action); ``Episode.cut_replies``
counts them.

``history_window`` shows the sampler only the task and the last N turns, cut by the same
function eval uses (``agent_gym.render.window_messages``), so a policy is trained on the
prompts it is evaluated on. A cut cannot keep token continuity (the new prompt drops
tokens of the old), so it restarts it: the episode's sequence so far is closed (kept in
``Episode.earlier``) and a new one starts from the windowed prompt. Past N turns every
turn is such a cut, and the trajectory budget counts the current prompt only.

Macro-steps (TEMPO) use the same engine: a group started from a ``ResumePoint`` restores
every branch from its saved env state and continues its exact prompt tokens instead of a
fresh task's, each restored branch must reproduce the saved chat message for message (the
env's replay already checks every observation digest), and ``max_turns`` is the
macro-step's horizon. With ``keep_states`` each episode records its final env state and,
when it stopped at the horizon, the prompt to continue from.

Pass an ``agent_gym_train.run.envpool.EnvPool`` as ``make_env`` to reuse envs across groups
and steps.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import gymnasium
import numpy as np
from pytrio import ModelInput, SamplingParams
from pytrio.types import SampleSequence

from agent_gym.render import ChatRenderer, Conversation
from agent_gym.seeding import derive_seed
from agent_gym_train.run.clients import Sampler
from agent_gym_train.run.envpool import EnvFactory
from agent_gym_train.run.episode import Episode, ResumePoint, TokenSequence
from agent_gym_train.run.files import Metrics
from agent_gym_train.run.journal import BranchRecord, GroupJournal

Start = Mapping[str, Any] | ResumePoint | None  # a group's reset options, or where to resume


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
    history_window: int | None = None
    cut_continues: bool = False

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.max_turns < 1 or self.max_tokens < 1:
            raise ValueError("group_size, max_turns and max_tokens must be at least 1")
        if self.history_window is not None and self.history_window < 1:
            raise ValueError("a history window keeps at least 1 turn")
        if self.history_window is not None and self.keep_states:
            raise ValueError("resume points (keep_states) need one token-continuous "
                             "sequence; they cannot be combined with a history window")
        if self.max_trajectory_tokens < 2:
            raise ValueError("max_trajectory_tokens must be at least 2")


@dataclass(frozen=True)
class _Group:
    """What the branches of one group share."""

    sampler: Sampler
    renderer: ChatRenderer
    config: RolloutConfig
    seed: int
    opening: Mapping[str, Any]  # the reset info: task id, opening chat, privileged info
    start: ResumePoint | None
    journal: GroupJournal | None = None


@dataclass
class _Branch:
    """One branch as it plays: its env, its chat and tokens, and what the env paid."""

    index: int
    env: gymnasium.Env
    conversation: Conversation
    sequence: TokenSequence
    rewards: list[float] = field(default_factory=list)
    invalid: int = 0
    earlier: list[TokenSequence] = field(default_factory=list)  # closed by window cuts
    cut: int = 0
    dropped: list[dict[str, Any]] = field(default_factory=list)  # messages cut from view

    @property
    def turns(self) -> int:
        return sum(len(s.spans) for s in self.earlier) + len(self.sequence.spans)


async def rollout_group(
    make_env: EnvFactory,
    start: Start,
    sampler: Sampler,
    renderer: ChatRenderer,
    config: RolloutConfig,
    *,
    seed: int = 0,
    journal: GroupJournal | None = None,
) -> list[Episode]:
    """Roll out ``config.group_size`` branches of one task (reset with ``start``'s options)
    or from a resume point. With a ``journal`` every branch is recorded at each turn
    boundary, and what the journal holds of this group is continued, not sampled again
    (``agent_gym_train.run.journal``)."""
    resume = start if isinstance(start, ResumePoint) else None
    if resume is not None and journal is not None:
        raise ValueError("a group resumed from a resume point is not journaled")
    journaled = journal.take(config.group_size) if journal is not None else {}
    done = {i: r.episode for i, r in journaled.items() if r.episode is not None}
    if len(done) == config.group_size:
        return [done[i] for i in range(config.group_size)]
    live = [i for i in range(config.group_size) if i not in done]
    options = {"state": resume.state} if resume is not None else dict(start or {})
    envs = dict(zip(live, await asyncio.gather(
        *(asyncio.to_thread(make_env) for _ in live)), strict=True))
    try:
        openings = dict(zip(live, await asyncio.gather(*(
            asyncio.to_thread(env.reset, seed=seed, options=(
                {"state": journaled[i].state} if i in journaled else dict(options)))
            for i, env in envs.items())), strict=True))
        info = openings[live[0]][1]
        for _, other in openings.values():
            if (other["task_id"], other["messages"]) != (info["task_id"], info["messages"]):
                raise RolloutError("branches of one group opened with different tasks or chats")
        if resume is None:
            root = Conversation.start(renderer, info["messages"], info.get("tools"))
            prefix = TokenSequence(tuple(root.tokens))
        else:
            for index, (observation, restored) in openings.items():
                _check_restored(index, observation, restored, resume)
            root = Conversation(
                renderer, [dict(m) for m in info["messages"]],
                [dict(t) for t in info.get("tools") or ()], list(resume.sequence.tokens),
                [dict(m) for m in resume.messages],
            )
            prefix = resume.sequence.as_context()  # trained on by the macro-step before
        group = _Group(sampler, renderer, config, seed, info, resume, journal)
        fresh = [_Branch(i, envs[i], root.fork(), prefix) for i in live if i not in journaled]
        restored = [_journaled_branch(i, envs[i], root, openings[i], journaled[i])
                    for i in live if i in journaled]
        room = config.max_trajectory_tokens - len(root.tokens)
        if room < 1:
            ended = {b.index: _finish(group, b, "trajectory_budget", penalty=config.cut_reward)
                     for b in fresh}
            return [ended.get(i) or done[i] for i in range(config.group_size)]
        firsts: list[SampleSequence] = []
        if fresh:  # one call for every branch's first reply: each row's draw is its own
            first = await sampler.sample_async(
                ModelInput.from_ints(root.tokens),
                num_samples=config.group_size,
                sampling_params=_params(group, min(config.max_tokens, room), branch=0, turn=0),
            )
            if len(first.sequences) != config.group_size:
                raise RolloutError(
                    f"asked for {config.group_size} samples, got {len(first.sequences)}"
                )
            firsts = [first.sequences[b.index] for b in fresh]
        played = await asyncio.gather(
            *(_play(group, b, s) for b, s in zip(fresh, firsts, strict=True)),
            *(_continue(group, b) for b in restored),
        )
        ended = {b.index: e for b, e in zip([*fresh, *restored], played, strict=True)}
        return [ended.get(i) or done[i] for i in range(config.group_size)]
    finally:
        for env in envs.values():
            env.close()


async def rollout_groups(
    make_env: EnvFactory,
    starts: Sequence[Start],
    sampler: Sampler,
    renderer: ChatRenderer,
    config: RolloutConfig,
    *,
    seeds: Sequence[int],
    concurrency: int = 8,
    journals: Sequence[GroupJournal] | None = None,
) -> list[list[Episode]]:
    """Several groups at once (at most ``concurrency`` in flight), in input order; each
    entry of ``starts`` is a group's reset options or a ``ResumePoint``, and of
    ``journals`` (if given) its place in the run's journal."""
    if len(starts) != len(seeds) or (journals is not None and len(journals) != len(starts)):
        raise ValueError("one seed (and journal place, if any) per group is needed")
    gate = asyncio.Semaphore(concurrency)

    async def one(start: Start, seed: int, journal: GroupJournal | None) -> list[Episode]:
        async with gate:
            return await rollout_group(make_env, start, sampler, renderer, config, seed=seed,
                                       journal=journal)

    places = journals if journals is not None else [None] * len(starts)
    triples = zip(starts, seeds, places, strict=True)
    return list(await asyncio.gather(*(one(*triple) for triple in triples)))


def rollout_metrics(episodes: Sequence[Episode]) -> Metrics:
    """What a step's episodes did: reward, length, tokens, cuts, invalid actions, endings."""
    ends = Counter(e.end_reason for e in episodes)
    rewards = [e.reward for e in episodes]
    return {
        "reward_mean": float(np.mean(rewards)) if episodes else None,
        "reward_std": float(np.std(rewards)) if episodes else None,
        "episodes": len(episodes),
        "sampled_tokens": sum(e.sampled_tokens for e in episodes),
        "turns_mean": float(np.mean([e.turns for e in episodes])) if episodes else None,
        "cut_rate": ends["max_tokens"] / len(episodes) if episodes else None,
        "cut_replies": sum(e.cut_replies for e in episodes),
        "invalid_actions": sum(e.invalid_actions for e in episodes),
        "end_reasons": dict(ends),
    }


def _check_restored(
    branch: int, observation: str, info: Mapping[str, Any], resume: ResumePoint
) -> None:
    """A restored branch must show exactly the chat the saved one showed, observation
    included: the digests the env checked are short hashes, this compares the text."""
    saved = list(resume.messages)
    if observation != resume.observation:
        raise RolloutError(
            f"restored branch {branch} of {resume.state.task_id} at turn {resume.turn} "
            f"shows {observation[:200]!r}, the saved state showed {resume.observation[:200]!r}"
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


async def _play(group: _Group, branch: _Branch, sampled: SampleSequence) -> Episode:
    """Play one branch from its first sampled reply until an end (see ``Episode``)."""
    config, renderer = group.config, group.renderer
    while True:
        reply = list(sampled.tokens)
        branch.sequence = branch.sequence.extend(branch.conversation.tokens, reply,
                                                 sampled.logprobs)
        if not renderer.is_finished(reply):
            if not config.cut_continues:
                return _finish(group, branch, "max_tokens", reply=reply,
                               penalty=config.cut_reward)
            branch.cut += 1
        action = renderer.completion_text(reply)
        _, reward, terminated, truncated, info = await asyncio.to_thread(branch.env.step, action)
        branch.rewards.append(float(reward))
        branch.invalid += int(bool(info.get("invalid", False)))
        answer = info["message"]
        end = (
            "terminated" if terminated
            else "truncated" if truncated
            else "max_turns" if branch.turns >= config.max_turns
            else None
        )
        if end is not None:
            episode = _finish(group, branch, end, reply=reply, answer=answer)
            if end == "max_turns" and config.keep_states:
                episode.next_prompt = list(branch.conversation.append(reply, [answer]))
            return episode
        branch.conversation.append(reply, [answer])
        if _past_window(branch.conversation, config.history_window):
            _cut(branch, config.history_window)
        if group.journal is not None:
            group.journal.record(branch.index, _in_flight(group, branch))
        next_reply = await _sample_next(group, branch)
        if isinstance(next_reply, Episode):
            return next_reply
        sampled = next_reply


async def _continue(group: _Group, branch: _Branch) -> Episode:
    """Play a branch restored from the journal: its next turn, then on until an end."""
    next_reply = await _sample_next(group, branch)
    if isinstance(next_reply, Episode):
        return next_reply
    return await _play(group, branch, next_reply)


async def _sample_next(group: _Group, branch: _Branch) -> SampleSequence | Episode:
    """The branch's next reply on its current prompt, or its end when no room is left."""
    prompt = branch.conversation.tokens
    room = group.config.max_trajectory_tokens - len(prompt)
    if room < 1:
        return _finish(group, branch, "trajectory_budget")
    response = await group.sampler.sample_async(
        ModelInput.from_ints(prompt),
        num_samples=1,
        sampling_params=_params(group, min(group.config.max_tokens, room),
                                branch=branch.index, turn=branch.turns),
    )
    return response.sequences[0]


def _in_flight(group: _Group, branch: _Branch) -> BranchRecord:
    """The branch at a turn boundary, as the journal keeps it."""
    assert group.journal is not None
    return BranchRecord(
        group.journal.version, branch.env.unwrapped.save_state(),
        list(branch.conversation.tokens), [dict(m) for m in branch.conversation.messages],
        branch.sequence, list(branch.rewards), branch.invalid, branch.cut,
        list(branch.earlier), [dict(m) for m in branch.dropped])


def _journaled_branch(
    index: int, env: gymnasium.Env, root: Conversation, opening: tuple[str, Mapping[str, Any]],
    record: BranchRecord,
) -> _Branch:
    """A branch in flight, from its journal record and its env restored from the record's
    state: the env must show the chat the journal holds (its observation included)."""
    observation, info = opening
    shown = [*info["messages"], *info.get("history", ())]
    kept = [*record.messages[: len(root.opening)], *record.dropped,
            *record.messages[len(root.opening):]]
    if shown != kept or observation != str(record.messages[-1].get("content")):
        raise RolloutError(f"branch {index} of {info['task_id']} restored from the journal "
                           "shows another chat than the journal holds")
    conversation = Conversation(root.renderer, root.opening, root.tools, list(record.tokens),
                                [dict(m) for m in record.messages])
    return _Branch(index, env, conversation, record.sequence, list(record.rewards),
                   record.invalid, list(record.earlier), record.cut,
                   [dict(m) for m in record.dropped])


def _past_window(conversation: Conversation, window: int | None) -> bool:
    """Whether the chat holds more turns after its opening than the window shows."""
    if window is None:
        return False
    shown = conversation.messages[len(conversation.opening):]
    return sum(m["role"] == "assistant" for m in shown) > window


def _cut(branch: _Branch, window: int) -> None:
    """Apply the history window: close the branch's sequence and restart it from the
    windowed prompt."""
    before = branch.conversation
    branch.conversation = before.windowed(window)
    kept = len(branch.conversation.messages) - len(before.opening)
    branch.dropped.extend(before.messages[len(before.opening): len(before.messages) - kept])
    branch.earlier.append(branch.sequence)
    branch.sequence = TokenSequence(())


def _finish(
    group: _Group,
    branch: _Branch,
    end_reason: str,
    *,
    reply: Sequence[int] | None = None,
    answer: Mapping[str, Any] | None = None,
    penalty: float = 0.0,
) -> Episode:
    """The branch as an ``Episode``: its transcript gets the last ``reply`` (if it was not
    appended to the chat yet) and the env's ``answer`` to it (if any)."""
    conversation = branch.conversation
    opening = len(conversation.opening)
    messages = [*conversation.messages[:opening], *branch.dropped,
                *conversation.messages[opening:]]
    if reply is not None:
        messages.append({"role": "assistant", "content": group.renderer.completion_text(reply)})
    if answer is not None:
        messages.append(dict(answer))
    keep = group.config.keep_states
    episode = Episode(
        group.opening["task_id"], branch.sequence, sum(branch.rewards) + penalty, end_reason,
        messages, branch.invalid,
        step_rewards=list(branch.rewards),
        cut_replies=branch.cut,
        opening_messages=len(branch.conversation.opening),
        privileged=dict(group.opening.get("privileged") or {}),
        env_state=branch.env.unwrapped.save_state() if keep else None,
        start=group.start,
        earlier=tuple(branch.earlier),
        version=group.journal.version if group.journal is not None else None,
    )
    if group.journal is not None:
        group.journal.record(branch.index, BranchRecord(
            group.journal.version, None, [], [], branch.sequence, list(branch.rewards),
            branch.invalid, branch.cut, episode=episode))
    return episode


def _params(group: _Group, max_tokens: int, *, branch: int, turn: int) -> SamplingParams:
    # Seeds depend only on (group seed, branch, turn), not on scheduling order.
    return SamplingParams(
        max_tokens=max_tokens,
        seed=derive_seed(group.seed, branch, turn),
        stop=list(group.renderer.stop_tokens),
        temperature=group.config.temperature,
        top_p=group.config.top_p,
    )
