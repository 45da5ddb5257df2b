"""Under ``python -OO`` docstrings are None: a command's ``--help`` must not read its
description off a docstring."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


@pytest.mark.parametrize("name", ["grpo", "tempo", "sft", "demo"])
def test_a_trainers_help_needs_no_docstring(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = importlib.import_module(f"agent_gym_train.{name}")
    first_paragraph = module.__doc__.split("\n\n")[0]
    assert first_paragraph == module.DESCRIPTION
    monkeypatch.setattr(module, "__doc__", None)  # what -OO leaves
    with pytest.raises(SystemExit) as stopped:
        module.main(["--help"])
    assert stopped.value.code == 0
    assert " ".join(module.DESCRIPTION.split()) in " ".join(capsys.readouterr().out.split())


def _runs_optimized(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-OO", *argv], capture_output=True, text=True,
                          timeout=300)


def test_train_grpo_help_runs_under_python_OO() -> None:
    # peft and transformers' model classes build docstrings at import (auto_docstring) and
    # some versions raise under -OO before any of agent_gym's code runs.
    if _runs_optimized("-c", "import peft").returncode != 0:
        pytest.skip("peft/transformers cannot be imported under python -OO here")
    done = _runs_optimized("-m", "agent_gym.cli", "train", "grpo", "--help")
    assert done.returncode == 0, done.stderr
    assert "GRPO on agent_gym environments" in done.stdout


def test_the_corpus_generator_help_runs_under_python_OO() -> None:
    done = _runs_optimized("-m", "agent_gym.search.world", "--help")
    assert done.returncode == 0, done.stderr
    assert "Generate the bundled search corpus" in done.stdout
