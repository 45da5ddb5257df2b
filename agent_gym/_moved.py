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
    # Back out of env/: the engines share the host store, and they sit below the contract.
    "agent_gym.env.hoststore": "agent_gym.hoststore",
}


# Names of the flat ``agent_gym/eval.py`` and ``agent_gym/cli.py``, whose paths are packages
# now: ``from agent_gym.eval import evaluate`` still works (``moved_attribute``). Not
# ``agent_gym.cli.main``: that is the command's module now (the script is
# ``agent_gym.cli.main:main``).
_EVAL_NAMES = {
    "agent_gym.eval.config": ("EvalConfig", "Key", "IDENTITY", "episode_seed"),
    "agent_gym.eval.stats": ("wilson_interval", "pass_at_k", "bootstrap_interval",
                             "rate_interval", "percentile"),
    "agent_gym.eval.runlog": ("RunLog", "RunMismatchError", "record_key", "EPISODES_FILE",
                              "ERRORS_FILE"),
    "agent_gym.eval.summary": ("ReplyCounts", "Summary", "summarize", "format_table",
                               "overall_summary"),
    "agent_gym.eval.run": ("action_protocol", "play_episode", "evaluate"),
}
MOVED_NAMES: dict[str, dict[str, str]] = {
    "agent_gym.eval": {name: module for module, names in _EVAL_NAMES.items() for name in names},
    "agent_gym.cli": {
        **dict.fromkeys(("build_parser", "UserError"), "agent_gym.cli.main"),
        **dict.fromkeys(("OneLineParser", "DefaultsHelpFormatter", "add_env_arg"),
                        "agent_gym.cli.parsing"),
    },
}


def moved_attribute(package: str, name: str) -> object:
    """A name the flat module ``package`` had, from the module that holds it now."""
    module = MOVED_NAMES.get(package, {}).get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    warnings.warn(f"{package}.{name} moved to {module}.{name}; the old path goes in the next "
                  "release", DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(module), name)


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
