"""The env contract: what an env author reads.

``base`` holds ``TextEnv`` (reset/step, turn counting, the action history and its replay)
and ``OutcomeEnv``; ``state`` the saved state and its checks; ``hoststore`` the host's
record of played prefixes behind fast restores in a fresh process.
"""

from agent_gym.env.base import (
    DEFAULT_MAX_OBS_CHARS,
    MAX_ACTION_CHARS,
    MAX_OBSERVATION_CHARS,
    REWARD_SETTINGS,
    BackendFailure,
    Opening,
    OutcomeEnv,
    Task,
    TextEnv,
    Transition,
    UnicodeText,
)
from agent_gym.env.state import EnvState, StateError, StateMismatchError

__all__ = [
    "DEFAULT_MAX_OBS_CHARS",
    "MAX_ACTION_CHARS",
    "MAX_OBSERVATION_CHARS",
    "REWARD_SETTINGS",
    "BackendFailure",
    "EnvState",
    "Opening",
    "OutcomeEnv",
    "StateError",
    "StateMismatchError",
    "Task",
    "TextEnv",
    "Transition",
    "UnicodeText",
]
