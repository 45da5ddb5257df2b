"""The ``agent-gym`` command line: each area registers its own subcommands."""

from __future__ import annotations

import argparse
import json
import sys

import gymnasium

import agent_gym


def _list_envs(_: argparse.Namespace) -> int:
    for env_id in sorted(k for k in gymnasium.registry if k.startswith("agent_gym/")):
        print(env_id)
    return 0


def _replay(args: argparse.Namespace) -> int:
    with open(args.state, encoding="utf-8") as handle:
        env, observation, info = agent_gym.make_from_state(handle.read())
    print(json.dumps({"turn": info["turn"], "observation": observation}, ensure_ascii=False))
    env.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agent-gym", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("envs", help="list the registered environments").set_defaults(
        run=_list_envs
    )
    replay = commands.add_parser("replay", help="restore a saved EnvState JSON and verify it")
    replay.add_argument("state", help="path to a state saved with EnvState.to_json()")
    replay.set_defaults(run=_replay)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
