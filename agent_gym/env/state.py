"""Saved environment states: what a branch needs to rebuild an episode exactly.

A state is not a snapshot of Python objects (engines such as textworld cannot be pickled);
it is the recipe to rebuild one: which env with which constructor arguments, which task,
and every action taken, plus a digest of every observation seen so the rebuild can prove
it reached the same place. That makes states small, portable across processes and
machines, and safe to store as JSON.

What the recipe cannot recompute is recorded with it, as the outside world's inputs to the
episode: the env's random generator right after the reset (``rng``, so the restored env's
next unseeded ``reset()`` picks the same task as the original's), and every transient
failure of a backend the episode saw (``faults``: a search service that answered 503, a
sandbox that did not start), so that a restore reproduces the failure instead of meeting a
recovered backend and diverging. States are data: they never choose the host's settings
(see ``TextEnv.host_settings``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from agent_gym import untrusted

STATE_FORMAT_VERSION = 2
# Version 1 states (no rng, no faults) still restore; they are read as having neither.
_READABLE_VERSIONS = (1, 2)
MAX_FAULT_CHARS = 2000  # of a recorded failure's message


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


def split_reset_options(options: Mapping[str, Any] | None) -> tuple[object | None, dict[str, Any]]:
    """``reset``'s options as (the state to restore, or None to start a task; the other
    options). A state is restored as it was saved, so it comes alone."""
    rest = dict(options or {})
    state = rest.pop("state", None)
    if state is not None and rest:
        raise ValueError(f"options {sorted(rest)} cannot be combined with 'state'")
    return state, rest


@dataclass(frozen=True)
class EnvState:
    """Everything needed to rebuild an episode on a fresh env and check it arrived.

    ``digests[0]`` fingerprints the initial observation and ``digests[i]`` the observation
    returned by ``actions[i - 1]``, so ``len(digests) == len(actions) + 1``. ``faults`` holds
    ``(step, message)`` for each step whose backend call failed transiently, in step order;
    ``rng`` is the env's random generator after the reset (``encode_rng``), or None.
    """

    env_id: str
    env_kwargs: dict[str, Any]
    task_id: str
    seed: int | None
    actions: tuple[str, ...]
    digests: tuple[str, ...]
    faults: tuple[tuple[int, str], ...] = ()
    rng: str | None = None
    version: int = STATE_FORMAT_VERSION

    def __post_init__(self) -> None:
        if len(self.digests) != len(self.actions) + 1:
            raise StateError(
                f"state has {len(self.actions)} actions but {len(self.digests)} observation "
                "digests; expected one digest per action plus the initial observation"
            )
        steps = [step for step, _ in self.faults]
        if steps != sorted(set(steps)) or any(not 1 <= s <= len(self.actions) for s in steps):
            raise StateError(
                f"state records backend failures at steps {steps}; each must be a step of the "
                f"episode (1 to {len(self.actions)}), once, in order"
            )

    def prefix(self, depth: int) -> EnvState:
        """The state after the first ``depth`` steps: its actions, digests and failures."""
        if not 0 <= depth <= self.depth:
            raise StateError(f"depth {depth} is not between 0 and the state's {self.depth}")
        return replace(
            self,
            actions=self.actions[:depth],
            digests=self.digests[: depth + 1],
            faults=tuple((step, message) for step, message in self.faults if step <= depth),
        )

    @property
    def depth(self) -> int:
        """Number of steps taken since reset."""
        return len(self.actions)

    def to_json(self) -> str:
        payload = asdict(self)
        payload["actions"] = list(self.actions)
        payload["digests"] = list(self.digests)
        payload["faults"] = [list(fault) for fault in self.faults]
        return json.dumps(payload, ensure_ascii=False, sort_keys=True)

    @classmethod
    def of(cls, state: object) -> EnvState:
        """A state as ``reset(options={"state": ...})`` takes it: an ``EnvState``, its JSON
        text or its dict (each checked as untrusted input)."""
        if isinstance(state, str | bytes):
            return cls.from_json(state)
        if isinstance(state, Mapping):
            return cls.from_dict(dict(state))
        if isinstance(state, EnvState):
            return state
        raise StateError(f"cannot restore from a {type(state).__name__}; pass an EnvState")

    @classmethod
    def from_json(cls, text: str | bytes) -> EnvState:
        try:
            payload = untrusted.loads(text)
        except untrusted.UntrustedJSONError as err:
            raise StateError(f"saved state {err}") from None
        return cls.from_dict(payload)

    @classmethod
    def from_dict(cls, payload: Any) -> EnvState:
        if not isinstance(payload, dict):
            raise StateError(f"saved state must be a JSON object, got {type(payload).__name__}")
        try:  # a state parsed elsewhere (a request, a run file) is bounded here too
            untrusted.check_depth(payload)
        except untrusted.UntrustedJSONError as err:
            raise StateError(f"saved state {err}") from None
        # JSON `true` arrives as a bool, and bool is an int subclass equal to 1: test the type.
        version = payload.get("version")
        if type(version) is not int or version not in _READABLE_VERSIONS:
            raise StateError(
                f"saved state has format version {version!r}; this agent_gym reads versions "
                f"{', '.join(map(str, _READABLE_VERSIONS))}"
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
        known = {*expected, "seed", "version"} | ({"faults", "rng"} if version > 1 else set())
        unknown = set(payload) - known
        if unknown:
            raise StateError(f"saved state has unknown fields: {sorted(unknown)}")
        rng = payload.get("rng")
        if rng is not None:
            decode_rng(rng)  # refuse a malformed generator here, not halfway through a restore
        return cls(
            env_id=payload["env_id"],
            env_kwargs=payload["env_kwargs"],
            task_id=payload["task_id"],
            seed=seed,
            actions=tuple(payload["actions"]),
            digests=tuple(payload["digests"]),
            faults=_faults(payload.get("faults", [])),
            rng=rng,
        )


def _faults(raw: Any) -> tuple[tuple[int, str], ...]:
    """``[[step, message], ...]`` of a state file, checked for its types and length."""
    shape = ("saved state field 'faults' must be a list of [step, message] pairs with an "
             f"integer step and a message of at most {MAX_FAULT_CHARS} characters")
    if not isinstance(raw, list):
        raise StateError(shape)
    faults = []
    for fault in raw:
        if not (isinstance(fault, list) and len(fault) == 2 and type(fault[0]) is int
                and isinstance(fault[1], str) and len(fault[1]) <= MAX_FAULT_CHARS):
            raise StateError(shape)
        faults.append((fault[0], fault[1]))
    return tuple(faults)


def encode_rng(generator: np.random.Generator) -> str:
    """A PCG64 generator's whole state as ``pcg64:STATE:INC:HAS_UINT32:UINTEGER`` (hex).

    A string, not JSON numbers: the 128-bit words would lose precision in every JSON reader
    that parses numbers as doubles.
    """
    state = generator.bit_generator.state
    if state.get("bit_generator") != "PCG64":
        raise StateError(f"cannot save a {state.get('bit_generator')} generator; PCG64 only")
    inner = state["state"]
    words = (inner["state"], inner["inc"], state["has_uint32"], state["uinteger"])
    return "pcg64:" + ":".join(f"{int(w):x}" for w in words)


def decode_rng(text: Any) -> np.random.Generator:
    """The generator ``encode_rng`` wrote; ``StateError`` for anything else."""
    parts = text.split(":") if isinstance(text, str) and len(text) <= 200 else []
    try:
        if len(parts) != 5 or parts[0] != "pcg64":
            raise ValueError(text)
        state, inc, has_uint32, uinteger = (int(p, 16) for p in parts[1:])
        generator = np.random.Generator(np.random.PCG64())
        generator.bit_generator.state = {
            "bit_generator": "PCG64", "state": {"state": state, "inc": inc},
            "has_uint32": has_uint32, "uinteger": uinteger,
        }
    except (ValueError, TypeError, OverflowError):
        raise StateError(
            "saved state field 'rng' must be a generator state as agent_gym writes it "
            "('pcg64:...')"
        ) from None
    return generator


def _require_finite(env_name: str, kwargs: Mapping[str, Any]) -> None:
    """Refuse a setting that is or holds NaN or an infinity: every such setting is a count,
    a score or a budget, and a non-finite one never ends an episode or poisons every
    reward; states, which carry the settings as JSON, could not hold it either."""
    for name, value in kwargs.items():
        pending = [value]
        while pending:
            item = pending.pop()
            if isinstance(item, float) and not math.isfinite(item):
                raise ValueError(f"{env_name} setting {name} must be a finite number, got {item!r}")
            if isinstance(item, Mapping):
                pending.extend(item.values())
            elif isinstance(item, list | tuple):
                pending.extend(item)


def _json_kwargs(env_id: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Constructor arguments as they travel in a state: JSON values (paths as strings)."""

    def convert(value: Any) -> Any:
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        raise TypeError(f"{type(value).__name__} is not a JSON value")

    try:
        return json.loads(json.dumps(kwargs, default=convert))
    except TypeError as err:
        raise StateError(f"{env_id} was built with constructor arguments that are not JSON "
                         f"values, so its state cannot be saved: {err}") from err
