"""The trainers' flat module paths still import, as the modules now in run/ and backends/."""

from __future__ import annotations

import importlib
import sys

import pytest

FLAT = {"args": "run.args", "options": "run.args", "clients": "run.clients",
        "envpool": "run.envpool", "runfiles": "run.files", "journal": "run.journal",
        "pipeline": "run.pipeline", "tasks": "run.tasks", "episode": "run.episode",
        "rollout": "run.rollout", "store": "run.store", "losses": "run.losses",
        "models": "backends.models", "chat_template": "backends.chat_template",
        "tempo_critic": "critic"}


@pytest.mark.parametrize(("old", "new"), sorted(FLAT.items()))
def test_an_old_module_path_is_the_new_module(old: str, new: str) -> None:
    sys.modules.pop(f"agent_gym_train.{old}", None)
    with pytest.warns(DeprecationWarning, match=rf"agent_gym_train\.{old} moved to "
                                                rf"agent_gym_train\.{new}"):
        module = importlib.import_module(f"agent_gym_train.{old}")
    assert module is importlib.import_module(f"agent_gym_train.{new}")


def test_the_run_modules_names_come_from_the_run_folder() -> None:
    from agent_gym_train.run.run import open_run

    with pytest.warns(DeprecationWarning, match=r"agent_gym_train\.run\.run\.open_run"):
        from agent_gym_train.run import open_run as old
    assert old is open_run
    with pytest.raises(ImportError):
        from agent_gym_train.run import no_such_name  # noqa: F401
