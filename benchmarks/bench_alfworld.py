"""ALFWorld-v0 speed, each figure beside its baseline, on the largest bundled kitchen.

- reset: raw textworld (``textworld.start`` once, then ``env.reset()``, ALFWorld's wrappers)
  vs ALFWorld-v0 resetting to the game it holds (an engine snapshot) and to another game
  (a load);
- step: the same commands through raw textworld and through ALFWorld-v0 (tool-call parsing,
  admissibility check, the snapshot it records for fast restores);
- restore at depths 10/20/40: the fast path (snapshots this env took) vs the base class's
  full replay in the same env (game loaded, snapshots dropped) and in a fresh env (load +
  replay), all checked to give the same observation;
- generate: seconds per verified game, one per task type.

    python benchmarks/bench_alfworld.py [--out benchmarks/results/alfworld.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium
import textworld
from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

import agent_gym  # noqa: F401  (registers the envs)
from agent_gym.alfworld.engine import Engine
from agent_gym.alfworld.games import TASK_TYPES, bundled_root, find_games, read_game
from agent_gym.alfworld.generate import generate_game
from agent_gym.envs.alfworld import ALFWorldEnv

ENV = "agent_gym/ALFWorld-v0"
DEPTHS = (10, 20, 40)


def timed(action: Callable[[], Any]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000, 2)


def wander(env: ALFWorldEnv, depth: int, seed: int) -> list[str]:
    """A reproducible `depth`-command walk of admissible commands that does not win."""
    rng = random.Random(seed)
    _, info = env.reset(options={"task_id": env.task.task_id})
    commands: list[str] = []
    for _ in range(depth):
        command = rng.choice(info["admissible_actions"])
        _, _, terminated, _, info = env.step(env.protocol.format(command))
        if terminated:
            return wander(env, depth, seed + 1)
        commands.append(command)
    return commands


def raw_textworld(game_file: Path, commands: list[str]) -> dict[str, Any]:
    infos = textworld.EnvInfos(admissible_commands=True, won=True)
    start = time.perf_counter()
    raw = textworld.start(str(game_file), request_infos=infos,
                          wrappers=[AlfredDemangler(), AlfredInfos])
    raw.reset()
    load = time.perf_counter() - start
    resets = [timed(raw.reset) for _ in range(3)]
    steps = []
    for _ in range(2):
        raw.reset()
        steps += [timed(lambda c=c: raw.step(c)) for c in commands]
    raw.close()
    return {"load_and_reset_ms": round(load * 1000, 1), "reset": resets, "step": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/alfworld.json"))
    args = parser.parse_args()
    results: dict[str, Any] = {
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "load_average_at_start": round(os.getloadavg()[0], 2),
    }
    refs = find_games(bundled_root() / "train", ("pick_heat_then_place_in_recep",))
    kitchen, other = sorted(refs, key=lambda r: r.path.stat().st_size)[-1:-3:-1]
    env: ALFWorldEnv = gymnasium.make(ENV, split="train", task_types=[4],
                                      render_mode="ansi").unwrapped
    _, info = env.reset(options={"task_id": kitchen.task_id})
    walkthrough = info["privileged"]["walkthrough"]
    results["game"] = {"task_id": kitchen.task_id, "admissible_at_start":
                       len(info["admissible_actions"]), "walkthrough_steps": len(walkthrough)}

    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "game.tw-pddl"
        full.write_text(json.dumps(read_game(kitchen).data))
        raw = raw_textworld(full, walkthrough)

    # reset: to the held game (snapshot) and to another one (load), alternating the latter
    same = [timed(lambda: env.reset(options={"task_id": kitchen.task_id})) for _ in range(10)]
    switch = [timed(lambda t=t: env.reset(options={"task_id": t}))
              for t in (other.task_id, kitchen.task_id) * 2]
    results["reset"] = {
        "raw_textworld_reset_ms": median_ms(raw["reset"]),
        "raw_textworld_load_and_reset_ms": raw["load_and_reset_ms"],
        "same_game_ms": median_ms(same), "new_game_ms": median_ms(switch),
        "same_game_vs_raw_reset": round(statistics.median(same) /
                                        statistics.median(raw["reset"]), 4),
        "new_game_vs_raw_load_and_reset": round(statistics.median(switch) * 1000 /
                                                raw["load_and_reset_ms"], 2),
    }

    ours = []
    for _ in range(2):
        env.reset(options={"task_id": kitchen.task_id})
        ours += [timed(lambda c=c: env.step(env.protocol.format(c))) for c in walkthrough]
    results["step"] = {"raw_textworld_ms": median_ms(raw["step"]), "alfworld_v0_ms":
                       median_ms(ours), "ratio": round(statistics.median(ours) /
                                                       statistics.median(raw["step"]), 3)}

    # restore: one walk to depth 40, states saved at each depth of interest
    commands = wander(env, max(DEPTHS), seed=0)
    env.reset(options={"task_id": kitchen.task_id})
    states = {}
    for depth, command in enumerate(commands, start=1):
        env.step(env.protocol.format(command))
        if depth in DEPTHS:
            states[depth] = env.save_state()
    results["restore"] = {}
    for depth, state in states.items():
        expected = env.reset(options={"state": state})[0]
        fast = [timed(lambda s=state: env.reset(options={"state": s})) for _ in range(5)]
        warm, cold = [], []
        for _ in range(2):
            env._prefix_cache.clear()  # drop the snapshots: the base class replays every action
            warm.append(timed(lambda s=state: env.reset(options={"state": s})))
            assert env.render().endswith(expected)
            fresh = gymnasium.make(ENV, split="train", task_types=[4],
                                   render_mode="ansi").unwrapped
            cold.append(timed(lambda s=state, f=fresh: f.reset(options={"state": s})))
            assert fresh.render().endswith(expected)
            fresh.close()
        results["restore"][str(depth)] = {
            "fast_ms": median_ms(fast), "replay_same_env_ms": median_ms(warm),
            "replay_fresh_env_ms": median_ms(cold),
            "speedup_vs_same_env_replay": round(statistics.median(warm) /
                                                statistics.median(fast), 1),
            "speedup_vs_fresh_env_replay": round(statistics.median(cold) /
                                                 statistics.median(fast), 1),
        }
    env.close()

    engine = Engine()
    seconds = [timed(lambda t=t: generate_game(t, "train", 7, 1000, engine)) for t in TASK_TYPES]
    engine.close()
    results["generate"] = {"s_per_game_mean": round(statistics.fmean(seconds), 2),
                           "s_per_game_max": round(max(seconds), 2)}
    results["load_average_at_end"] = round(os.getloadavg()[0], 2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    _print_table(results)


def _print_table(r: dict[str, Any]) -> None:
    g = r["game"]
    print(f"game {g['task_id']} ({g['admissible_at_start']} admissible commands at start; "
          f"{r['cpus']} cpus, load average {r['load_average_at_start']} -> "
          f"{r['load_average_at_end']})")
    s = r["reset"]
    print(f"reset same game   {s['same_game_ms']:>9.2f} ms   raw textworld reset "
          f"{s['raw_textworld_reset_ms']:.1f} ms   ratio {s['same_game_vs_raw_reset']}")
    print(f"reset new game    {s['new_game_ms']:>9.1f} ms   raw textworld load+reset "
          f"{s['raw_textworld_load_and_reset_ms']:.1f} ms   ratio "
          f"{s['new_game_vs_raw_load_and_reset']}")
    t = r["step"]
    print(f"step              {t['alfworld_v0_ms']:>9.1f} ms   raw textworld step "
          f"{t['raw_textworld_ms']:.1f} ms   ratio {t['ratio']}")
    for depth, x in r["restore"].items():
        print(f"restore depth {depth:>2}  {x['fast_ms']:>9.2f} ms   replay same env "
              f"{x['replay_same_env_ms']:.0f} ms (x{x['speedup_vs_same_env_replay']})   "
              f"fresh env {x['replay_fresh_env_ms']:.0f} ms (x{x['speedup_vs_fresh_env_replay']})")
    print(f"generate          {r['generate']['s_per_game_mean']:>9.2f} s per verified game "
          f"(max {r['generate']['s_per_game_max']} s)")


if __name__ == "__main__":
    main()
