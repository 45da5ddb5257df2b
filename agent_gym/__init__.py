"""agent_gym: Gymnasium text environments for LLM agents, with verifiable save/restore.

Importing the package registers every environment with Gymnasium::

    import gymnasium, agent_gym
    env = gymnasium.make("agent_gym/GSM8K-v0")
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Iterable
from importlib.metadata import entry_points
from typing import Any

import gymnasium
from gymnasium.envs.registration import load_env_creator

from agent_gym import _moved
from agent_gym.env import (
    REWARD_SETTINGS,
    BackendFailure,
    EnvShape,
    EnvState,
    Opening,
    OutcomeEnv,
    ResetInfo,
    StateError,
    StateMismatchError,
    StepInfo,
    Task,
    TextEnv,
    Transition,
    UnicodeText,
)
from agent_gym.env.state import _json_kwargs

__all__ = [
    "ENV_ENTRY_POINTS",
    "BackendFailure",
    "EnvShape",
    "EnvState",
    "Opening",
    "OutcomeEnv",
    "PluginError",
    "ResetInfo",
    "StateError",
    "StateMismatchError",
    "StepInfo",
    "Task",
    "TextEnv",
    "Transition",
    "UnicodeText",
    "load_env_plugins",
    "make_from_state",
]

# No max_episode_steps: each env counts its own turns, which stays right after a restore.
# No Gymnasium env checker: its PassiveEnvChecker marks its first reset as checked before
# the reset returns, so a first reset that raises (a state that fails to restore, an unknown
# task id) left it without the data its first step compares against, and every later step
# crashed. Each env is checked with gymnasium's check_env in the test suite instead.
_ENTRY_POINTS = {
    "agent_gym/GSM8K-v0": "agent_gym.envs.gsm8k:GSM8KEnv",
    "agent_gym/CodeInterpreter-v0": "agent_gym.envs.code:CodeInterpreterEnv",
    "agent_gym/Search-v0": "agent_gym.envs.search:SearchEnv",
    "agent_gym/ALFWorld-v0": "agent_gym.envs.alfworld:ALFWorldEnv",
    # Several of the above as one task space, each with a weight (agent_gym.envs.mixture).
    "agent_gym/Mixture-v0": "agent_gym.envs.mixture:MixtureEnv",
    # A client of an `agent-gym serve` server (needs agent-gym[serve]); gymnasium.make(
    # "agent_gym/Remote-v0", url="http://host:8000").
    "agent_gym/Remote-v0": "agent_gym.serve.remote:RemoteTextEnv",
}
_moved.install()
for _env_id, _entry_point in _ENTRY_POINTS.items():
    if _env_id not in gymnasium.registry:
        gymnasium.register(id=_env_id, entry_point=_entry_point, disable_env_checker=True)


# Installed packages register their envs through this entry-point group: each entry is a
# module that registers on import, or a function of no arguments that does.
ENV_ENTRY_POINTS = "agent_gym.envs"


class PluginError(Exception):
    """A module named to register envs could not be imported."""


def load_env_plugins(modules: Iterable[str] = ()) -> list[str]:
    """Register third-party envs: import each of ``modules`` (``agent-gym --import``), then
    load every ``agent_gym.envs`` entry point not loaded yet.

    Envs are registered with Gymnasium, so once loaded they are made, replayed, served and
    rescored like the bundled ones. A named module that fails to import is the caller's
    error (``PluginError``); an installed entry point that fails only warns, so one broken
    package cannot stop every command. Returns the env ids this call registered.
    """
    before = set(gymnasium.registry)
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as err:  # any failure of the user's module is reported, in one line
            raise PluginError(f"--import {name}: {type(err).__name__}: {err}") from err
    for point in entry_points(group=ENV_ENTRY_POINTS):
        if point.value in _loaded_plugins:
            continue
        _loaded_plugins.add(point.value)
        try:
            loaded = point.load()
            if callable(loaded):
                loaded()
        except Exception as err:  # a broken installed plugin must not stop the others
            warnings.warn(f"the {ENV_ENTRY_POINTS} entry point {point.name!r} ({point.value}) "
                          f"failed to load: {type(err).__name__}: {err}", stacklevel=2)
    return sorted(set(gymnasium.registry) - before)


_loaded_plugins: set[str] = set()


def make_from_state(
    state: EnvState | str, **host_kwargs: Any
) -> tuple[gymnasium.Env, str, dict[str, Any]]:
    """Build the env a state was saved from and restore it: ``(env, observation, info)``.

    A state is data from wherever it was saved, so it never decides what this host does:
    the env's ``host_settings`` (sandbox isolation and limits, network endpoints, host
    paths, time budgets) come from ``host_kwargs`` or the env's defaults, never from the
    state. Every other setting is the state's; a ``host_kwargs`` entry that contradicts one
    is refused by the restore. ``info["reward_settings"]`` reports the reward settings the
    env now scores with and ``info["host_settings_not_taken"]`` the host settings the state
    named that were not used (so a restore that failed for want of them can be explained).
    """
    if isinstance(state, str):
        state = EnvState.from_json(state)
    if state.env_id not in gymnasium.registry:
        load_env_plugins()
    if state.env_id not in gymnasium.registry:
        raise StateError(
            f"the state belongs to {state.env_id!r}, which is not a registered env (an env of "
            f"another package registers when its module is imported: agent-gym --import MODULE)"
        )
    spec = gymnasium.spec(state.env_id)
    entry = spec.entry_point
    env_class = load_env_creator(entry) if isinstance(entry, str) else entry
    # Only an env that saves states restores one, and only its own class knows which of its
    # settings are the host's: anything else (the Remote-v0 client, whose url and token a
    # state must never choose; an env of another suite) is refused before it is built.
    if not (isinstance(env_class, type) and issubclass(env_class, TextEnv)):
        raise StateError(f"the state names {state.env_id!r}, which is not an env that saves "
                         "and restores states (an agent_gym TextEnv); to continue a served "
                         "episode, restore the server's own state there or locally")
    host = env_class.host_settings
    kwargs = {k: v for k, v in state.env_kwargs.items() if k not in host}
    try:
        env = gymnasium.make(state.env_id, **{**kwargs, **host_kwargs})
    except (TypeError, ValueError) as err:  # the state's settings are data, checked here
        raise StateError(f"{state.env_id} refuses the state's settings: {err}") from err
    used = _json_kwargs(state.env_id, env.unwrapped._env_kwargs)
    ignored = {k: v for k, v in state.env_kwargs.items() if k in host and used.get(k) != v}
    try:
        observation, info = env.reset(options={"state": state})
    except BaseException as err:
        env.close()
        if ignored and isinstance(err, StateError):
            err.add_note(
                f"The state was saved with the host settings {ignored}, which are never taken "
                "from a state: pass the ones you trust to make_from_state (agent-gym replay: "
                "--env-arg KEY=VALUE)."
            )
        raise
    info["reward_settings"] = {k: used[k] for k in REWARD_SETTINGS if k in used}
    info["host_settings_not_taken"] = ignored
    return env, observation, info
