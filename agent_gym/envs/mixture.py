"""Mixture: several agent_gym envs trained or evaluated as one, each with a weight."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import gymnasium
import numpy as np

from agent_gym.actions.protocols import ActionProtocol
from agent_gym.env.base import EnvPart, TextEnv
from agent_gym.env.spaces import UnicodeText
from agent_gym.env.state import EnvState, StateError, split_reset_options
from agent_gym.env.types import ResetInfo, StepInfo, Task

MEMBER_KEYS = frozenset({"env_id", "env_kwargs", "weight"})


class MixtureEnv(gymnasium.Env[str, str]):
    """A weighted mixture of agent_gym envs: one task space made of every member's tasks.

    A run over several envs (a curriculum, or a skill kept while another is learnt) needs
    one task index a sampler can draw from and states that restore wherever they were
    saved. So the mixture owns neither task logic nor state format: it numbers the members'
    tasks end to end (member 0's first, then member 1's, ...) and hands each episode to the
    member that owns its task. A state saved during an episode is that member's own
    ``EnvState``, which restores in the mixture or in the member env alone.

    Observation, action, reward, episode end and info keys: the member's that plays the
    episode (its prompt and tools arrive in the reset info, so one policy can play them
    all); the reset info adds ``member``, the member's position.

    Weights: ``parts`` reports each member's (number of tasks, weight) in task order; the
    trainers' task samplers draw member k with probability weight k / sum of weights (its
    tasks evenly), not in proportion to its number of tasks. ``reset`` without a task draws
    the same way.

    Reset options: ``index`` (0 .. num_tasks - 1 across members), ``task_id`` (a task id
    that one member holds), ``state`` (a member's saved state: restored by the member of
    that env id, those episode settings and the data that holds its task), or none. Members
    a saved state could not tell apart (one env id, the same settings, a task id in both)
    are refused when the mixture is built. ``max_turns`` is the largest member budget; each
    member still ends its episodes at its own.

    Args:
        members: a list of ``{"env_id": ..., "env_kwargs": {...}, "weight": w}``; each
            ``env_id`` a registered agent_gym env that saves states (not a mixture, not a
            remote client), ``env_kwargs`` optional, ``weight`` a positive number
            (default 1). Only the weights' ratios matter: weights whose sum would
            overflow are kept divided by the largest.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 1}  # noqa: RUF012 (Gymnasium's shape)

    def __init__(self, members: Sequence[Mapping[str, Any]],
                 render_mode: str | None = None) -> None:
        if isinstance(members, str | bytes) or not isinstance(members, Sequence) or not members:
            raise ValueError("members must be a non-empty list of {env_id, env_kwargs, weight}")
        specs = [_member_spec(i, member) for i, member in enumerate(members)]
        self.render_mode = render_mode
        self.members: list[TextEnv] = []
        try:
            for position, spec in enumerate(specs):
                self.members.append(_build(position, spec, render_mode))
            _refuse_alike(self.members)
        except BaseException:
            self.close()
            raise
        self.weights = _relative(specs)
        self._offsets = np.cumsum([0, *(env.num_tasks for env in self.members)])
        self.max_turns = max(env.max_turns for env in self.members)
        self.observation_space = UnicodeText(max(_length(env.observation_space)
                                                 for env in self.members))
        self.action_space = UnicodeText(max(_length(env.action_space) for env in self.members))
        self._playing: TextEnv | None = None

    @property
    def num_tasks(self) -> int:
        return int(self._offsets[-1])

    @property
    def parts(self) -> tuple[EnvPart, ...]:
        """Each member's number of tasks and weight, in task-index order."""
        return tuple(EnvPart(env.num_tasks, weight)
                     for env, weight in zip(self.members, self.weights, strict=True))

    @property
    def tasks(self) -> list[Task]:
        """Every member's tasks, in task-index order."""
        return [task for env in self.members for task in env.tasks]

    @property
    def protocol(self) -> ActionProtocol | None:
        """The action protocol of the member playing the episode (scripted policies and the
        trainer adapters phrase their commands in it); None before a reset, or for a member
        that has none."""
        return getattr(self._playing, "protocol", None)

    @property
    def turn(self) -> int:
        return self._current().turn

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[str, ResetInfo]:
        state, options = split_reset_options(options)
        if state is not None:
            return self._restore(state)
        super().reset(seed=seed)
        unknown = set(options) - {"index", "task_id"}
        if unknown or len(options) > 1:
            raise ValueError(f"reset options {sorted(options)} for a mixture: give one of "
                             "index, task_id or state")
        if "task_id" in options:
            index = self._index_of(options["task_id"])
        elif "index" in options:
            index = options["index"]
            if not isinstance(index, int | np.integer) or isinstance(index, bool) \
                    or not 0 <= index < self.num_tasks:
                raise IndexError(f"task index must be in [0, {self.num_tasks}), got {index!r}")
        else:
            chance = np.array(self.weights) / sum(self.weights)
            member = int(self.np_random.choice(len(self.members), p=chance))
            index = int(self._offsets[member]
                        + self.np_random.integers(self.members[member].num_tasks))
        member = int(np.searchsorted(self._offsets, index, side="right")) - 1
        observation, info = self.members[member].reset(
            seed=seed, options={"index": int(index - self._offsets[member])})
        self._playing = self.members[member]
        return observation, _with_member(info, member)

    def _index_of(self, task_id: object) -> int:
        if not isinstance(task_id, str):
            raise ValueError(f"task_id must be a string, got {task_id!r}")
        found = [(k, position) for k, env in enumerate(self.members)
                 if (position := env.task_position(task_id)) is not None]
        if not found:
            raise KeyError(f"no member of this mixture has a task with id {task_id!r}")
        if len(found) > 1:
            raise ValueError(f"task id {task_id!r} is in members {[k for k, _ in found]} "
                             "alike (other episode settings): reset by index instead")
        member, position = found[0]
        return int(self._offsets[member]) + position

    def _restore(self, state: object) -> tuple[str, ResetInfo]:
        """Restore a member's state in the one member that can (the env id, episode
        settings and data that hold its task): members of one id may differ only in their
        data sources, which a state never names, so its task id is what tells them apart."""
        state = EnvState.of(state)
        mismatches = [env.state_mismatch(state) for env in self.members]
        # At most one member can: the mixture refused members a state could not tell apart.
        able = [k for k, mismatch in enumerate(mismatches) if mismatch is None]
        if not able:
            same_id = [k for k, env in enumerate(self.members) if env.env_id == state.env_id]
            if not same_id:
                raise StateError(f"state belongs to {state.env_id!r}, which is not a member of "
                                 f"this mixture ({', '.join(e.env_id for e in self.members)})")
            reasons = "; ".join(f"member {k}: {mismatches[k]}" for k in same_id)
            raise StateError(f"no member of this mixture can restore the state ({reasons})")
        observation, info = self.members[able[0]].reset(options={"state": state})
        self._playing = self.members[able[0]]
        return observation, _with_member(info, able[0])

    def step(self, action: str) -> tuple[str, float, bool, bool, StepInfo]:
        return self._current().step(action)

    def save_state(self) -> EnvState:
        """The playing member's state (restores in this mixture or in that env alone)."""
        return self._current().save_state()

    def render(self) -> str | None:
        return self._current().render()

    def close(self) -> None:
        """Close every member, even when one fails to (the first failure is raised)."""
        failure: Exception | None = None
        for env in self.members:
            try:
                env.close()
            except Exception as err:  # the others still hold sandboxes or engines
                failure = failure or err
        if failure is not None:
            raise failure

    def _current(self) -> TextEnv:
        if self._playing is None:
            raise RuntimeError("call reset() before using the environment")
        return self._playing


