"""TEMPO's state store: the saved points macro-steps start from.

A stored state is an ``agent_gym_train.run.episode.ResumePoint``: a point inside an episode,
after some turns, at which a macro-step can start again: the env state (the recipe to
rebuild the env there, see ``agent_gym.env.state``), the exact prompt tokens the policy
had there with the spans earlier replies sampled and their logprobs (so a restored branch
continues the very token sequence the sampler produced, and the importance correction
knows what to score), the chat
those tokens render, and the policy version that reached the point. ``cut`` makes them from
episodes.

The store fixes the seed lab's pool, which was sampled with replacement and never drained
(after the first update no fresh task ever entered training):

* bounded: adding beyond ``capacity`` evicts the oldest state (FIFO);
* consumed: a drawn state leaves the store, so no state starts two macro-steps;
* fresh tasks are never starved: every draw leaves ``fresh_quota`` groups to fresh tasks;
* stale states are dropped: a state reached by a policy more than ``staleness`` versions
  older than the current one no longer says where the current policy goes;
* it is saved with every checkpoint (JSON) and restored on resume.

The store also keeps warm-up's critic demonstrations (``critic_replay``: the replies that
state each Monte Carlo target, with the target), which ``--critic-replay`` trains again in
later updates: saved with the states, a resumed run replays what the killed one would have.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np

from agent_gym_train.run.episode import DatumError, Episode, ResumePoint, TokenSequence

STORE_FORMAT_VERSION = 2


class StoreError(ValueError):
    """A resume point or a saved store is malformed or inconsistent."""


def cut(episode: Episode, turn: int, version: int) -> ResumePoint:
    """The resume point after ``turn`` turns of ``episode``, reached by policy ``version``.

    A resumed episode's point keeps the spans of the point it resumed from
    (``episode.start``), so the importance weight covers the whole prefix. The episode must
    have been rolled out with ``keep_states``; ``turn == episode.turns`` needs its
    ``next_prompt`` (it stopped at the horizon).
    """
    if episode.env_state is None:
        raise StoreError("cutting a resume point needs an episode rolled out with keep_states")
    stepped = len(episode.step_rewards)
    if not 1 <= turn <= stepped:
        raise StoreError(f"turn {turn} is not between 1 and the {stepped} steps the env took")
    try:
        if turn < episode.turns:
            sequence = episode.sequence.prefix(episode.sequence.spans[turn].start)
        elif episode.next_prompt is not None:
            sequence = episode.sequence.grown_to(episode.next_prompt)
        else:
            raise StoreError(f"the episode ended ({episode.end_reason}) with no prompt to resume")
    except DatumError as err:
        raise StoreError(f"the episode's prompts are not token-continuous: {err}") from err
    start = episode.start
    if start is not None:  # the prefix's own spans, which the episode took as context
        sequence = TokenSequence(sequence.tokens, (*start.sequence.spans, *sequence.spans))
    depth = episode.env_state.depth - stepped + turn
    state = episode.env_state.prefix(depth)
    before = len(start.messages) if start else episode.opening_messages
    messages = tuple(dict(m) for m in episode.messages[: before + 2 * turn])
    if len(messages) != before + 2 * turn or messages[-1].get("role") == "assistant":
        raise StoreError("the episode's messages do not hold a reply and an answer per turn")
    return ResumePoint(state, sequence, messages, episode.opening_messages,
                       dict(episode.privileged), version)


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
        self._states: deque[ResumePoint] = deque()
        self.critic_replay: list[tuple[TokenSequence, float]] = []

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self) -> Iterator[ResumePoint]:
        return iter(self._states)

    def add(self, states: Iterable[ResumePoint]) -> int:
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
    ) -> tuple[list[ResumePoint], int]:
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
            "critic_replay": [{"sequence": sequence.to_dict(), "target": target}
                              for sequence, target in self.critic_replay],
        })

    @classmethod
    def from_json(cls, text: str, capacity: int, staleness: int) -> StateStore:
        """A saved store; beyond ``capacity`` the oldest states are evicted."""
        try:
            payload = json.loads(text)
        except json.JSONDecodeError as err:
            raise StoreError(f"the saved store is not valid JSON: {err}") from err
        version = payload.get("version") if isinstance(payload, dict) else None
        if version == 1:
            raise StoreError(
                "the saved store is version 1: it kept only the sampled ranges of each prefix "
                "and their logprob sum, and version 2 keeps every sampled span with its "
                "logprobs. Resume that run with the agent-gym release that wrote it, or start "
                "a fresh run in another --out directory"
            )
        if version != STORE_FORMAT_VERSION:
            raise StoreError(
                f"the saved store is not a version {STORE_FORMAT_VERSION} state store"
            )
        if not isinstance(payload.get("states"), list):
            raise StoreError("the saved store has no state list")
        store = cls(capacity, staleness)
        try:
            store.add(ResumePoint.from_dict(item) for item in payload["states"])
        except DatumError as err:
            raise StoreError(f"the saved store holds a bad state: {err}") from err
        replay = payload.get("critic_replay", [])  # absent in stores saved before replay
        if not (isinstance(replay, list) and all(
            isinstance(item, dict) and set(item) == {"sequence", "target"}
            and isinstance(item["target"], int | float) and math.isfinite(item["target"])
            for item in replay
        )):
            raise StoreError("the saved store's critic replay must be a list of "
                             "{sequence, target} objects with finite targets")
        try:
            store.critic_replay = [(TokenSequence.from_dict(item["sequence"]),
                                    float(item["target"])) for item in replay]
        except DatumError as err:
            raise StoreError(f"the saved store's critic replay is bad: {err}") from err
        return store
