"""TEMPO's state store: the saved points macro-steps start from.

A macro-state is a point inside an episode, after some turns, at which a macro-step can
start again: the env state (the recipe to rebuild the env there, see ``agent_gym.state``),
the exact prompt tokens the policy had there (so a restored branch continues the very token
sequence the sampler produced, not a re-rendering of it), the chat those tokens render, and
what the importance correction needs later: which prefix tokens were sampled, the sum of the
logprobs the sampling policies gave them, and the policy version that reached the state.

The store fixes the seed lab's pool, which was sampled with replacement and never drained
(after the first update no fresh task ever entered training):

* bounded: adding beyond ``capacity`` evicts the oldest state (FIFO);
* consumed: a drawn state leaves the store, so no state starts two macro-steps;
* fresh tasks are never starved: every draw leaves ``fresh_quota`` groups to fresh tasks;
* stale states are dropped: a state reached by a policy more than ``staleness`` versions
  older than the current one no longer says where the current policy goes;
* it is saved with every checkpoint (JSON) and restored on resume.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agent_gym.state import EnvState, StateError
from trainers.episode import Episode
from trainers.rollout import Resume

STORE_FORMAT_VERSION = 1


class StoreError(ValueError):
    """A macro-state or a saved store is malformed or inconsistent."""


@dataclass
class MacroState:
    """A point to start macro-steps from; see the module docstring.

    ``sampled`` lists the half-open ``[start, end)`` token ranges of ``tokens`` that a policy
    sampled (every earlier reply; template and observation tokens are not sampled) and
    ``old_logprob_sum`` the sum of the logprobs the sampler reported for them.
    ``opening`` is how many of ``messages`` the episode opened with (the task); the rest is
    the history, ending with the observation the saved episode showed.
    """

    state: EnvState
    tokens: list[int]
    messages: list[dict[str, Any]]
    opening: int
    privileged: dict[str, Any]
    version: int
    sampled: list[tuple[int, int]]
    old_logprob_sum: float

    def __post_init__(self) -> None:
        if not self.tokens:
            raise StoreError("a macro-state needs its prompt tokens")
        if not 0 < self.opening < len(self.messages):
            raise StoreError(
                f"a macro-state's chat needs its opening ({self.opening} messages) and a "
                f"history after it, got {len(self.messages)} messages"
            )
        previous = 0
        for start, end in self.sampled:
            if not previous <= start <= end <= len(self.tokens):
                raise StoreError(
                    f"sampled range [{start}, {end}) is out of order or outside the "
                    f"{len(self.tokens)} prompt tokens"
                )
            previous = end
        if not math.isfinite(self.old_logprob_sum):
            raise StoreError("old_logprob_sum must be finite")

    @property
    def turn(self) -> int:
        """Env steps taken before this state."""
        return self.state.depth

    @property
    def observation(self) -> str:
        return str(self.messages[-1]["content"])

    def resume(self) -> Resume:
        """Where rollouts continue from: env restore plus the exact token prefix."""
        return Resume(self.state, self.tokens, self.messages)

    def sampled_logprob_sum(self, logprobs: Sequence[float | None]) -> float:
        """Sum of ``logprobs[i]`` over the sampled positions, ``logprobs`` being a
        ``compute_logprobs`` answer for ``tokens`` (index i: logprob of token i)."""
        if len(logprobs) != len(self.tokens):
            raise StoreError(f"got {len(logprobs)} logprobs for {len(self.tokens)} tokens")
        total = 0.0
        for start, end in self.sampled:
            for value in logprobs[start:end]:
                if value is None:
                    raise StoreError("a sampled prefix token has no logprob")
                total += value
        return total

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": json.loads(self.state.to_json()),
            "tokens": self.tokens,
            "messages": self.messages,
            "opening": self.opening,
            "privileged": self.privileged,
            "version": self.version,
            "sampled": [list(span) for span in self.sampled],
            "old_logprob_sum": self.old_logprob_sum,
        }

    @classmethod
    def from_dict(cls, payload: Any) -> MacroState:
        if not isinstance(payload, dict):
            raise StoreError(f"a saved macro-state must be an object, got {type(payload).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        if set(payload) != fields:
            raise StoreError(
                f"a saved macro-state has fields {sorted(payload)}, expected {sorted(fields)}"
            )
        try:
            state = EnvState.from_dict(payload["state"])
        except StateError as err:
            raise StoreError(f"a saved macro-state has a bad env state: {err}") from err
        tokens, spans = payload["tokens"], payload["sampled"]
        if not (isinstance(tokens, list) and all(type(t) is int for t in tokens)):
            raise StoreError("a saved macro-state's tokens must be a list of integers")
        if not (isinstance(spans, list) and all(
            isinstance(s, list) and len(s) == 2 and all(type(v) is int for v in s) for s in spans
        )):
            raise StoreError("a saved macro-state's sampled ranges must be [start, end] pairs")
        if not isinstance(payload["messages"], list) or not isinstance(payload["privileged"], dict):
            raise StoreError("a saved macro-state needs a message list and a privileged object")
        if type(payload["opening"]) is not int or type(payload["version"]) is not int:
            raise StoreError("a saved macro-state's opening and version must be integers")
        if not isinstance(payload["old_logprob_sum"], int | float):
            raise StoreError("a saved macro-state's old_logprob_sum must be a number")
        return cls(
            state, tokens, payload["messages"], payload["opening"], payload["privileged"],
            payload["version"], [(a, b) for a, b in spans], float(payload["old_logprob_sum"]),
        )


def cut(episode: Episode, turn: int, start: MacroState | None, version: int) -> MacroState:
    """The macro-state after ``turn`` turns of ``episode``.

    ``start`` is the state the episode was resumed from (None: a fresh task) and
    ``version`` the policy version that sampled the episode. The episode must have been
    rolled out with ``keep_states``; ``turn == len(episode.turns)`` needs its
    ``next_prompt`` (it stopped at the horizon).
    """
    if episode.env_state is None:
        raise StoreError("cutting a macro-state needs an episode rolled out with keep_states")
    stepped = len(episode.step_rewards)
    if not 1 <= turn <= stepped:
        raise StoreError(f"turn {turn} is not between 1 and the {stepped} steps the env took")
    if turn < len(episode.turns):
        tokens = list(episode.turns[turn].prompt_tokens)
    elif episode.next_prompt is not None:
        tokens = list(episode.next_prompt)
    else:
        raise StoreError(f"the episode ended ({episode.end_reason}) with no prompt to resume")
    spans = list(start.sampled) if start else []
    old = start.old_logprob_sum if start else 0.0
    for past in episode.turns[:turn]:
        begin = len(past.prompt_tokens)
        end = begin + len(past.completion_tokens)
        if tokens[begin:end] != past.completion_tokens:
            raise StoreError("the episode's prompts are not token-continuous")
        spans.append((begin, end))
        old += float(sum(past.logprobs))
    depth = episode.env_state.depth - stepped + turn
    state = dataclasses.replace(
        episode.env_state,
        actions=episode.env_state.actions[:depth],
        digests=episode.env_state.digests[: depth + 1],
    )
    before = len(start.messages) if start else episode.opening_messages
    messages = [dict(m) for m in episode.messages[: before + 2 * turn]]
    if len(messages) != before + 2 * turn or messages[-1].get("role") == "assistant":
        raise StoreError("the episode's messages do not hold a reply and an answer per turn")
    return MacroState(state, tokens, messages, episode.opening_messages,
                      dict(episode.privileged), version, spans, old)


def fresh_quota(groups: int, fresh_fraction: float) -> int:
    """Groups of an update reserved for fresh tasks: ``ceil(fraction * groups)``."""
    if not 0 < fresh_fraction <= 1:
        raise ValueError(f"fresh_fraction must be in (0, 1], got {fresh_fraction}")
    return min(groups, math.ceil(fresh_fraction * groups - 1e-9))


class StateStore:
    """A bounded FIFO of macro-states; see the module docstring for its rules."""

    def __init__(self, capacity: int, staleness: int) -> None:
        if capacity < 1 or staleness < 0:
            raise ValueError("the store needs capacity >= 1 and staleness >= 0")
        self.capacity = capacity
        self.staleness = staleness
        self._states: deque[MacroState] = deque()

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self) -> Iterator[MacroState]:
        return iter(self._states)

    def add(self, states: Iterable[MacroState]) -> int:
        """Append states (newest last); returns how many old ones were evicted."""
        evicted = 0
        for state in states:
            self._states.append(state)
            if len(self._states) > self.capacity:
                self._states.popleft()
                evicted += 1
        return evicted

    def drop_stale(self, version: int) -> int:
        """Remove states more than ``staleness`` versions older than ``version``."""
        kept = [s for s in self._states if version - s.version <= self.staleness]
        dropped = len(self._states) - len(kept)
        self._states = deque(kept)
        return dropped

    def draw(
        self, groups: int, fresh_fraction: float, version: int, rng: np.random.Generator
    ) -> tuple[list[MacroState], int]:
        """States to start ``groups`` macro-steps from, taken out of the store.

        Stale states are dropped first; then up to ``groups - fresh_quota(...)`` states are
        drawn uniformly without replacement (oldest first in the answer). The caller fills
        the remaining groups with fresh tasks. Returns the states and how many were stale.
        """
        stale = self.drop_stale(version)
        wanted = min(groups - fresh_quota(groups, fresh_fraction), len(self._states))
        if wanted <= 0:
            return [], stale
        picked = set(rng.choice(len(self._states), size=wanted, replace=False).tolist())
        states = list(self._states)
        self._states = deque(s for i, s in enumerate(states) if i not in picked)
        return [s for i, s in enumerate(states) if i in picked], stale

    def to_json(self) -> str:
        return json.dumps({
            "version": STORE_FORMAT_VERSION,
            "states": [state.to_dict() for state in self._states],
        })

    @classmethod
    def from_json(cls, text: str, capacity: int, staleness: int) -> StateStore:
        """A saved store; beyond ``capacity`` the oldest states are evicted."""
        try:
            payload = json.loads(text)
        except json.JSONDecodeError as err:
            raise StoreError(f"the saved store is not valid JSON: {err}") from err
        if not isinstance(payload, dict) or payload.get("version") != STORE_FORMAT_VERSION:
            raise StoreError(
                f"the saved store is not a version {STORE_FORMAT_VERSION} state store"
            )
        if not isinstance(payload.get("states"), list):
            raise StoreError("the saved store has no state list")
        store = cls(capacity, staleness)
        store.add(MacroState.from_dict(item) for item in payload["states"])
        return store
