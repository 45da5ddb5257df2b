"""The values an env's task logic and its callers exchange with ``TextEnv``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict


class BackendFailure(Exception):
    """A backend outside the episode failed transiently (``TextEnv._outside``); ``message``
    says how, exactly as the episode saw it, whether it happened now or was recorded."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class Task:
    """One problem an episode can be about; ``payload`` is whatever the env needs."""

    task_id: str
    payload: Mapping[str, Any]


@dataclass
class Opening:
    """How an episode begins: the first observation and the chat an actor is shown.

    ``privileged`` holds what a critic may see and the actor must not (reference answers,
    gold passages, walkthroughs); it never enters ``messages``. ``info`` adds env-specific
    keys to the reset info (such as the admissible actions a scripted policy picks from).
    """

    observation: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    privileged: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Transition:
    """What one action did, as the env's task logic sees it: ``reward`` before the base's
    rules (invalid penalty, running out of turns) are applied. ``role`` is the chat role of
    the message the env answers with. Frozen, because the base keeps transitions to hand
    them out again on a snapshot restore."""

    observation: str
    reward: float = 0.0
    terminated: bool = False
    invalid: bool = False
    role: str = "tool"
    info: dict[str, Any] = field(default_factory=dict)


class StepInfo(TypedDict, total=False):
    """The keys ``TextEnv.step`` puts in every info (an env adds its own, from
    ``Transition.info``)."""

    message: dict[str, Any]  # the chat message the env answers with: role and observation
    invalid: bool
    turn: int  # actions taken so far, this one included
    no_answer: bool  # an ``OutcomeEnv`` ran out of turns before an outcome


class ResetInfo(StepInfo, total=False):
    """The keys of a reset's info (an env adds its own, from ``Opening.info``); a restore
    (``options={"state": ...}``) also has the last replayed step's ``StepInfo`` keys."""

    task_id: str
    messages: list[dict[str, Any]]  # the chat an actor is shown
    tools: list[dict[str, Any]]
    privileged: dict[str, Any]  # for a critic, never for the actor
    member: int  # a mixture's (agent_gym.envs.mixture): which member plays the episode
    # A restore's alone:
    history: list[dict[str, Any]]  # the chat after ``messages``, to rebuild a prompt
    restored_depth: int  # steps the state holds
    snapshot_depth: int  # of those, how many a snapshot or the host store skipped
    snapshot_source: Literal["instance", "store"] | None
    step_rewards: list[float]  # what this code scores each replayed step
    episode_end: Literal["terminated", "truncated"] | None
    # agent_gym.make_from_state's alone:
    reward_settings: dict[str, Any]
    host_settings_not_taken: dict[str, Any]
