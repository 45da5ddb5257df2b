"""Every registered env passes the installed Gymnasium's own ``check_env``, at its defaults and
at each documented setting (protocols, modes, turn budgets).

The checker changes between Gymnasium releases (1.4 began refusing an env whose first step
truncates), so this runs whatever Gymnasium is installed: ``make test`` the pinned one,
``make test-latest`` the newest. The table is keyed by the registry, so an env registered
without a row here fails instead of going unchecked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import agent_gym  # noqa: F401  (registers the envs)
from agent_gym.alfworld.games import bundled_root, find_games
from tests.helpers.serve_process import running_server


def _small_game() -> str:
    """The bundled game with the fewest bytes: the quickest to load."""
    refs = find_games(bundled_root() / "train")
    return str(min(refs, key=lambda r: r.path.stat().st_size).path)


# Each registered env: the settings it documents. {} is the defaults.
SETTINGS: dict[str, list[dict[str, Any]]] = {
    "agent_gym/GSM8K-v0": [{}, {"max_turns": 3}],
    "agent_gym/CodeInterpreter-v0": [
        {},  # tool protocol, stateful
        {"mode": "stateless"},
        {"protocol": "fenced"},
        {"protocol": "fenced", "mode": "stateless"},
    ],
    "agent_gym/Search-v0": [{}, {"protocol": "tag"}, {"max_turns": 1}],
    "agent_gym/ALFWorld-v0": [{}, {"protocol": "text"}, {"show_admissible": False}],
    "agent_gym/Remote-v0": [{}],  # a client: checked against a served GSM8K below
    "agent_gym/Mixture-v0": [{"members": [
        {"env_id": "agent_gym/GSM8K-v0", "weight": 3},
        {"env_id": "agent_gym/Search-v0", "env_kwargs": {"protocol": "tag"}},
    ]}],
}
# ALFWorld's defaults read its real data when installed; the bundled game keeps this offline.
EXTRA = {"agent_gym/ALFWorld-v0": lambda: {"data_path": _small_game()}}


def test_every_registered_env_has_its_settings_checked() -> None:
    registered = {env_id for env_id in gymnasium.registry if env_id.startswith("agent_gym/")}
    assert registered == set(SETTINGS)


@pytest.fixture(autouse=True)
def private_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Caches go to a per-test dir; a real ALFWorld download must not replace the bundled
    games."""
    monkeypatch.setenv("AGENT_GYM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "no-alfworld-data"))


@pytest.mark.parametrize(
    ("env_id", "kwargs"),
    [(env_id, kwargs) for env_id, rows in SETTINGS.items() if env_id != "agent_gym/Remote-v0"
     for kwargs in rows],
    ids=lambda value: value.removeprefix("agent_gym/") if isinstance(value, str)
    else ",".join(f"{k}={v}" for k, v in value.items()) or "defaults",
)
def test_check_env_passes(env_id: str, kwargs: dict[str, Any]) -> None:
    extra = EXTRA.get(env_id, dict)()
    env = gymnasium.make(env_id, **extra, **kwargs)
    try:
        check_env(env.unwrapped, skip_render_check=False)
    finally:
        env.close()


def test_check_env_passes_for_the_remote_client() -> None:
    with running_server("agent_gym/GSM8K-v0") as url:
        env = gymnasium.make("agent_gym/Remote-v0", url=url)
        try:
            check_env(env.unwrapped, skip_render_check=False)
        finally:
            env.close()
