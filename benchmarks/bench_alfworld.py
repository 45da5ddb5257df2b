"""ALFWorld-v0 speed, each figure beside its baseline, on the largest bundled kitchen.

- reset: raw textworld (``textworld.start`` once, then ``env.reset()``, ALFWorld's wrappers)
  vs ALFWorld-v0 resetting to the game it holds (an engine snapshot) and to another game
  (a load);
- step: the same commands through raw textworld and through ALFWorld-v0 (tool-call parsing,
  admissibility check, the snapshot it records for fast restores);
- restore at depths 10/20/40: the fast path (snapshots this env took) vs the base class's
  full replay in the same env (game loaded, snapshots and host store off); a fresh
  instance in this process (host store: the planner's moves redone); and in a **fresh
  process** (``python`` started anew, env made with no option, then the timed restore):
  the default host store vs ``restore_store=False`` (the full replay: translate + load +
  every step), every one checked to give the same observation (the digest check is always
  on);
- episodes: oracle episodes on random bundled games (every game's translation already
  in the host store) through one env in one process vs an ``AsyncVectorEnv(2)`` with
  next-step autoreset, in episodes per second;
- generate: seconds per verified game, one per task type.

Every env is made as a user makes it, without ``restore_store``: the host store is the
default file, in ``$AGENT_GYM_CACHE``, which the benchmark points at a scratch directory
so that each run starts from an empty store and leaves nothing in the user's cache.

    python benchmarks/bench_alfworld.py [--out benchmarks/results/alfworld.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium
import textworld
from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
from gymnasium.vector import AutoresetMode
from harness import RESULTS, Result

import agent_gym  # noqa: F401  (registers the envs)
from agent_gym.alfworld.engine import Engine
from agent_gym.alfworld.games import TASK_TYPES, bundled_root, find_games, read_game
from agent_gym.alfworld.generate import generate_game
from agent_gym.envs.alfworld import ALFWorldEnv
from agent_gym.hoststore import STORE_PATH_ENV

ENV = "agent_gym/ALFWorld-v0"
DEPTHS = (10, 20, 40)
EPISODE_TASK_TYPES = [2, 3]  # the episodes' games (20 bundled train games)
EPISODES = 16


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


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


def restore_in_child(state_file: str, store: str) -> None:
    """The fresh-process restore: this process has imported agent_gym and made the env
    (``store`` "default": no option; "off": ``restore_store=False``); prints how long the
    restore took and the observation it gave."""
    state = Path(state_file).read_text()
    off = {"restore_store": False} if store == "off" else {}
    env: ALFWorldEnv = gymnasium.make(ENV, split="train", task_types=[4], **off).unwrapped
    start = time.perf_counter()
    observation, info = env.reset(options={"state": state})
    seconds = time.perf_counter() - start
    env.close()
    print(json.dumps({"seconds": seconds, "observation": observation,
                      "source": info["snapshot_source"], "skipped": info["snapshot_depth"]}))


def fresh_process_restore(state_json: str, store: str, expected: str) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        handle.write(state_json)
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--child-restore", handle.name, store],
            capture_output=True, text=True, check=True, timeout=600)
    finally:
        os.unlink(handle.name)
    answer = json.loads(done.stdout.splitlines()[-1])
    assert answer["observation"] == expected, "the fresh process restored somewhere else"
    assert (answer["source"] == "store") == (store == "default"), answer
    return float(answer["seconds"])


def oracle_episodes_one_process(episodes: int) -> float:
    """Episodes per second of one env in this process, playing each game's walkthrough."""
    env = gymnasium.make(ENV, split="train", task_types=EPISODE_TASK_TYPES)
    start = time.perf_counter()
    _, info = env.reset(seed=1)
    for _ in range(episodes):
        for action in info["privileged"]["oracle_actions"]:
            _, _, terminated, _, _ = env.step(action)
        assert terminated
        _, info = env.reset()
    seconds = time.perf_counter() - start
    env.close()
    return episodes / seconds


