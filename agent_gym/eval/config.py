"""What an eval run measures: ``EvalConfig``, its identity settings, and each rollout's seed.

Every setting that changes results (env, its arguments, policy, seed, reply budget,
temperature, history window) is the run's identity: a resume with another value is refused.
Asking for more episodes or more rollouts per task extends a run; asking for fewer never
shrinks it (``EvalConfig.covering``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from agent_gym.seeding import derive_seed

Key = tuple[int, int]  # (episode, rollout)


@dataclass(frozen=True)
class EvalConfig:
    """What a run measures: ``episodes`` tasks, each played ``rollouts_per_task`` times.

    ``max_tokens``, ``temperature`` and ``history_window`` are the policy's settings, stated
    here so that they are recorded with the run and a resume cannot mix them; the caller
    builds the policy with the same values (the command line does).
    """

    env_id: str
    policy: str
    episodes: int
    seed: int = 0
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    rollouts_per_task: int = 1
    max_tokens: int = 256
    temperature: float = 0.0
    history_window: int | None = None

    def __post_init__(self) -> None:
        if self.episodes < 1 or self.rollouts_per_task < 1:
            raise ValueError("episodes and rollouts_per_task must be at least 1")
        if self.history_window is not None and self.history_window < 1:
            raise ValueError("a history window keeps at least 1 turn")

    def differences(self, recorded: Mapping[str, Any]) -> list[str]:
        """The identity settings in which a recorded ``config.json`` differs from this run
        (more episodes or rollouts extend a run and are no difference)."""
        mine = json.loads(json.dumps(asdict(self)))
        return [
            f"{name}={recorded.get(name, '<not recorded>')!r} (this run: {mine[name]!r})"
            for name in IDENTITY
            if recorded.get(name, _MISSING) != mine[name]
        ]

    def covering(
        self, keys: Iterable[Key], recorded: Mapping[str, Any] | None = None
    ) -> EvalConfig:
        """This run grown to the counts a ``recorded`` config asked for and to every
        (episode, rollout) in ``keys``: a run directory only ever grows, so a rerun with
        fewer ``--episodes`` can never make its summary, ``compare`` or ``view`` read
        fewer episodes than it holds."""
        recorded = recorded or {}
        episodes, rollouts = [self.episodes], [self.rollouts_per_task]
        for counts, name in ((episodes, "episodes"), (rollouts, "rollouts_per_task")):
            value = recorded.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                counts.append(value)
        for episode, rollout in keys:
            episodes.append(episode + 1)
            rollouts.append(rollout + 1)
        return replace(self, episodes=max(episodes), rollouts_per_task=max(rollouts))


IDENTITY = ("env_id", "policy", "seed", "env_kwargs", "max_tokens", "temperature",
            "history_window")
_MISSING = object()


def episode_seed(seed: int, episode: int, rollout: int) -> int:
    """The reset seed of one rollout: rollout 0 keeps ``seed + episode`` (what runs used
    before rollouts existed), later ones get seeds derived from all three."""
    return seed + episode if rollout == 0 else derive_seed(seed, episode, rollout)
