"""The large ALFWorld set: held-out games enough to tell 10 points apart, kept apart by plan.

The bundled set's 12 ``valid_unseen`` games give a 95% interval of about +-0.28 on a
success rate; ``large_test`` has 240 (40 of each task type, about +-0.06), ``large_train``
four times as many. Both are drawn by `agent_gym.alfworld.generate` with its own seed and
split names, so no game repeats one of the bundled set. ``large_test`` games are set only
in ALFRED's 24 held-out floor plans (six per room type), ``large_train`` games only in the
96 others: no room layout -- receptacles, their places, the reachable floor -- is shared
between the splits, the same separation ALFRED's ``valid_unseen`` rests on. Every game's
walkthrough was played on the engine and wins.

Generating costs about a CPU-second per game (the engine loads each game and plays its
walkthrough), 20 minutes of one core for the set, so it is generated once and shipped
as two packs (see `agent_gym.alfworld.games.read_pack`), which the env reads only
when their content has the digests recorded in ``games.LARGE_DIGESTS``. Regenerate and
check them (a Python that draws another set is refused, nothing is written)::

    python -m agent_gym.alfworld.large --regenerate OUT_DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent_gym.alfworld.games import (
    LARGE_DIGESTS,
    LARGE_SPLITS,
    PACK_SUFFIX,
    TASK_TYPES,
    GameError,
    find_games,
    large_pack,
)
from agent_gym.durable import SHARED_MODE, replace_file

if TYPE_CHECKING:  # the engine needs textworld, which checking the packs does not
    from agent_gym.alfworld.engine import Engine

NAME = "alfworld-large"
SEED = 38
PER_TYPE = {"large_train": 160, "large_test": 40}
DESCRIPTION = ("Check the large ALFWorld set's packs against their recorded digests, or "
               "regenerate them (about a CPU-second per game, on one core) and check those.")


def record(task_type: str, split: str, index: int, engine: Engine) -> dict[str, Any]:
    """One game of the set as its pack stores it; the same arguments give the same game."""
    from agent_gym.alfworld.generate import generate_game

    made = generate_game(task_type, split, SEED, index, engine)
    return {"task_id": f"{made.task_dir}/{made.trial}", "game": made.game, "traj": made.traj}


def render(split: str, progress: Callable[[dict[str, Any]], None] | None = None) -> bytes:
    """The uncompressed pack of ``split``: every game as one JSON line, by task id."""
    from agent_gym.alfworld.engine import Engine

    engine = Engine()
    records = []
    try:
        for task_type in TASK_TYPES:
            for index in range(PER_TYPE[split]):
                records.append(record(task_type, split, index, engine))
                if progress is not None:
                    progress(records[-1])
    finally:
        engine.close()
    return pack_lines(records)


def pack_lines(records: Sequence[dict[str, Any]]) -> bytes:
    """The bytes the digest is taken of: one canonical JSON line per game, by task id."""
    ordered = sorted(records, key=lambda r: r["task_id"])
    return b"".join(json.dumps(r, sort_keys=True, separators=(",", ":")).encode() + b"\n"
                    for r in ordered)


def check(split: str, content: bytes) -> None:
    """Refuse content that is not the recorded set (another Python's random numbers, or a
    changed generator whose new digests were not recorded)."""
    got = hashlib.sha256(content).hexdigest()
    if got != LARGE_DIGESTS[split]:
        raise GameError(
            f"this Python ({sys.version.split()[0]}) generates a {split} pack with "
            f"SHA-256 {got}, not the recorded {LARGE_DIGESTS[split][:16]}...: its random "
            "numbers differ, or the generator changed and this digest is not recorded yet "
            "(record it in agent_gym.alfworld.games.LARGE_DIGESTS to publish a new set)"
        )


def regenerate(out_dir: Path, splits: Sequence[str],
               progress: Callable[[dict[str, Any]], None] | None = None) -> list[Path]:
    """Generate the packs of ``splits`` into ``out_dir``, each written only once it
    checks out, and return their paths."""
    written = []
    for split in splits:
        content = render(split, progress)
        check(split, content)
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{split}{PACK_SUFFIX}"
        replace_file(path, lzma.compress(content, preset=9), mode=SHARED_MODE)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}", description=DESCRIPTION)
    parser.add_argument("--regenerate", type=Path, metavar="OUT_DIR",
                        help="generate the packs into OUT_DIR (not the installed ones)")
    parser.add_argument("--split", nargs="+", choices=LARGE_SPLITS, default=list(LARGE_SPLITS),
                        help="splits to check or regenerate (default: both)")
    args = parser.parse_args(argv)
    try:
        if args.regenerate is not None:
            count = 0

            def report(made: dict[str, Any]) -> None:
                nonlocal count
                count += 1
                print(f"[{count}] {made['traj']['split']}/{made['task_id']}", file=sys.stderr,
                      flush=True)

            paths = regenerate(args.regenerate, args.split, report)
        else:
            paths = [large_pack(split) for split in args.split]
        for path in paths:
            print(f"{path}: {len(find_games(path))} games, {path.stat().st_size} bytes, "
                  "digest checked")
    except (GameError, OSError) as err:
        print(f"{NAME}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
