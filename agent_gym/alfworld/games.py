"""Finding and reading ALFWorld games: the real data set or the bundled synthetic one.

A game is a directory holding ``game.tw-pddl`` (JSON: PDDL domain, grammar, problem,
``solvable``, optionally a ``walkthrough``) and usually ``traj_data.json`` (task type,
targets). ALFWorld lays them out as ``<split>/<task_type>-<obj>-<mrecep>-<recep>-<scene>/
<trial>/``; the generator here writes the same layout. The bundled games leave the domain
and grammar out (they are the same in every game and would be 80% of the bytes): they are
filled in from the alfworld wheel when a game is read.

Where games come from, first match wins: an explicit path, ALFWorld's own data directory
``$ALFWORLD_DATA/json_2.1.1/<split>`` (alfworld defaults ``$ALFWORLD_DATA`` to
``~/.cache/alfworld``), the bundled synthetic set.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

# ALFWorld numbers its task types 1..6 in this order (alfred_tw_env.TASK_TYPES).
TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
SPLITS = ("train", "valid_seen", "valid_unseen")
GAME_FILE = "game.tw-pddl"
TRAJ_FILE = "traj_data.json"
SOURCES = ("path", "alfworld_data", "synthetic")
_SOLVABLE = re.compile(rb'"solvable"\s*:\s*true')


class GameError(ValueError):
    """Game data is missing, malformed, or does not fit the request."""


@dataclass(frozen=True)
class GameRef:
    """Where one game lives; reading it is deferred to ``read_game``."""

    task_id: str
    path: Path
    task_type: str


@dataclass(frozen=True)
class Game:
    """A game ready for textworld, plus what the env tells a critic about it."""

    data: dict[str, Any]
    task_type: str
    walkthrough: list[str] | None
    synthetic: bool


def parse_task_types(task_types: Iterable[str | int] | None) -> tuple[str, ...]:
    """Task-type names from names or ALFWorld's ids 1..6; None means all six."""
    if task_types is None:
        return TASK_TYPES
    if isinstance(task_types, str | int):
        task_types = [task_types]
    chosen = []
    for item in task_types:
        if isinstance(item, int) and not isinstance(item, bool) and 1 <= item <= len(TASK_TYPES):
            chosen.append(TASK_TYPES[item - 1])
        elif item in TASK_TYPES:
            chosen.append(item)
        else:
            raise GameError(f"unknown task type {item!r}; use ids 1-6 or one of {TASK_TYPES}")
    if not chosen:
        raise GameError("task_types is empty; pass None for all six")
    return tuple(dict.fromkeys(chosen))


def bundled_root() -> Path:
    """The synthetic games shipped in ``agent_gym/datasets/alfworld``."""
    return Path(str(resources.files("agent_gym") / "datasets" / "alfworld"))


def resolve_root(data_path: str | os.PathLike[str] | None, split: str) -> tuple[Path, str]:
    """The directory (or single game file) to read and which of ``SOURCES`` it is."""
    if split not in SPLITS:
        raise GameError(f"split must be one of {SPLITS}, got {split!r}")
    if data_path is not None:
        path = Path(data_path).expanduser()
        if not path.exists():
            raise GameError(f"ALFWorld data path {path} does not exist")
        if (path / split).is_dir():
            return path / split, "path"
        others = [name for name in SPLITS if (path / name).is_dir()]
        if others:
            # A labelled split must be that split: falling back to every game under the
            # path would report train games as, say, valid_unseen.
            raise GameError(
                f"ALFWorld data path {path} has no {split!r} split (it has {', '.join(others)})"
            )
        return path, "path"
    home = os.environ.get("ALFWORLD_DATA")
    if home and (Path(home) / "json_2.1.1" / split).is_dir():
        return Path(home) / "json_2.1.1" / split, "alfworld_data"
    return bundled_root() / split, "synthetic"


def find_games(root: Path, task_types: Sequence[str] = TASK_TYPES) -> list[GameRef]:
    """Every solvable game under ``root`` of the given types, in a stable order.

    Like ALFWorld's loader it skips the movable-receptacle and sliced-object variants
    (outside the six task types) and games marked unsolvable.
    """
    if root.is_file():
        files = [root]
        base = root.parent.parent
    else:
        files = sorted(root.rglob(GAME_FILE))
        base = root
    refs = []
    for path in files:
        task_id = path.parent.relative_to(base).as_posix()
        if "movable" in task_id or "Sliced" in task_id:
            continue
        task_type = _task_type(path)
        if task_type not in task_types or not _SOLVABLE.search(path.read_bytes()):
            continue
        refs.append(GameRef(task_id, path, task_type))
    return refs


def read_game(ref: GameRef) -> Game:
    """Read a game file and fill in the domain and grammar when they were left out."""
    try:
        data = json.loads(ref.path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise GameError(f"cannot read game {ref.path}: {err}") from err
    if not isinstance(data, dict) or "pddl_problem" not in data:
        raise GameError(f"{ref.path} is not a game.tw-pddl file (no pddl_problem)")
    traj = _read_traj(ref.path.parent / TRAJ_FILE)
    task_desc = task_description(traj) if traj else ""
    data.setdefault("pddl_domain", alfred_domain())
    if "grammar" not in data:
        if not task_desc:
            raise GameError(f"{ref.path} has no grammar and {TRAJ_FILE} gives no task text")
        data["grammar"] = alfred_grammar(task_desc)
    walkthrough = data.get("walkthrough")
    if walkthrough is not None and not (
        isinstance(walkthrough, list) and all(isinstance(c, str) for c in walkthrough)
    ):
        raise GameError(f"{ref.path}: walkthrough must be a list of commands")
    return Game(
        data=data,
        task_type=ref.task_type,
        walkthrough=walkthrough,
        synthetic=bool(traj.get("synthetic", False)),
    )


def task_description(traj: dict[str, Any]) -> str:
    """The task sentence a generated game was written with (its first annotation)."""
    anns = traj.get("turk_annotations", {}).get("anns") or [{}]
    return str(anns[0].get("task_desc", "")).strip()


@functools.cache
def alfred_domain() -> str:
    """The PDDL domain every ALFWorld game uses, from the alfworld wheel."""
    from alfworld.info import ALFRED_PDDL_PATH

    return Path(ALFRED_PDDL_PATH).read_text(encoding="utf-8")


def alfred_grammar(task_desc: str) -> str:
    """ALFWorld's text grammar with the task sentence in place of its placeholder."""
    return _alfred_twl2().replace("UNKNOWN GOAL", task_desc)


@functools.cache
def _alfred_twl2() -> str:
    from alfworld.info import ALFRED_TWL2_PATH

    return Path(ALFRED_TWL2_PATH).read_text(encoding="utf-8")


def _task_type(game_file: Path) -> str:
    """From the task directory name (``pick_two_obj_and_place-Mug-None-Desk-301``), else
    from traj_data.json."""
    for name in (game_file.parent.parent.name, game_file.parent.name):
        prefix = name.split("-", 1)[0]
        if prefix in TASK_TYPES:
            return prefix
    return str(_read_traj(game_file.parent / TRAJ_FILE).get("task_type", ""))


def _read_traj(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        traj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise GameError(f"cannot read {path}: {err}") from err
    return traj if isinstance(traj, dict) else {}
