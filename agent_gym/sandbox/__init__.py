"""A bubblewrap sandbox for model-written Python: stateless calls, a warm pool, notebooks.

``open_sandbox("stateless" | "stateful", ...)`` is the entry point. ``launch`` builds the
isolation (see its docstring for what is contained and how), ``process`` drives and kills
one sandboxed worker, ``runner`` holds the two execution modes, ``forkserver`` the engine
stateless calls run on by default, ``result`` what a call returns, ``config`` the limits,
``memory`` the bound on all of a sandbox's processes together (a cgroup, else a watcher),
and ``_worker`` is the program that runs inside (a worker, or the fork-server).
"""

from agent_gym.sandbox.config import (
    ISOLATIONS,
    RLIMITS_WARNING,
    IsolationUnavailableError,
    Limits,
    SandboxError,
)
from agent_gym.sandbox.forkserver import ForkServer
from agent_gym.sandbox.launch import Launcher, find_bwrap
from agent_gym.sandbox.memory import MEMORY_BOUNDS
from agent_gym.sandbox.result import STATE_LOST, ExecResult
from agent_gym.sandbox.runner import StatefulSandbox, StatelessSandbox, open_sandbox

__all__ = [
    "ISOLATIONS",
    "MEMORY_BOUNDS",
    "RLIMITS_WARNING",
    "STATE_LOST",
    "ExecResult",
    "ForkServer",
    "IsolationUnavailableError",
    "Launcher",
    "Limits",
    "SandboxError",
    "StatefulSandbox",
    "StatelessSandbox",
    "find_bwrap",
    "open_sandbox",
]
