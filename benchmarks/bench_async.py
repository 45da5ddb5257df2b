"""Asynchronous GRPO (rollouts one update ahead) against the best synchronous loop.

    python benchmarks/bench_async.py                    # SFT first (cpu-demo), then GRPO
    python benchmarks/bench_async.py --sft RUN_DIR      # start GRPO from an existing SFT run

What runs: GRPO on Search-v0's train split with the embedded SmolLM2-135M, from an SFT
checkpoint (``agent-gym train sft --preset cpu-demo`` on the same split: GRPO from the base
model has no signal to learn from), ``--preset cpu-demo`` (2 tasks, 48 tokens, 4 turns) with
``--group-size`` 8 branches (with the preset's 4, most groups from this checkpoint were all
successes or all failures and most steps trained nothing: nothing for the learner to overlap),
``--steps`` updates, every configuration in its own process:

* synchronous (``--max-staleness 0``) with 1 and with 2 torch threads, on seed 0; the faster
  of the two is "the best synchronous configuration", and runs the other seeds;
* asynchronous (``--max-staleness 1``, 2 threads: one each for the sampler and the learner),
  on every seed.

Wall-clock per update: the run's steps (``time_step`` summed: rollouts waited for,
update, sampler copy) over their number, and the same without each run's first step (the
asynchronous loop cannot overlap anything before its first rollouts exist). Then each run's
final checkpoint plays Search-v0's 18 held-out questions greedily (``agent-gym eval``), as
does the SFT start; successes pooled over the seeds, with 95% Wilson intervals, and per seed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import RESULTS, Result  # noqa: E402

from agent_gym.eval.stats import wilson_interval  # noqa: E402
from agent_gym_train.run.files import read_metrics  # noqa: E402

ENV_ID = "agent_gym/Search-v0"
TRAIN = json.dumps({"split": "train"})
HELD_OUT = 18
MAX_TOKENS, MAX_TURNS = 48, 4  # --preset cpu-demo's, and eval's


def python(*args: str) -> list[str]:
    return [sys.executable, "-m", *args]


def run(command: list[str], threads: int) -> float:
    """Run ``command`` with ``threads`` torch threads; its wall-clock seconds."""
    env = os.environ | {"PYTHONPATH": str(ROOT), "AGENT_GYM_THREADS": str(threads),
                        "OMP_NUM_THREADS": str(threads)}
    started = time.perf_counter()
    subprocess.run(command, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def checkpoint_of(run_dir: Path) -> str:
    return json.loads((run_dir / "checkpoint.json").read_text())["path"]


def sft(work: Path) -> Path:
    out = work / "sft"
    if not (out / "checkpoint.json").is_file():
        run(python("agent_gym_train.sft", "--preset", "cpu-demo", "--env-id", ENV_ID,
                   "--env-kwargs", TRAIN, "--out", str(out), "--no-progress"), threads=2)
    return out


def grpo(work: Path, name: str, start: str, *, seed: int, threads: int, staleness: int,
         steps: int, learning_rate: float, group_size: int) -> dict[str, Any]:
    out = work / name
    command = python(
        "agent_gym_train.grpo", "--preset", "cpu-demo", "--env-id", ENV_ID, "--env-kwargs",
        TRAIN, "--init-from", start, "--steps", str(steps), "--seed", str(seed),
        "--threads", str(threads), "--max-staleness", str(staleness), "--learning-rate",
        str(learning_rate), "--group-size", str(group_size), "--save-every", str(steps),
        "--out", str(out), "--no-progress")
    wall = run(command, threads)
    rows = read_metrics(out / "metrics.jsonl")
    steps_seconds = [row["time_step"] for row in rows]
    return {
        "command": " ".join(command[2:]), "seed": seed, "threads": threads,
        "max_staleness": staleness, "wall_seconds": round(wall, 1),
        "seconds_per_update": round(sum(steps_seconds) / len(rows), 2),
        "seconds_per_update_after_first": round(sum(steps_seconds[1:]) / (len(rows) - 1), 2),
        "time_rollout_mean": round(sum(r["time_rollout"] for r in rows) / len(rows), 2),
        "time_train_mean": round(sum(r["time_train"] for r in rows) / len(rows), 2),
        "time_waiting_mean": round(sum(r["time_waiting"] for r in rows) / len(rows), 2),
        "staleness": [row["staleness"] for row in rows],
        "reward_mean": [round(row["reward_mean"], 3) for row in rows],
        "datums": [row["datums"] for row in rows],
        "checkpoint": checkpoint_of(out),
    }


def held_out(policy: str, out: Path) -> dict[str, Any]:
    """Greedy episodes on every held-out question, through ``agent-gym eval``."""
    command = python("agent_gym.cli", "eval", ENV_ID, "--policy", policy, "--episodes",
                     str(HELD_OUT), "--concurrency", "8", "--out", str(out), "--max-tokens",
                     str(MAX_TOKENS), "--split", "test", "--env-arg", f"max_turns={MAX_TURNS}",
                     "--quiet")
    if not (out / "summary.json").is_file():
        run(command, threads=2)
    summary = json.loads((out / "summary.json").read_text())
    return {"successes": round(summary["success_rate"] * summary["episodes"]),
            "episodes": summary["episodes"]}


def pooled(results: list[dict[str, Any]]) -> dict[str, Any]:
    successes = sum(r["successes"] for r in results)
    episodes = sum(r["episodes"] for r in results)
    low, high = wilson_interval(successes, episodes)
    return {"successes": successes, "episodes": episodes, "rate": round(successes / episodes, 3),
            "ci95": [round(low, 3), round(high, 3)],
            "per_seed": [r["successes"] for r in results]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="runs/bench-async",
                        help="where the runs go (recorded as $WORK)")
    parser.add_argument("--sft", default=None, help="an SFT run directory to start from")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--out", default=str(RESULTS / "async.json"))
    args = parser.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    result = Result(placeholders={str(work): "$WORK"})
    if args.sft:
        result.placeholders[str(Path(args.sft).resolve())] = "$SFT"
        result.placeholders[args.sft] = "$SFT"
    start = checkpoint_of(Path(args.sft) if args.sft else sft(work))
    common = {"start": start, "steps": args.steps, "learning_rate": args.learning_rate,
              "group_size": args.group_size}
    result.figures |= {"env_id": ENV_ID, "train": json.loads(TRAIN), "preset": "cpu-demo",
                       "init_from": start, "steps": args.steps, "group_size": args.group_size,
                       "learning_rate": args.learning_rate}

    runs: dict[str, dict[str, Any]] = {}
    for threads in (1, 2):
        runs[f"sync-t{threads}-s0"] = grpo(work, f"sync-t{threads}-s0", seed=0,
                                           threads=threads, staleness=0, **common)
        result.figures["runs"] = runs
        result.write(args.out)
    best = min((1, 2), key=lambda t: runs[f"sync-t{t}-s0"]["seconds_per_update"])
    sync_names = [f"sync-t{best}-s{seed}" for seed in range(args.seeds)]
    async_names = [f"async-s{seed}" for seed in range(args.seeds)]
    for seed in range(args.seeds):
        for name, threads, staleness in ((f"sync-t{best}-s{seed}", best, 0),
                                         (f"async-s{seed}", 2, 1)):
            if name not in runs:
                runs[name] = grpo(work, name, seed=seed, threads=threads,
                                  staleness=staleness, **common)
                result.figures["runs"] = runs
                result.write(args.out)

    def mean(names: list[str], key: str) -> float:
        return round(sum(runs[n][key] for n in names) / len(names), 2)

    speed = {key: {"best_sync": mean(sync_names, key), "async": mean(async_names, key),
                   "speedup": round(mean(sync_names, key) / mean(async_names, key), 2),
                   "per_seed_speedup": [round(runs[s][key] / runs[a][key], 2)
                                        for s, a in zip(sync_names, async_names, strict=True)]}
             for key in ("seconds_per_update", "seconds_per_update_after_first")}
    result.figures |= {"best_sync_threads": best, "wall_clock_per_update": speed}
    result.write(args.out)

    evals = work / "evals"
    start_success = held_out(f"local:smollm2@{start}", evals / "sft")
    success = {
        "sft_start": pooled([start_success]),
        "best_sync": pooled([held_out(f"local:smollm2@{runs[n]['checkpoint']}", evals / n)
                             for n in sync_names]),
        "async": pooled([held_out(f"local:smollm2@{runs[n]['checkpoint']}", evals / n)
                         for n in async_names]),
    }
    result.figures["held_out"] = {"episodes_per_policy": HELD_OUT, "decoding": "greedy",
                                  "max_tokens": MAX_TOKENS, "max_turns": MAX_TURNS, **success}
    print(json.dumps(result.figures["wall_clock_per_update"], indent=1))
    print(json.dumps(result.figures["held_out"], indent=1))
    result.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
