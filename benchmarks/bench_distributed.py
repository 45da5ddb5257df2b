"""Oracle episodes per second: one process vs Gymnasium's AsyncVectorEnv vs Ray actors.

All variants play N episodes with the oracle policy in the same run, with 2 workers where
there are workers; figures are ratios to the single-process loop. Two shapes are measured:
lockstep vector envs (every ``step`` waits for the slowest sub-env, so one env's slow
reset stalls the other) and ``agent-gym eval``'s free-running episode workers, in this
process (env calls in threads) or in Ray actors (``--ray``).

    .venv/bin/python benchmarks/bench_distributed.py [--env agent_gym/ALFWorld-v0] [--episodes 12]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import gymnasium
import ray
from harness import RESULTS, Result

import agent_gym  # noqa: F401
from agent_gym.eval.config import EvalConfig
from agent_gym.eval.policies import OraclePolicy
from agent_gym.eval.run import evaluate
from agent_gym.serve.distributed import RayVectorEnv, remote_env_factory


def single_process(env_id: str, episodes: int) -> float:
    env = gymnasium.make(env_id)
    started = time.perf_counter()
    for seed in range(episodes):
        _, info = env.reset(seed=seed)
        script, done, turn = info["privileged"]["oracle_actions"], False, 0
        while not done:
            _, _, terminated, truncated, _ = env.step(script[min(turn, len(script) - 1)])
            done, turn = terminated or truncated, turn + 1
    env.close()
    return episodes / (time.perf_counter() - started)


def vectorised(vec: Any, episodes: int) -> float:
    """Drive a 2-env vector env until ``episodes`` episodes finished (next-step autoreset)."""
    started = time.perf_counter()
    _, infos = vec.reset(seed=[0, 1])
    scripts = list(infos["privileged"]["oracle_actions"])
    turns, finished, pending_reset = [0, 0], 0, [False, False]
    while finished < episodes:
        actions = [s[min(t, len(s) - 1)] for s, t in zip(scripts, turns, strict=True)]
        _, _, terminated, truncated, infos = vec.step(actions)
        for i in range(2):
            if pending_reset[i]:  # this step was the autoreset: a new script starts
                scripts[i] = infos["privileged"]["oracle_actions"][i]
                turns[i], pending_reset[i] = 0, False
            elif terminated[i] or truncated[i]:
                finished += 1
                pending_reset[i] = True
            else:
                turns[i] += 1
    elapsed = time.perf_counter() - started
    vec.close()
    return finished / elapsed


def eval_workers(env_id: str, episodes: int, make_env: Any = None) -> float:
    """``agent-gym eval`` with 2 free-running workers (no lockstep)."""
    config = EvalConfig(env_id, "oracle", episodes)
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        asyncio.run(evaluate(config, OraclePolicy(), Path(out), concurrency=2, progress=False,
                             make_env=make_env))
        return episodes / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_env = "agent_gym/ALFWorld-v0"
    parser.add_argument("--env", default=default_env if default_env in gymnasium.registry
                        else "agent_gym/GSM8K-v0")
    parser.add_argument("--episodes", type=int, default=12)
    args = parser.parse_args()
    result = Result()
    base = single_process(args.env, args.episodes)
    asynchronous = vectorised(
        gymnasium.make_vec(args.env, num_envs=2, vectorization_mode="async"), args.episodes
    )
    threads = eval_workers(args.env, args.episodes)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    distributed = vectorised(RayVectorEnv(args.env, num_envs=2), args.episodes)
    ray_eval = eval_workers(args.env, args.episodes, remote_env_factory(args.env, {}, "local"))
    ray.shutdown()
    report = {
        "env": args.env,
        "episodes": args.episodes,
        "episodes_per_s": {
            "single_process": round(base, 3),
            "async_vector_2": round(asynchronous, 3),
            "ray_vector_2_actors": round(distributed, 3),
            "eval_2_workers_threads": round(threads, 3),
            "eval_2_workers_ray": round(ray_eval, 3),
        },
        "ratio_vs_single_process": {
            "async_vector_2": round(asynchronous / base, 2),
            "ray_vector_2_actors": round(distributed / base, 2),
            "eval_2_workers_threads": round(threads / base, 2),
            "eval_2_workers_ray": round(ray_eval / base, 2),
        },
    }
    name = args.env.removeprefix("agent_gym/").lower()
    result.figures.update(report)
    result.write(RESULTS / f"distributed-{name}.json")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
