"""The env contract: what an env author reads.

``base`` holds ``TextEnv`` (reset/step, turn counting, the action history and its replay)
and ``OutcomeEnv``; ``types`` the values they exchange (``Task``, ``Opening``,
``Transition``, the info keys); ``spaces`` the ``UnicodeText`` space; ``state`` the saved
state and its checks; ``prefixes`` the prefixes an env played, behind its fast restores (the
host's record of them, for a fresh process, is ``agent_gym.hoststore``, a leaf the engines
share).
"""

from agent_gym.env.base import (
    DEFAULT_MAX_OBS_CHARS,
    MAX_ACTION_CHARS,
    MAX_OBSERVATION_CHARS,
    REWARD_SETTINGS,
    EnvPart,
    EnvShape,
    OutcomeEnv,
    TextEnv,
    describe_env,
)
from agent_gym.env.prefixes import PrefixIndex
from agent_gym.env.spaces import UnicodeText
from agent_gym.env.state import EnvState, StateError, StateMismatchError
from agent_gym.env.types import (
    BackendFailure,
    Opening,
    ResetInfo,
    StepInfo,
    Task,
    Transition,
)

__all__ = [
    "DEFAULT_MAX_OBS_CHARS",
    "MAX_ACTION_CHARS",
    "MAX_OBSERVATION_CHARS",
    "REWARD_SETTINGS",
    "BackendFailure",
    "EnvPart",
    "EnvShape",
    "EnvState",
    "Opening",
    "OutcomeEnv",
    "PrefixIndex",
    "ResetInfo",
    "StateError",
    "StateMismatchError",
    "StepInfo",
    "Task",
    "TextEnv",
    "Transition",
    "UnicodeText",
    "describe_env",
]
