"""Envs in Ray actors: a Gymnasium ``VectorEnv`` and a single remote env for eval.

When one machine cannot step enough envs (ALFWorld planners, sandboxes), the envs move
into Ray actors spread over a cluster, while the driver keeps the policy and the
sampler. ``EnvState`` is what travels between actors: a branch saved in one actor is
restored in another by replay, exactly as in one process.

A sub-env whose actor dies (its node lost, the process killed) is replaced by a fresh
actor; the episode it was running ends as *truncated* with ``info["actor_died"]`` set,
so a training loop sees the loss instead of silently dropping or inventing data.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from copy import deepcopy
from typing import Any, ClassVar

import gymnasium
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from agent_gym.actions.protocols import ActionProtocol
from agent_gym.env.state import EnvState
from agent_gym.extras import install_hint

try:
    import ray
    from ray.exceptions import RayActorError, RayTaskError
except ImportError as err:  # Ray is an optional extra
    raise ImportError(
        f"agent_gym.serve.distributed needs Ray: {install_hint('ray')}"
    ) from err


def ensure_ray(address: str | None = None) -> None:
    """Connect to ``address`` (``"auto"``, ``ray://host:10001``) or start a local Ray."""
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)


@ray.remote
class EnvActor:
    """One env inside a Ray worker process."""

    def __init__(self, env_id: str, env_kwargs: dict[str, Any], plugins: Sequence[str] = ()
                 ) -> None:
        import agent_gym  # registers the bundled envs in the worker

        agent_gym.load_env_plugins(plugins)  # and the caller's, by the modules it imported
        self.env = gymnasium.make(env_id, **env_kwargs)

    def protocol(self) -> ActionProtocol | None:
        return getattr(self.env.unwrapped, "protocol", None)

    def spaces(self) -> tuple[gymnasium.Space, gymnasium.Space]:
        return self.env.observation_space, self.env.action_space

    def reset(self, seed: int | None, options: dict[str, Any] | None) -> tuple[str, dict]:
        return self.env.reset(seed=seed, options=options)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        return self.env.step(action)

    def save_state(self) -> EnvState:
        return self.env.unwrapped.save_state()

    def close(self) -> None:
        self.env.close()


class RemoteEnv(gymnasium.Env):
    """A single env in a Ray actor, usable wherever a local env is (eval, rollouts).

    Its calls block until the actor answers; callers run them in threads, as they do for
    local envs. ``save_state`` is on the env itself, so ``env.unwrapped.save_state()`` works,
    and so is the env's action protocol (``protocol``), so scripted policies phrase their
    actions as they would locally. ``plugins`` are the modules that register a third-party
    env (``agent-gym --import``), imported in the actor before the env is made.
    """

    def __init__(self, env_id: str, env_kwargs: dict[str, Any], address: str | None = None,
                 plugins: Sequence[str] = ()) -> None:
        ensure_ray(address)
        self.actor = EnvActor.remote(env_id, env_kwargs, tuple(plugins))
        self.observation_space, self.action_space = ray.get(self.actor.spaces.remote())
        self.protocol = ray.get(self.actor.protocol.remote())

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict]:
        return ray.get(self.actor.reset.remote(seed, options))

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        return ray.get(self.actor.step.remote(action))

    def save_state(self) -> EnvState:
        return ray.get(self.actor.save_state.remote())

    def close(self) -> None:
        _close_actor(self.actor)


def _close_actor(actor: Any) -> None:
    """Let the env release what it holds (sandboxes, engines), then end the actor."""
    # Already dead, or its env failed to close: the actor ends regardless.
    with contextlib.suppress(Exception):
        ray.get(actor.close.remote(), timeout=30)
    ray.kill(actor)


def remote_env_factory(
    env_id: str, env_kwargs: dict[str, Any], address: str, plugins: Sequence[str] = ()
) -> Callable[[], RemoteEnv]:
    """A factory of envs in Ray actors; ``address`` ``"local"`` starts a local Ray."""
    ray_address = None if address == "local" else address
    ensure_ray(ray_address)
    return functools.partial(RemoteEnv, env_id, dict(env_kwargs), ray_address, tuple(plugins))