class Member(NamedTuple):
    """One member as its constructor arguments give it."""

    env_id: str
    env_kwargs: dict[str, Any]
    weight: float


def _member_spec(position: int, member: object) -> Member:
    """A member's ``{env_id, env_kwargs, weight}`` checked, or a one-line error naming it."""
    where = f"mixture member {position}"
    if not isinstance(member, Mapping):
        raise ValueError(f"{where} must be an object with env_id (and env_kwargs, weight)")
    unknown = set(member) - MEMBER_KEYS
    if unknown:
        raise ValueError(f"{where} has unknown keys {sorted(unknown)}; use {sorted(MEMBER_KEYS)}")
    env_id, kwargs, weight = member.get("env_id"), member.get("env_kwargs", {}), \
        member.get("weight", 1.0)
    if not isinstance(env_id, str):
        raise ValueError(f"{where} needs an env_id (a registered agent_gym env id)")
    if env_id == "agent_gym/Mixture-v0":
        raise ValueError(f"{where} is itself a mixture: list its members instead")
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"{where}: env_kwargs must be an object of constructor arguments")
    if "render_mode" in kwargs:
        raise ValueError(f"{where}: render_mode is the mixture's argument, not a member's")
    try:  # an int past a float's range (10**400) is no weight a draw can use
        number = float(weight) if not isinstance(weight, bool) else math.nan
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    if not isinstance(weight, int | float) or not math.isfinite(number) or number <= 0:
        raise ValueError(f"{where}: weight must be a positive number below {sys.float_info.max:.3g}"
                         f", got {_shown(weight)}")
    return Member(env_id, dict(kwargs), number)


