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

The large synthetic set (splits ``large_train`` and ``large_test``, written by
`agent_gym.alfworld.large`) is too many games for a directory per game: each split is
one pack, ``datasets/alfworld/large/<split>.jsonl.xz``, a game per line (its task id,
its ``game.tw-pddl`` without domain and grammar, its ``traj_data.json``). A pack is read
only if its content has the SHA-256 recorded in ``LARGE_DIGESTS``, so a damaged or
altered file is refused instead of measured on.
"""

from __future__ import annotations

import functools
import hashlib
import json
import lzma
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from agent_gym import untrusted

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
LARGE_SPLITS = ("large_train", "large_test")
GAME_FILE = "game.tw-pddl"
TRAJ_FILE = "traj_data.json"
PACK_SUFFIX = ".jsonl.xz"
SOURCES = ("path", "alfworld_data", "synthetic")
# The SHA-256 of each large split's pack, uncompressed (so another xz build compressing
# the same games differently is still the same set). Regenerating with a changed generator
# changes them: `python -m agent_gym.alfworld.large --regenerate` prints the new ones;
# record them and say so, since figures measured on the old set no longer compare.
LARGE_DIGESTS = {
    "large_train": "04c1b2e7fa641033f6dd2e34e5809fca253b8e315f693ce5c413cad10af4fbea",
    "large_test": "41bdbbebe4d31c033fd3b21511e40438dbb1c38aad7c2e1f33d02142b82f247b",
}
# The most a pack may decompress to: four times the larger shipped split (18.6 MB). A pack
# is checked by the digest of its content, so without a bound a 228 KB xz of 1.5 GB of
# zeros was inflated whole (a MemoryError) before any check could refuse it.
MAX_PACK_BYTES = 80 * 2**20
# What the decoder may allocate: a stream names its own dictionary (up to 1.5 GB); the
# shipped packs are xz -9 (a 64 MB dictionary).
PACK_MEMLIMIT = 128 * 2**20
_SOLVABLE = re.compile(rb'"solvable"\s*:\s*true')
_RESTORE = "reinstall agent-gym or restore the file from its repository"


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


def large_pack(split: str) -> Path:
    """The bundled pack of a large split."""
    return bundled_root() / "large" / f"{split}{PACK_SUFFIX}"


def resolve_root(data_path: str | os.PathLike[str] | None, split: str) -> tuple[Path, str]:
    """The directory (or single game file, or pack) to read and which of ``SOURCES`` it is."""
    if split not in SPLITS + LARGE_SPLITS:
        raise GameError(f"split must be one of {SPLITS + LARGE_SPLITS}, got {split!r}")
    if data_path is not None:
        path = Path(data_path).expanduser()
        if not path.exists():
            raise GameError(f"ALFWorld data path {path} does not exist")
        if (path / split).is_dir():
            return path / split, "path"
        others = [name for name in SPLITS + LARGE_SPLITS if (path / name).is_dir()]
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
    if split in LARGE_SPLITS:
        return large_pack(split), "synthetic"
    return bundled_root() / split, "synthetic"


def find_games(root: Path, task_types: Sequence[str] = TASK_TYPES) -> list[GameRef]:
    """Every solvable game under ``root`` of the given types, in a stable order.

    Like ALFWorld's loader it skips the movable-receptacle and sliced-object variants
    (outside the six task types) and games marked unsolvable. ``root`` may be a pack
    (see ``read_pack``), whose games are all solvable and of the six types.
    """
    if root.name.endswith(PACK_SUFFIX):
        return [GameRef(task_id, root, traj["task_type"])
                for task_id, (_, traj) in read_pack(root).items()
                if traj["task_type"] in task_types]
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
    """Read a game (from its file or its pack) and fill in the domain and grammar when
    they were left out."""
    if ref.path.name.endswith(PACK_SUFFIX):
        try:
            stored, traj = read_pack(ref.path)[ref.task_id]
        except KeyError:
            raise GameError(f"{ref.path} holds no game {ref.task_id!r}") from None
        data = dict(stored)  # the pack's copy stays as it was read
    else:
        try:
            data = untrusted.loads(ref.path.read_bytes())
        except (OSError, ValueError) as err:
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


def read_pack(path: Path) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Task id -> (game, traj) of a pack, refused unless its content has the SHA-256
    recorded for its split in ``LARGE_DIGESTS``; read and checked once per process while
    the file is unchanged. A refused file is left as it is."""
    split = path.name.removesuffix(PACK_SUFFIX)
    if split not in LARGE_DIGESTS:
        raise GameError(f"{path}: no digest is recorded for a pack named {split!r} "
                        f"(known: {', '.join(LARGE_DIGESTS)})")
    try:
        stat = path.stat()
    except OSError as err:
        raise GameError(f"cannot read pack {path}: {err}") from err
    return _read_pack(path.resolve(), stat.st_ino, stat.st_size, stat.st_mtime_ns,
                      LARGE_DIGESTS[split])


@functools.lru_cache(maxsize=8)
def _read_pack(
    path: Path, inode: int, size: int, mtime_ns: int, want: str
) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """The stat fields are only part of the cache key: a changed file is read again."""
    try:
        content = _inflate_pack(path)
    except (OSError, lzma.LZMAError, EOFError) as err:
        raise GameError(f"cannot read pack {path} ({err}): it is damaged; {_RESTORE}") from err
    got = hashlib.sha256(content).hexdigest()
    if got != want:
        raise GameError(f"{path} does not have the SHA-256 recorded for it ({got[:16]}... "
                        f"instead of {want[:16]}...): it is not the shipped set; {_RESTORE}")
    games = {}
    for line in content.splitlines():  # the digest vouches for it: this is the set we wrote
        record = json.loads(line)
        games[record["task_id"]] = (record["game"], record["traj"])
    return games


def _inflate_pack(path: Path) -> bytes:
    """The pack's content, decompressed a bounded chunk at a time and refused (``EOFError``,
    ``LZMAError``) past ``MAX_PACK_BYTES``, past ``PACK_MEMLIMIT`` of decoder memory, or
    short of its end: memory stays within the bounds whatever the file claims to hold."""
    limit = MAX_PACK_BYTES
    decompressor = lzma.LZMADecompressor(format=lzma.FORMAT_XZ, memlimit=PACK_MEMLIMIT)
    parts: list[bytes] = []
    size = 0
    with path.open("rb") as handle:
        while not decompressor.eof:
            data = handle.read(1 << 16) if decompressor.needs_input else b""
            if not data and decompressor.needs_input:
                raise EOFError("the compressed data ends early")
            part = decompressor.decompress(data, limit + 1 - size)
            size += len(part)
            if size > limit:
                raise lzma.LZMAError(f"it decompresses to more than {limit:,} bytes")
            parts.append(part)
        if decompressor.unused_data or handle.read(1):
            raise lzma.LZMAError("bytes follow the compressed data")
    return b"".join(parts)


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
        traj = untrusted.loads(path.read_bytes())
    except (OSError, ValueError) as err:
        raise GameError(f"cannot read {path}: {err}") from err
    return traj if isinstance(traj, dict) else {}
