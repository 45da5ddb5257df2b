"""Saved environment states: what a branch needs to rebuild an episode exactly.

A state is not a snapshot of Python objects (engines such as textworld cannot be pickled);
it is the recipe to rebuild one: which env with which constructor arguments, which task,
and every action taken, plus a digest of every observation seen so the rebuild can prove
it reached the same place. That makes states small, portable across processes and
machines, and safe to store as JSON.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

STATE_FORMAT_VERSION = 1


class StateError(ValueError):
    """A saved state cannot be used: corrupt, from another env, or another format version."""


class StateMismatchError(StateError):
    """Replaying a saved state produced a different observation than the one recorded."""

    def __init__(self, step: int, expected: str, actual: str, observation: str) -> None:
        self.step = step
        self.expected = expected
        self.actual = actual
        self.observation = observation
        where = "the initial observation" if step == 0 else f"step {step}"
        preview = observation if len(observation) <= 300 else observation[:300] + "..."
        super().__init__(
            f"replay diverged at {where}: expected observation digest {expected}, "
            f"got {actual}; the replayed observation was: {preview!r}"
        )


def digest(text: str) -> str:
    """A short, stable fingerprint of an observation (16 hex chars of SHA-256)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


@dataclass(frozen=True)
class EnvState:
    """Everything needed to rebuild an episode on a fresh env and check it arrived.

    ``digests[0]`` fingerprints the initial observation and ``digests[i]`` the observation
    returned by ``actions[i - 1]``, so ``len(digests) == len(actions) + 1``.
    """

    env_id: str
    env_kwargs: dict[str, Any]
    task_id: str
    seed: int | None
    actions: tuple[str, ...]
    digests: tuple[str, ...]
    version: int = STATE_FORMAT_VERSION

    def __post_init__(self) -> None:
        if len(self.digests) != len(self.actions) + 1:
            raise StateError(
                f"state has {len(self.actions)} actions but {len(self.digests)} observation "
                "digests; expected one digest per action plus the initial observation"
            )

    @property
    def depth(self) -> int:
        """Number of steps taken since reset."""
        return len(self.actions)

    def to_json(self) -> str:
        payload = asdict(self)
        payload["actions"] = list(self.actions)
        payload["digests"] = list(self.digests)
        return json.dumps(payload, ensure_ascii=False, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> EnvState:
        try:
            payload = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise StateError(f"saved state is not valid JSON: {err}") from err
        return cls.from_dict(payload)

    @classmethod
    def from_dict(cls, payload: Any) -> EnvState:
        if not isinstance(payload, dict):
            raise StateError(f"saved state must be a JSON object, got {type(payload).__name__}")
        # JSON `true` arrives as a bool, and bool is an int subclass equal to 1: test the type.
        version = payload.get("version")
        if type(version) is not int or version != STATE_FORMAT_VERSION:
            raise StateError(
                f"saved state has format version {version!r}; this agent_gym reads version "
                f"{STATE_FORMAT_VERSION}"
            )
        expected = {"env_id": str, "env_kwargs": dict, "task_id": str, "actions": list,
                    "digests": list}
        for key, kind in expected.items():
            if not isinstance(payload.get(key), kind):
                raise StateError(f"saved state field {key!r} is missing or not a {kind.__name__}")
        seed = payload.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise StateError("saved state field 'seed' must be an integer or null")
        if not all(isinstance(a, str) for a in payload["actions"]):
            raise StateError("saved state field 'actions' must hold strings only")
        if not all(isinstance(d, str) for d in payload["digests"]):
            raise StateError("saved state field 'digests' must hold strings only")
        unknown = set(payload) - {*expected, "seed", "version"}
        if unknown:
            raise StateError(f"saved state has unknown fields: {sorted(unknown)}")
        return cls(
            env_id=payload["env_id"],
            env_kwargs=payload["env_kwargs"],
            task_id=payload["task_id"],
            seed=seed,
            actions=tuple(payload["actions"]),
            digests=tuple(payload["digests"]),
        )
