"""The packages point one way: ``agent_gym_train`` imports ``agent_gym``, never the reverse
(``test_layers`` holds every import to that), and what crosses between them is kept small."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import agent_gym
from agent_gym.cli.main import BUILTIN_COMMANDS, build_parser

PACKAGE = Path(agent_gym.__file__).parent


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
    import importlib

    import agent_gym.env
    import agent_gym.eval.policies
    from agent_gym._moved import MOVED

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