class RayVectorEnv(VectorEnv):
    """``num_envs`` copies of an agent_gym env, each in its own Ray actor.

    Follows Gymnasium's next-step autoreset: the step after an episode ends resets that
    sub-env and ignores its action. ``reset(options={"state": s})`` restores every sub-env
    from one saved state (N branches); ``reset(options={"states": [...]})`` gives each its
    own. ``save_states()`` collects the sub-envs' current states. ``plugins`` are modules each
    actor imports before it makes its env (a third-party env's registration).
    """

    metadata: ClassVar[dict[str, Any]] = {"autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        env_kwargs: dict[str, Any] | None = None,
        *,
        address: str | None = None,
        num_cpus: float = 1.0,
        plugins: Sequence[str] = (),
    ) -> None:
        ensure_ray(address)
        self.env_id = env_id
        self.env_kwargs = dict(env_kwargs or {})
        self.plugins = tuple(plugins)
        self.num_envs = num_envs
        self._num_cpus = num_cpus
        self.actors = [self._spawn() for _ in range(num_envs)]
        observation_space, action_space = ray.get(self.actors[0].spaces.remote())
        self.single_observation_space = observation_space
        self.single_action_space = action_space
        self.observation_space = batch_space(observation_space, num_envs)
        self.action_space = batch_space(action_space, num_envs)
        self._done = np.zeros(num_envs, dtype=np.bool_)

    def _spawn(self) -> Any:
        return EnvActor.options(num_cpus=self._num_cpus).remote(self.env_id, self.env_kwargs,
                                                                self.plugins)

    def reset(
        self, *, seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[tuple[str, ...], dict[str, Any]]:
        seeds = _seeds(seed, self.num_envs)
        per_env = _per_env_options(options, self.num_envs)
        futures = [
            actor.reset.remote(seed_i, options_i)
            for actor, seed_i, options_i in zip(self.actors, seeds, per_env, strict=True)
        ]
        observations: list[str] = []
        infos: dict[str, Any] = {}
        for i, future in enumerate(futures):
            observation, info = ray.get(future)  # a dead actor here is a setup failure: raise
            observations.append(observation)
            infos = self._add_info(infos, info, i)
        self._done[:] = False
        return tuple(observations), infos

    def step(
        self, actions: Sequence[str]
    ) -> tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        if len(actions) != self.num_envs:
            raise ValueError(f"expected {self.num_envs} actions, got {len(actions)}")
        futures = [
            actor.reset.remote(None, None) if done else actor.step.remote(action)
            for actor, action, done in zip(self.actors, actions, self._done, strict=True)
        ]
        observations: list[str] = []
        rewards = np.zeros(self.num_envs, dtype=np.float64)
        terminated = np.zeros(self.num_envs, dtype=np.bool_)
        truncated = np.zeros(self.num_envs, dtype=np.bool_)
        infos: dict[str, Any] = {}
        for i, future in enumerate(futures):
            try:
                result = ray.get(future)
            except (RayActorError, RayTaskError) as err:
                # A dead actor, or an env that raised (its state is now unknown): either way
                # a fresh actor takes over and this episode ends as truncated, not lost.
                ray.kill(self.actors[i])
                self.actors[i] = self._spawn()
                observations.append("")
                truncated[i] = True
                died = isinstance(err, RayActorError)
                info = {"actor_died": died, "error": f"env actor failed: {err}"}
            else:
                if self._done[i]:
                    observation, info = result
                else:
                    observation, rewards[i], terminated[i], truncated[i], info = result
                observations.append(observation)
            infos = self._add_info(infos, info, i)
        self._done = terminated | truncated
        return tuple(observations), rewards, terminated, truncated, infos

    def save_states(self) -> list[EnvState]:
        return ray.get([actor.save_state.remote() for actor in self.actors])

    def close_extras(self, **kwargs: Any) -> None:
        for actor in self.actors:
            _close_actor(actor)


def _seeds(seed: int | Sequence[int | None] | None, n: int) -> list[int | None]:
    if seed is None:
        return [None] * n
    if isinstance(seed, int):
        return [seed + i for i in range(n)]
    if len(seed) != n:
        raise ValueError(f"got {len(seed)} seeds for {n} envs")
    return list(seed)


def _per_env_options(options: dict[str, Any] | None, n: int) -> list[dict[str, Any] | None]:
    if not options or "states" not in options:
        return [deepcopy(options) for _ in range(n)]
    states = options["states"]
    if len(states) != n or len(options) > 1:
        raise ValueError(f"'states' must hold one state per env ({n}) and stand alone")
    return [{"state": state} for state in states]
