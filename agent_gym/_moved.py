"""The module paths of the flat layout, kept importable for one release.

The package was regrouped into folders that are its layers (``env``, ``actions``, ``eval``,
``serve``, ``cli``). Code written against the old paths (``agent_gym.core``,
``agent_gym.protocols``, ...) still imports: the old name resolves to the module at its new
home -- the same module object, so classes, isinstance checks and pickles agree -- with a
``DeprecationWarning`` naming the new path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

# old module -> new module; the next release drops this table.
MOVED: dict[str, str] = {
    "agent_gym.core": "agent_gym.env",
    "agent_gym.state": "agent_gym.env.state",
    "agent_gym.hoststore": "agent_gym.env.hoststore",
    "agent_gym.tools": "agent_gym.actions.tools",
    "agent_gym.protocols": "agent_gym.actions.protocols",
    "agent_gym.policies": "agent_gym.eval.policies",
    "agent_gym.runs": "agent_gym.eval.runs",
    "agent_gym.compare": "agent_gym.eval.compare",
    "agent_gym.rescore": "agent_gym.eval.rescore",
    "agent_gym.report": "agent_gym.eval.report",
    "agent_gym.server": "agent_gym.serve.app",
    "agent_gym.remote": "agent_gym.serve.remote",
    "agent_gym.distributed": "agent_gym.serve.distributed",
    "agent_gym.runs_cli": "agent_gym.cli.runs",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        new = MOVED[module.__name__]
        warnings.warn(f"{module.__name__} moved to {new}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=3)
        # The import system returns what sys.modules holds under the name once this returns.
        sys.modules[module.__name__] = importlib.import_module(new)


def install() -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())
