"""The envs of a run: built in this process or in Ray actors, checked once before a run
starts, and pooled so every step reuses them."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

import gymnasium

from agent_gym.env.base import EnvShape, describe_env
from agent_gym_train.run.files import RunConfigError

EnvFactory = Callable[[], gymnasium.Env]


def env_factory(env_id: str, env_kwargs: Mapping[str, Any], ray: str | None) -> EnvFactory:
    """Envs in this process, or each in a Ray actor (``ray``: ``"local"`` or an address).

    With Ray the env work (engines, sandboxes) spreads over the cluster while sampling
    stays asynchronous in this process.
    """
    if ray is None:
        return functools.partial(gymnasium.make, env_id, **env_kwargs)
    from agent_gym.serve.distributed import remote_env_factory

    return remote_env_factory(env_id, dict(env_kwargs), ray)


def check_env(
    env_id: str, env_kwargs: Mapping[str, Any], option: str | None = "--env-kwargs"
) -> EnvShape:
    """The env's ``EnvShape`` (tasks, max turns, parts), built once here and closed.

    A run calls this before it creates its directory or loads a model, so an unknown env id
    or constructor arguments the env refuses (an unknown name, a wrong type, a missing
    extra) are a one-line ``RunConfigError`` at once, not a traceback a model load later.
    ``option`` names the command-line option the arguments came from (None: none did).
    """
    try:
        return describe_env(env_id, env_kwargs)
    except gymnasium.error.Error as err:  # an unknown id: keeps Gymnasium's "did you mean"
        raise RunConfigError(f"--env-id {env_id}: {err} (see `agent-gym envs`)") from err
    except (TypeError, ValueError, ImportError, OSError) as err:
        given = f"{option} " if option else ""
        # Gymnasium appends the id and arguments to a constructor's error: said once here.
        why = str(err).split(" was raised from the environment creator for ")[0]
        raise RunConfigError(
            f"cannot build {env_id} with {given}{json.dumps(dict(env_kwargs), default=str)}: "
            f"{why}"
        ) from err


class EnvPool:
    """Environments kept open across rollout groups and steps; call it as the ``make_env``
    factory of ``agent_gym_train.run.rollout``.

    A rollout group makes its branches' envs and closes them when it ends. Through a pool,
    "make" hands out an idle env (building one only when none is idle) and "close" gives it
    back, so an env is built once per concurrent branch per run, not once per branch per
    step: an ALFWorld engine loads its game and a private fast-downward, and under Ray an
    env is a whole actor process. Call ``close()`` on the pool when done.
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

    @property
    def built(self) -> int:
        """Envs this pool has built so far."""
        return len(self._built)

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
