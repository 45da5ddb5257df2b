"""agent_gym: Gymnasium text environments for LLM agents, with verifiable save/restore.

Importing the package registers every environment with Gymnasium::

    import gymnasium, agent_gym
    env = gymnasium.make("agent_gym/GSM8K-v0")
"""

from __future__ import annotations

from typing import Any

import gymnasium

from agent_gym.core import Opening, Task, TextEnv, Transition, UnicodeText
from agent_gym.state import EnvState, StateError, StateMismatchError

__all__ = [
    "EnvState",
    "Opening",
    "StateError",
    "StateMismatchError",
    "Task",
    "TextEnv",
    "Transition",
    "UnicodeText",
    "make_from_state",
]

# No max_episode_steps: each env counts its own turns, which stays right after a restore.
_ENTRY_POINTS = {
    "agent_gym/GSM8K-v0": "agent_gym.envs.gsm8k:GSM8KEnv",
    "agent_gym/CodeInterpreter-v0": "agent_gym.envs.code:CodeInterpreterEnv",
    "agent_gym/Search-v0": "agent_gym.envs.search:SearchEnv",
    "agent_gym/ALFWorld-v0": "agent_gym.envs.alfworld:ALFWorldEnv",
    # A client of an `agent-gym serve` server (needs agent-gym[serve]); gymnasium.make(
    # "agent_gym/Remote-v0", url="http://host:8000").
    "agent_gym/Remote-v0": "agent_gym.remote:RemoteTextEnv",
}
for _env_id, _entry_point in _ENTRY_POINTS.items():
    if _env_id not in gymnasium.registry:
        gymnasium.register(id=_env_id, entry_point=_entry_point, disable_env_checker=False)


def make_from_state(state: EnvState | str, **make_kwargs: Any) -> tuple[gymnasium.Env, str, dict]:
    """Build the env a state was saved from and restore it: ``(env, observation, info)``."""
    if isinstance(state, str):
        state = EnvState.from_json(state)
    env = gymnasium.make(state.env_id, **state.env_kwargs, **make_kwargs)
    observation, info = env.reset(options={"state": state})
    return env, observation, info
