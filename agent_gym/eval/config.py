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
from agent_gym.untrusted import finite

Key = tuple[int, int]  # (episode, rollout)
# Far beyond any real run, and low enough that what is sized by them (the summary's pass@k
# table has a row per rollout) stays small: a config.json saying 10^7 rollouts per task
# made every reader of the run build ten million rows.
MAX_EPISODES = 10_000_000
MAX_ROLLOUTS_PER_TASK = 1000


@dataclass(frozen=True)
class EvalConfig:
    """What a run measures: ``episodes`` episodes, each a task played ``rollouts_per_task``
    times (past the env's last task, episodes play its tasks again).

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
        if not 1 <= self.episodes <= MAX_EPISODES:
            raise ValueError(f"episodes must be from 1 to {MAX_EPISODES:,}, got {self.episodes}")
        if not 1 <= self.rollouts_per_task <= MAX_ROLLOUTS_PER_TASK:
            raise ValueError(f"rollouts_per_task must be from 1 to {MAX_ROLLOUTS_PER_TASK}, "
                             f"got {self.rollouts_per_task}")
        if self.history_window is not None and self.history_window < 1:
            raise ValueError("a history window keeps at least 1 turn")

    @classmethod
    def from_recorded(cls, recorded: Any) -> EvalConfig:
        """The run a ``config.json`` describes, checked field by field: the file is
        untrusted input (another version, a crashed run, a hand edit), so a wrong type or
        an out-of-range count is a ``ValueError`` naming the field, never a later crash.
        Settings this version does not know (a newer eval's) are left out; missing ones
        take their defaults, as in runs recorded before they existed."""
        if not isinstance(recorded, dict):
            raise ValueError("it is not a JSON object")
        known = {name: recorded[name] for name in _RECORDED_TYPES if name in recorded}
        for name in ("env_id", "policy", "episodes"):
            if name not in known:
                raise ValueError(f"it records no {name}")
        for name, value in known.items():
            kinds = _RECORDED_TYPES[name]
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise ValueError(f"{name} is {value!r}, not {_kind_names(kinds)}")
        finite(known.get("temperature", 0.0), "temperature")
        return cls(**known)

    def differences(self, recorded: Mapping[str, Any]) -> list[str]:
        """The identity settings in which a recorded ``config.json`` differs from this run
        (more episodes or rollouts extend a run and are no difference)."""
        mine = json.loads(json.dumps(asdict(self)))
        return [
            f"{name}={recorded.get(name, '<not recorded>')!r} (this run: {mine[name]!r})"
            for name in IDENTITY
            if recorded.get(name, _MISSING) != mine[name]
        ]

    def covering(self, keys: Iterable[Key], recorded: EvalConfig | None = None) -> EvalConfig:
        """This run grown to the counts a ``recorded`` config asked for and to every
        (episode, rollout) in ``keys``: a run directory only ever grows, so a rerun with
        fewer ``--episodes`` can never make its summary, ``compare`` or ``view`` read
        fewer episodes than it holds."""
        episodes, rollouts = [self.episodes], [self.rollouts_per_task]
        if recorded is not None:
            episodes.append(recorded.episodes)
            rollouts.append(recorded.rollouts_per_task)
        for episode, rollout in keys:
            episodes.append(episode + 1)
            rollouts.append(rollout + 1)
        return replace(self, episodes=max(episodes), rollouts_per_task=max(rollouts))


# The JSON type of each recorded setting (a bool is never taken for a number).
_RECORDED_TYPES: dict[str, tuple[type, ...]] = {
    "env_id": (str,), "policy": (str,), "episodes": (int,), "seed": (int,),
    "env_kwargs": (dict,), "rollouts_per_task": (int,), "max_tokens": (int,),
    "temperature": (int, float), "history_window": (int, type(None)),
}


def _kind_names(kinds: tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", float: "a number", dict: "an object",
             type(None): "null"}
    return " or ".join(names[kind] for kind in kinds)


IDENTITY = ("env_id", "policy", "seed", "env_kwargs", "max_tokens", "temperature",
            "history_window")
_MISSING = object()


def episode_seed(seed: int, episode: int, rollout: int) -> int:
    """The reset seed of one rollout: rollout 0 keeps ``seed + episode`` (what runs used
    before rollouts existed), later ones get seeds derived from all three."""
    return seed + episode if rollout == 0 else derive_seed(seed, episode, rollout)
