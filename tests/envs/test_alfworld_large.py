"""The large ALFWorld set: held-out games enough to tell 10 points apart, kept apart by plan.

Its properties are checked on the shipped packs themselves (sizes, task-type mix, floor
plans computed from the games), the generator on a slice of it (it draws the
same games again), the env on a sample of held-out games (their walkthroughs win), and
the digest check on a damaged copy and on a differently drawn set."""

from __future__ import annotations

import json
import lzma
import shutil
import tracemalloc
from collections import Counter
from pathlib import Path

import gymnasium
import pytest
from alfworld.gen import constants

from agent_gym.alfworld import large
from agent_gym.alfworld.games import (
    LARGE_SPLITS,
    TASK_TYPES,
    GameError,
    GameRef,
    bundled_root,
    find_games,
    large_pack,
    read_game,
    read_pack,
)

ENV = "agent_gym/ALFWorld-v0"


@pytest.fixture(autouse=True)
def no_alfworld_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real ALFWorld download on this machine must not stand in for the bundled games."""
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "no-alfworld-data"))


def games(split: str) -> dict[str, tuple[dict, dict]]:
    return read_pack(large_pack(split))


def plan(task_id: str) -> int:
    """The floor plan, from the task directory's name (``...-Desk-301/trial_...``)."""
    return int(task_id.split("/")[0].rsplit("-", 1)[1])


def test_sizes_and_task_type_mix_per_split() -> None:
    for split, per_type in (("large_test", 40), ("large_train", 160)):
        stored = games(split)
        mix = Counter(traj["task_type"] for _, traj in stored.values())
        assert mix == dict.fromkeys(TASK_TYPES, per_type), split
        assert all(traj["split"] == split and traj["synthetic"] is True
                   and game["solvable"] is True and game["walkthrough"]
                   for game, traj in stored.values())
        # every game is its own: no problem is drawn twice
        assert len({game["pddl_problem"] for game, _ in stored.values()}) == len(stored)
    assert sum(large_pack(s).stat().st_size for s in LARGE_SPLITS) < 2_000_000


def test_held_out_games_share_no_floor_plan_with_any_train_split() -> None:
    """Computed from the games (their task directories, which their traj labels must
    agree with): the held-out plans are ALFRED's 24 held-out ones, and no train game, of
    the large set or the small bundled one, is set in any of them."""
    def plans(split: str) -> set[int]:
        root = large_pack(split) if split in LARGE_SPLITS else bundled_root() / split
        return {plan(ref.task_id) for ref in find_games(root)}

    assert all(traj["scene"]["scene_num"] == plan(task_id)
               for split in LARGE_SPLITS for task_id, (_, traj) in games(split).items())
    held_out = plans("large_test")
    assert held_out == set(constants.TEST_SCENE_NUMBERS)
    assert len(plans("large_train")) > 90  # nearly all of the 96 others
    for split in ("large_train", "train", "valid_seen"):
        assert plans(split) and not plans(split) & held_out, split


def test_generator_draws_the_shipped_games_again() -> None:
    """A slice of both splits, generated afresh, is byte for byte what the packs hold."""
    from agent_gym.alfworld.engine import Engine

    engine = Engine()
    try:
        drawn = [large.record(task_type, split, index, engine)
                 for task_type, split, index in (
                     ("look_at_obj_in_light", "large_test", 0),
                     ("pick_clean_then_place_in_recep", "large_test", 39),
                     ("pick_and_place_simple", "large_train", 159))]
    finally:
        engine.close()
    for made in drawn:
        game, traj = games(made["traj"]["split"])[made["task_id"]]
        assert large.pack_lines([made]) == large.pack_lines(
            [{"task_id": made["task_id"], "game": game, "traj": traj}])


def test_digest_check_accepts_the_set_and_refuses_another_draw() -> None:
    content = lzma.decompress(large_pack("large_test").read_bytes())
    records = [json.loads(line) for line in content.splitlines()]
    large.check("large_test", large.pack_lines(records))  # the canonical form is the file
    records[0]["game"]["walkthrough"] = records[0]["game"]["walkthrough"][:-1]
    with pytest.raises(GameError, match="not the recorded") as err:
        large.check("large_test", large.pack_lines(records))
    assert "\n" not in str(err.value)