def oracle_episodes_async_vector(episodes: int, num_envs: int = 2) -> float:
    """Episodes per second of an AsyncVectorEnv whose sub-envs reset themselves on the
    step after an episode ends (next-step autoreset): no batch ever waits for a reset
    outside a step, and with games translated once per host a reset costs milliseconds."""
    vec = gymnasium.make_vec(ENV, num_envs=num_envs, vectorization_mode="async",
                             vector_kwargs={"autoreset_mode": AutoresetMode.NEXT_STEP},
                             split="train", task_types=EPISODE_TASK_TYPES)
    start = time.perf_counter()
    _, infos = vec.reset(seed=[1 + i for i in range(num_envs)])
    plans = [list(infos["privileged"]["oracle_actions"][i]) for i in range(num_envs)]
    finished = 0
    while finished < episodes:
        actions = [plan.pop(0) if plan else "" for plan in plans]
        _, _, terminated, truncated, infos = vec.step(actions)
        for i in range(num_envs):
            if infos.get("_privileged", [False] * num_envs)[i]:  # reset on this step
                plans[i] = list(infos["privileged"]["oracle_actions"][i])
            elif terminated[i] or truncated[i]:
                finished += 1
    seconds = time.perf_counter() - start
    vec.close()
    return finished / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "alfworld.json")
    parser.add_argument("--child-restore", nargs=2, metavar=("STATE_FILE", "STORE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_restore:
        restore_in_child(*args.child_restore)
        return
    result = Result()
    scratch = tempfile.TemporaryDirectory()
    # The default host store, in a cache directory of this run's own (children inherit it)
    os.environ["AGENT_GYM_CACHE"] = scratch.name
    os.environ.pop(STORE_PATH_ENV, None)
    results: dict[str, Any] = result.figures
    results.update({
        "uptime_at_start": uptime(),
        "host_store": "the default file (no restore_store) in a scratch $AGENT_GYM_CACHE",
    })
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
        warm, instance, child_store, child_replay = [], [], [], []
        for _ in range(2):
            env.prefixes.clear()  # drop the snapshots and the store: replay every action
            kept = env.prefixes.store
            env.use_prefix_store(None)
            warm.append(timed(lambda s=state: env.reset(options={"state": s})))
            env.use_prefix_store(kept)
            assert env.render().endswith(expected)
            fresh = gymnasium.make(ENV, split="train", task_types=[4],
                                   render_mode="ansi").unwrapped
            start = time.perf_counter()
            source = fresh.reset(options={"state": state})[1]["snapshot_source"]
            instance.append(time.perf_counter() - start)
            assert source == "store" and fresh.render().endswith(expected)
            fresh.close()
            child_store.append(fresh_process_restore(state.to_json(), "default", expected))
            child_replay.append(fresh_process_restore(state.to_json(), "off", expected))
        replay = statistics.median(child_replay)
        results["restore"][str(depth)] = {
            "fast_ms": median_ms(fast), "replay_same_env_ms": median_ms(warm),
            "fresh_instance_store_ms": median_ms(instance),
            "fresh_process_store_ms": median_ms(child_store),
            "fresh_process_full_replay_ms": median_ms(child_replay),
            "fresh_process_store_vs_full_replay": round(statistics.median(child_store) /
                                                        replay, 4),
            "samples_s": {"fresh_instance_store": [round(x, 4) for x in instance],
                          "fresh_process_store": [round(x, 4) for x in child_store],
                          "fresh_process_full_replay": [round(x, 3) for x in child_replay]},
            "speedup_vs_same_env_replay": round(statistics.median(warm) /
                                                statistics.median(fast), 1),
        }
    env.close()

    # episodes: translate every game of the set into the store first, as a host that has
    # seen them once would have; both paths then run on the same warm host
    warmup = gymnasium.make(ENV, split="train", task_types=EPISODE_TASK_TYPES).unwrapped
    for index in range(warmup.num_tasks):
        warmup.reset(options={"index": index})
    games = warmup.num_tasks
    warmup.close()
    one = oracle_episodes_one_process(EPISODES)
    vector = oracle_episodes_async_vector(EPISODES)
    results["episodes"] = {"games": games, "episodes": EPISODES,
                           "one_process_per_s": round(one, 3),
                           "async_vector_2_next_step_per_s": round(vector, 3),
                           "async_vector_vs_one_process": round(vector / one, 2)}

    engine = Engine()
    seconds = [timed(lambda t=t: generate_game(t, "train", 7, 1000, engine)) for t in TASK_TYPES]
    engine.close()
    results["generate"] = {"s_per_game_mean": round(statistics.fmean(seconds), 2),
                           "s_per_game_max": round(max(seconds), 2)}
    results["uptime_at_end"] = uptime()
    scratch.cleanup()
    result.write(args.out)
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
              f"fresh instance {x['fresh_instance_store_ms']:.0f} ms")
        print(f"  fresh process   {x['fresh_process_store_ms']:>9.1f} ms   full replay "
              f"{x['fresh_process_full_replay_ms']:.0f} ms   ratio "
              f"{x['fresh_process_store_vs_full_replay']}")
    e = r["episodes"]
    print(f"episodes/s        {e['async_vector_2_next_step_per_s']:>9.3f}     AsyncVectorEnv(2) "
          f"next-step autoreset vs one process {e['one_process_per_s']:.3f}   ratio "
          f"{e['async_vector_vs_one_process']}")
    print(f"generate          {r['generate']['s_per_game_mean']:>9.2f} s per verified game "
          f"(max {r['generate']['s_per_game_max']} s)")


if __name__ == "__main__":
    main()
