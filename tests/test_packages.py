"""The packages point one way: ``agent_gym_train`` imports ``agent_gym``, never the reverse
(``test_layers`` holds every import to that), and what crosses between them is kept small."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.version import Version

import agent_gym
from agent_gym._moved import MOVED, REMOVED_IN
from agent_gym.cli.main import BUILTIN_COMMANDS, build_parser

PACKAGE = Path(agent_gym.__file__).parent
ROOT = Path(__file__).resolve().parents[1]


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function (lazy imports too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_the_trainers_take_only_the_parsing_module_of_the_cli() -> None:
    """The CLI is the top of agent_gym's stack; a trainer borrows only how it parses."""
    trainers = PACKAGE.parent / "agent_gym_train"
    offenders = {
        str(path.relative_to(trainers)): sorted(
            name for name in _imported_modules(path)
            if name.startswith("agent_gym.cli") and name != "agent_gym.cli.parsing"
        )
        for path in trainers.rglob("*.py")
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_old_module_paths_import_for_one_release_with_a_warning() -> None:
    import agent_gym.env
    import agent_gym.eval.policies

    for old, new in MOVED.items():
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
            module = importlib.import_module(old)
        assert module is importlib.import_module(new)
    from agent_gym.core import TextEnv  # the alias is the module: one class, not a copy
    assert TextEnv is agent_gym.env.TextEnv
    assert agent_gym.eval.policies.make_policy is importlib.import_module(
        "agent_gym.policies").make_policy
    with pytest.warns(DeprecationWarning, match=r"agent_gym\.eval\.run\.evaluate"):
        from agent_gym.eval import evaluate
    assert evaluate is importlib.import_module("agent_gym.eval.run").evaluate
    with pytest.raises(ImportError):
        from agent_gym.eval import no_such_name  # noqa: F401


def test_an_old_path_warns_at_the_line_that_imports_it() -> None:
    """Python shows a DeprecationWarning by default only when it is attributed to
    ``__main__``: a warning that names the import system's frames is never seen."""
    import warnings

    sys.modules.pop("agent_gym.core", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import agent_gym.core  # noqa: F401

        from agent_gym.eval import evaluate  # noqa: F401
    assert {(warning.category, warning.filename) for warning in caught} == {
        (DeprecationWarning, __file__)}
    env = {key: value for key, value in os.environ.items() if key != "PYTHONWARNINGS"}
    done = subprocess.run([sys.executable, "-c", "import agent_gym.core"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0
    assert done.stderr.startswith("<string>:1: DeprecationWarning: agent_gym.core moved to "
                                  f"agent_gym.env; the old path is removed in agent-gym {REMOVED_IN}")


def test_the_old_paths_are_gone_by_the_release_that_removes_them() -> None:
    """When this fails, the release is here: delete agent_gym/_moved.py and its uses."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))[
        "project"]["version"]
    assert Version(declared) < Version(REMOVED_IN)
    with contextlib.suppress(PackageNotFoundError):
        assert Version(version("agent-gym")) < Version(REMOVED_IN)


def test_every_module_path_of_the_flat_layout_still_imports() -> None:
    """The flat layout's modules (its last commit, 8f27b7a^): each is a module or package of
    the same name now, or an entry of the shim's table (whose finder answers for it)."""
    flat = {"cli", "compare", "core", "data", "distributed", "eval", "extras", "hoststore",
            "policies", "protocols", "remote", "render", "report", "rescore", "rewards", "runs",
            "runs_cli", "server", "state", "tools"}
    missing = [name for name in sorted(flat) if importlib.util.find_spec(f"agent_gym.{name}") is None]
    assert missing == []


def test_env_commands_eval_and_envs_load_no_trainer_module(tmp_path: Path) -> None:
    """`agent-gym eval` with a scripted policy, `envs` and the env packages run without
    `agent_gym_train` ever entering the process."""
    script = f"""
import sys
import gymnasium
import agent_gym, agent_gym.eval.run, agent_gym.eval.policies
from agent_gym.cli.main import main
main(["envs"])
main(["eval", "agent_gym/GSM8K-v0", "--episodes", "2", "--quiet", "--out", {str(tmp_path)!r}])
env = gymnasium.make("agent_gym/Search-v0")
env.reset(seed=0)
env.close()
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "agent_gym_train")
assert not loaded, loaded
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]


def test_train_command_and_sampler_policies_come_from_entry_points() -> None:
    from importlib.metadata import entry_points

    from agent_gym.eval.policies import plugin_policies

    commands = {point.name for point in entry_points(group="agent_gym.commands")}
    assert "train" in commands and not commands & BUILTIN_COMMANDS
    assert {"local", "pytrio"} <= set(plugin_policies())
    parser = build_parser(list(entry_points(group="agent_gym.commands")))
    assert parser.parse_args(["train", "grpo", "--steps", "2"]).argv == ["--steps", "2"]


def test_missing_extra_messages_name_a_command_that_works_from_a_clone() -> None:
    """The package is not on PyPI: ``pip install 'agent-gym[x]'`` answers "No matching
    distribution", so every hint goes through ``install_hint``."""
    from agent_gym.extras import install_hint

    assert install_hint("search") == (
        "install the 'search' extra (in the agent-gym checkout: pip install -e '.[search]')")
    root = Path(__file__).resolve().parents[1]
    offenders = [str(path.relative_to(root)) for package in ("agent_gym", "agent_gym_train")
                 for path in (root / package).rglob("*.py")
                 if "pip install 'agent-gym[" in path.read_text(encoding="utf-8")]
    assert offenders == []