def _relative(specs: Sequence[Member]) -> list[float]:
    """The members' weights, divided by the largest when their sum would overflow: each one
    finite could still sum to infinity (two at 1e308), and every draw divided by that sum
    and failed. Weights that sum finitely are kept as given, as reports show them. A weight
    so small beside the largest that it divides to 0 would never be drawn: refused."""
    weights = [spec.weight for spec in specs]
    if math.isfinite(sum(weights)):
        return weights
    largest = max(weights)
    relative = [weight / largest for weight in weights]
    for position, (weight, share) in enumerate(zip(weights, relative, strict=True)):
        if share <= 0:
            raise ValueError(f"mixture member {position}: weight {weight!r} is too small "
                             f"beside {largest!r} to ever be drawn")
    return relative


def _shown(weight: object) -> str:
    """A weight as an error shows it, in bounded length and time (Python refuses to print
    an int of more than 4300 digits at all)."""
    if isinstance(weight, int) and weight.bit_length() > 64:
        return f"an integer of {weight.bit_length()} bits"
    text = repr(weight)
    return text if len(text) <= 40 else text[:37] + "..."


def _build(position: int, spec: Member, render_mode: str | None) -> TextEnv:
    """A member env, or a one-line error that names the member."""
    where = f"mixture member {position} ({spec.env_id})"
    try:
        env = gymnasium.make(spec.env_id, **spec.env_kwargs, render_mode=render_mode).unwrapped
    except (gymnasium.error.Error, TypeError, ValueError, KeyError) as err:
        raise ValueError(f"{where}: {err}") from err
    if not isinstance(env, TextEnv):
        env.close()
        raise ValueError(f"{where} does not save and restore states (not an agent_gym "
                         "TextEnv)")
    return env


def _refuse_alike(members: Sequence[TextEnv]) -> None:
    """Refuse two members of one env id and the same episode settings that share a task id:
    a state saved in either would restore in both, so it could not find its way back."""
    for later, env in enumerate(members):
        for earlier, other in enumerate(members[:later]):
            if env.env_id != other.env_id or env.settings != other.settings:
                continue
            shared = next((task.task_id for task in env.tasks
                           if other.task_position(task.task_id) is not None), None)
            if shared is not None:
                raise ValueError(
                    f"mixture members {earlier} and {later} ({env.env_id}, the same episode "
                    f"settings) both have task {shared!r}: a saved state could not tell them "
                    "apart; give them data with other task ids, or other settings")


def _length(space: gymnasium.Space[str]) -> int:
    return int(getattr(space, "max_length", 0))


def _with_member(info: ResetInfo, member: int) -> ResetInfo:
    return {**info, "member": member}
