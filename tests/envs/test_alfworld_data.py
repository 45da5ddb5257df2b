"""The bundled synthetic ALFWorld games and the generator that wrote them."""

from __future__ import annotations

import json
import multiprocessing
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from agent_gym.alfworld.games import (
    SPLITS,
    TASK_TYPES,
    GameRef,
    bundled_root,
    find_games,
    read_game,
)
from agent_gym.cli.main import main

ENGINE = None


def bundled() -> list[GameRef]:
    return [ref for split in SPLITS for ref in find_games(bundled_root() / split)]


def test_bundled_set_is_small_labelled_and_covers_every_type() -> None:
    refs = bundled()
    train = Counter(ref.task_type for ref in refs if ref.path.is_relative_to(bundled_root() /
                                                                             "train"))
    assert len(refs) >= 60 and all(train[t] >= 10 for t in TASK_TYPES)
    for split in ("valid_seen", "valid_unseen"):
        assert {r.task_type for r in find_games(bundled_root() / split)} == set(TASK_TYPES)
    # The small set stays small; the large splits (two compressed packs) have their own bound.
    small = [p for split in ("train", "valid_seen", "valid_unseen")
             for p in (bundled_root() / split).rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in small) < 1_700_000
    packs = [p for p in (bundled_root() / "large").rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in packs) < 1_000_000
    for ref in refs:
        stored = json.loads(ref.path.read_text())
        assert "pddl_domain" not in stored and "grammar" not in stored
        traj = json.loads((ref.path.parent / "traj_data.json").read_text())
        assert traj["synthetic"] is True and traj["task_type"] == ref.task_type
    # valid_unseen rooms are ALFRED's held-out floor plans, never used for training games.
    def plans(split: str) -> set[int]:
        return {json.loads((r.path.parent / "traj_data.json").read_text())["scene"]["scene_num"]
                for r in find_games(bundled_root() / split)}
    assert not plans("valid_unseen") & plans("train")


def walk(path: str) -> str | None:
    """In a worker process: load one bundled game and play its stored walkthrough."""
    global ENGINE
    from agent_gym.alfworld.engine import Engine
    from agent_gym.alfworld.generate import play

    if ENGINE is None:
        ENGINE = Engine()
    ref = GameRef(path, Path(path), "")
    game = read_game(ref)
    ENGINE.load(game.data)
    return play(ENGINE, game.walkthrough or [])


@pytest.mark.slow
def test_every_bundled_walkthrough_wins_exactly_at_its_end() -> None:
    """All games, two worker processes (about 100 CPU-seconds)."""
    paths = [str(ref.path) for ref in bundled()]
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(2, mp_context=spawn) as pool:
        problems = dict(zip(paths, pool.map(walk, paths, chunksize=4), strict=True))
    assert {path: problem for path, problem in problems.items() if problem} == {}
    assert len(problems) >= 60


def test_generator_writes_verified_games_reproducibly(tmp_path: Path) -> None:
    arguments = ["alfworld", "generate", "--split", "valid_unseen", "--per-type", "1",
                 "--task-types", "2", "pick_cool_then_place_in_recep"]
    assert main([*arguments[:2], str(tmp_path / "a"), *arguments[2:]]) == 0
    assert main([*arguments[:2], str(tmp_path / "b"), *arguments[2:], "--strip"]) == 0
    first = sorted((tmp_path / "a").rglob("game.tw-pddl"))
    second = sorted((tmp_path / "b").rglob("game.tw-pddl"))
    assert [p.relative_to(tmp_path / "a") for p in first] == [
        p.relative_to(tmp_path / "b") for p in second]
    assert len(first) == 2
    for full, stripped in zip(first, second, strict=True):
        data, lean = json.loads(full.read_text()), json.loads(stripped.read_text())
        assert {k: v for k, v in data.items() if k not in ("pddl_domain", "grammar")} == lean
        assert (full.parent / "traj_data.json").read_text() == (
            stripped.parent / "traj_data.json").read_text()
        # The loader rebuilds exactly the domain and grammar the full file carries.
        rebuilt = read_game(GameRef("x", stripped, "")).data
        assert (rebuilt["pddl_domain"], rebuilt["grammar"]) == (data["pddl_domain"],
                                                                data["grammar"])


def test_generator_refuses_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["alfworld", "generate", str(tmp_path), "--task-types", "9"]) == 2
    assert "unknown task type" in capsys.readouterr().err
    assert main(["alfworld", "generate", str(tmp_path), "--per-type", "0"]) == 2
    assert not any(tmp_path.iterdir())