def test_regenerating_a_different_set_is_refused_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A one-game "set" stands for a Python that draws other games: the command says so
    in one line, exit code 2, and leaves no pack behind."""
    monkeypatch.setattr(large, "TASK_TYPES", ("look_at_obj_in_light",))
    monkeypatch.setitem(large.PER_TYPE, "large_test", 1)
    assert large.main(["--regenerate", str(tmp_path / "out"), "--split", "large_test"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("alfworld-large: error: this Python") and len(err) == 2
    assert "not the recorded" in err[-1] and not (tmp_path / "out").exists()


def test_a_game_file_nested_too_deep_is_a_game_error(tmp_path: Path) -> None:
    """Game files under a data path are read as untrusted JSON: a document nested deep
    enough to break the parser is a one-line GameError, not a RecursionError."""
    game = tmp_path / "game.tw-pddl"
    game.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(GameError, match="nested deeper"):
        read_game(GameRef("x", game, ""))


@pytest.mark.parametrize("damage", ["flip a byte", "recompress other games"])
def test_a_damaged_pack_is_refused_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    copy = tmp_path / "large" / "large_test.jsonl.xz"
    copy.parent.mkdir()
    shutil.copyfile(large_pack("large_test"), copy)
    if damage == "flip a byte":
        raw = bytearray(copy.read_bytes())
        raw[len(raw) // 2] ^= 0x01
    else:  # a valid file with one game fewer
        lines = lzma.decompress(copy.read_bytes()).splitlines(keepends=True)
        raw = bytearray(lzma.compress(b"".join(lines[1:])))
    copy.write_bytes(bytes(raw))
    monkeypatch.setattr("agent_gym.alfworld.games.bundled_root", lambda: tmp_path)
    with pytest.raises(GameError) as err:
        gymnasium.make(ENV, split="large_test")
    assert str(copy) in str(err.value) and "\n" not in str(err.value)
    assert copy.read_bytes() == bytes(raw)  # refused, never replaced or deleted


def test_a_pack_that_decompresses_past_the_bound_is_refused_in_bounded_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 228 KB xz of 1.5 GB of zeros was inflated whole before the digest check (a
    MemoryError); here the bound is lowered to 1 MB and the bomb is 8 MB of zeros (xz -0:
    a dictionary of 256 KB, so the decoder's own memory does not hide the output's)."""
    pack = tmp_path / "large_test.jsonl.xz"
    pack.write_bytes(lzma.compress(bytes(8 * 2**20), preset=0))
    monkeypatch.setattr("agent_gym.alfworld.games.MAX_PACK_BYTES", 2**20)
    tracemalloc.start()
    try:
        with pytest.raises(GameError, match="decompresses to more than 1,048,576 bytes"):
            read_pack(pack)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, peak
    pack.write_bytes(lzma.compress(b"{}\n", filters=[{"id": lzma.FILTER_LZMA2,
                                                        "dict_size": 1536 * 2**20}]))
    with pytest.raises(GameError, match=r"[Mm]emory"):  # a dictionary of 1.5 GB is asked for
        read_pack(pack)


def test_env_loads_the_set_by_name_and_held_out_walkthroughs_win() -> None:
    train = gymnasium.make(ENV, split="large_train", restore_store=False)
    assert len(train.unwrapped.tasks) == 960
    train.close()
    env = gymnasium.make(ENV, split="large_test", protocol="text", restore_store=False)
    try:
        tasks = env.unwrapped.tasks
        assert len(tasks) == 240
        # the first game of each type: a sample that covers every task type
        sample = {task.payload["task_type"]: task.task_id for task in reversed(tasks)}
        for task_type, task_id in sample.items():
            _, info = env.reset(options={"task_id": task_id})
            assert (info["task_type"], info["synthetic"], info["data_source"]) == (
                task_type, True, "synthetic")
            reward = 0.0
            for action in info["privileged"]["oracle_actions"]:
                _, reward, terminated, truncated, _ = env.step(action)
            assert (reward, terminated, truncated) == (1.0, True, False), task_id
    finally:
        env.close()


def test_large_splits_keep_the_small_sets_and_refuse_unknown_names(tmp_path: Path) -> None:
    assert len(find_games(bundled_root() / "valid_unseen")) == 12
    with pytest.raises(GameError, match="large_test"):
        gymnasium.make(ENV, split="large")
    with pytest.raises(GameError, match="no digest is recorded"):
        find_games(tmp_path / "other.jsonl.xz")
