"""A bubblewrap sandbox for model-written Python: stateless calls, a warm pool, notebooks.

``open_sandbox("stateless" | "stateful", ...)`` is the entry point. ``launch`` builds the
isolation (see its docstring for what is contained and how), ``process`` drives and kills
one sandboxed worker, ``runner`` holds the two execution modes, ``config`` the limits, and
``_worker`` is the program that runs inside.
"""

from agent_gym.sandbox.config import (
    ISOLATIONS,
    RLIMITS_WARNING,
    IsolationUnavailableError,
    Limits,
    SandboxError,
)
from agent_gym.sandbox.launch import Launcher, find_bwrap
from agent_gym.sandbox.runner import (
    STATE_LOST,
    ExecResult,
    StatefulSandbox,
    StatelessSandbox,
    open_sandbox,
)

__all__ = [
    "ISOLATIONS",
    "RLIMITS_WARNING",
    "STATE_LOST",
    "ExecResult",
    "IsolationUnavailableError",
    "Launcher",
    "Limits",
    "SandboxError",
    "StatefulSandbox",
    "StatelessSandbox",
    "find_bwrap",
    "open_sandbox",
]
