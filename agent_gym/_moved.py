"""The module paths of the flat layout, kept importable until agent-gym ``REMOVED_IN``.

The package was regrouped into folders that are its layers (``env``, ``actions``, ``eval``,
``serve``, ``cli``), and the host store then left ``env`` for the leaves. Code written
against an old path (``agent_gym.core``, ``agent_gym.protocols``, ``agent_gym.env.hoststore``,
...) still imports: the old name resolves to the module at its new home -- the same module
object, so classes, isinstance checks and pickles agree -- with a ``DeprecationWarning``
naming the new path, attributed to the importing line so that Python shows it by default
in a script.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

REMOVED_IN = "0.2.0"  # the release that deletes this module; a test fails once it is reached
# old module -> new module
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
    "agent_gym.eval.runlog": ("RunLog", "RunMismatchError"),
    "agent_gym.eval.runfiles": ("record_key", "EPISODES_FILE", "ERRORS_FILE"),
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
    # 1 is this function, 2 the module's __getattr__, 3 the importing line (the import
    # system's own frames in between are skipped by warnings).
    warnings.warn(f"{package}.{name} moved to {module}.{name}; the old path is removed in "
                  f"agent-gym {REMOVED_IN}", DeprecationWarning, stacklevel=3)
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
        # 1 is this method; warnings skips the import system's frames, so 2 is the import
        # statement (through importlib.import_module, importlib's own line instead).
        warnings.warn(f"{module.__name__} moved to {new}; the old path is removed in agent-gym "
                      f"{REMOVED_IN}", DeprecationWarning, stacklevel=2)
        # The import system returns what sys.modules holds under the name once this returns.
        sys.modules[module.__name__] = importlib.import_module(new)


def register(modules: dict[str, str], names: dict[str, dict[str, str]]) -> None:
    """Old paths of a package built on agent_gym (the trainers), kept for the same release:
    the package knows its own history, this module only answers for it."""
    MOVED.update(modules)
    for package, moved in names.items():
        MOVED_NAMES.setdefault(package, {}).update(moved)
    install()


def install() -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())
