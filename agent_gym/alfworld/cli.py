"""`agent-gym alfworld generate`: write original, verified ALFWorld games."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from agent_gym.alfworld.games import SPLITS, TASK_TYPES, GameError, parse_task_types


def register(subparsers: Any) -> None:
    """Add the `alfworld` command group to the top-level `agent-gym` parser."""
    alfworld = subparsers.add_parser("alfworld", help="ALFWorld game tools")
    commands = alfworld.add_subparsers(dest="alfworld_command", required=True)
    generate = commands.add_parser(
        "generate", help="write new solvable games of the six task types",
        description="Build games from the floor plans and PDDL domain the alfworld wheel "
        "ships, play each walkthrough on the engine and keep the game only if it wins. "
        "Writes OUT_DIR/<split>/<task>/<trial>/{game.tw-pddl,traj_data.json}, ALFWorld's "
        "layout, usable as ALFWorld-v0's data_path. About 1-3 s per game.",
    )
    generate.add_argument("out_dir", type=Path, help="where the games are written")
    generate.add_argument("--split", nargs="+", choices=SPLITS, default=["train"],
                          help="splits to write (default: train)")
    generate.add_argument("--per-type", type=int, default=10,
                          help="games per task type (default: 10)")
    generate.add_argument("--task-types", nargs="+", default=None, metavar="TYPE",
                          help=f"names or ids 1-6 of {', '.join(TASK_TYPES)} (default: all)")
    generate.add_argument("--seed", type=int, default=0,
                          help="seed of the layouts and goals (default: 0)")
    generate.add_argument("--strip", action="store_true",
                          help="leave the domain and grammar out (ALFWorld-v0 fills them in)")
    generate.set_defaults(run=_generate)


def _generate(args: argparse.Namespace) -> int:
    try:
        types = parse_task_types(
            None if args.task_types is None
            else [int(t) if t.isdigit() else t for t in args.task_types]
        )
    except GameError as err:
        print(f"agent-gym alfworld generate: error: {err}", file=sys.stderr)
        return 2
    if args.per_type < 1:
        print("agent-gym alfworld generate: error: --per-type must be at least 1",
              file=sys.stderr)
        return 2
    from agent_gym.alfworld.generate import GeneratedGame, GenerationError, generate

    start = time.perf_counter()
    count = 0

    def report(game: GeneratedGame) -> None:
        nonlocal count
        count += 1
        print(f"[{count}] {game.traj['split']}/{game.task_dir}/{game.trial}: "
              f"{len(game.game['walkthrough'])} steps", flush=True)

    try:
        generate(args.out_dir, args.split, args.per_type, task_types=types, seed=args.seed,
                 strip=args.strip, progress=report)
    except (GenerationError, OSError) as err:
        print(f"agent-gym alfworld generate: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {count} games to {args.out_dir} in {time.perf_counter() - start:.0f} s")
    return 0
