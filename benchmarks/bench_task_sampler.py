"""GRPO's task sampler: drawing tasks whose groups had mixed outcomes, against uniform draws.

    python benchmarks/bench_task_sampler.py --sft RUN_DIR [--steps 12] [--seeds 1]

GRPO on Search-v0's bundled train split (56 questions) with SmolLM2-135M from an SFT run
(``--init-from``), ``--preset cpu-demo`` with batches of 4 tasks, the same seeds and steps
for ``--task-sampler uniform`` and ``mixed``, each run in its own process on 2 threads. For
each: the share of groups that were not degenerate (rewards not all equal: the groups that
train), the process's CPU seconds (user + system of the child), reward per CPU second,
datums trained per CPU second, and the final checkpoint's greedy success on the 18 held-out
questions (``agent-gym eval``). Over few steps on a set this small, a task is drawn a few
times at most, which bounds what remembering its outcomes can change.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_async import held_out  # noqa: E402
from harness import RESULTS, Result  # noqa: E402

from agent_gym_train.runfiles import read_metrics  # noqa: E402

ENV_ID = "agent_gym/Search-v0"
TRAIN = json.dumps({"split": "train"})


def child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def grpo(work: Path, name: str, start: str, sampler: str, seed: int, steps: int
         ) -> dict[str, Any]:
    out = work / name
    command = [sys.executable, "-m", "agent_gym_train.grpo", "--preset", "cpu-demo",
               "--env-id", ENV_ID, "--env-kwargs", TRAIN, "--init-from", start,
               "--batch-size", "4", "--steps", str(steps), "--seed", str(seed),
               "--threads", "2", "--learning-rate", "1e-4", "--task-sampler", sampler,
               "--save-every", str(steps), "--out", str(out), "--no-progress"]
    env = os.environ | {"PYTHONPATH": str(ROOT), "AGENT_GYM_THREADS": "2"}
    before = child_cpu()
    subprocess.run(command, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    cpu = child_cpu() - before
    rows = read_metrics(out / "metrics.jsonl")
    groups = sum(r["groups"] for r in rows)
    mixed = sum(r["groups"] - r["degenerate_groups"] for r in rows)
    rewards = sum(r["reward_mean"] * r["episodes"] for r in rows)
    drawn = [int(i) for r in rows for i in r["task_outcomes"]]
    return {
        "command": " ".join(command[2:]), "cpu_seconds": round(cpu, 1),
        "groups": groups, "non_degenerate_groups": mixed,
        "non_degenerate_share": round(mixed / groups, 3),
        "reward_mean": round(rewards / sum(r["episodes"] for r in rows), 3),
        "reward_per_cpu_second": round(rewards / cpu, 4),
        "datums_per_cpu_second": round(sum(r["datums"] for r in rows) / cpu, 4),
        "distinct_tasks": len(set(drawn)), "draws": len(drawn),
        "checkpoint": json.loads((out / "checkpoint.json").read_text())["path"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft", required=True, help="the SFT run directory to start from")
    parser.add_argument("--work", default="runs/bench-task-sampler",
                        help="where the runs go (recorded as $WORK)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "task_sampler.json"))
    args = parser.parse_args()
    work = Path(args.work).resolve()
    start = json.loads((Path(args.sft) / "checkpoint.json").read_text())["path"]
    result = Result(placeholders={str(work): "$WORK", str(Path(args.sft).resolve()): "$SFT",
                                  args.sft: "$SFT"})
    result.figures |= {"env_id": ENV_ID, "train": json.loads(TRAIN), "init_from": start,
                       "steps": args.steps, "batch_size": 4, "group_size": 4}
    runs: dict[str, Any] = {}
    for seed in range(args.seeds):
        for sampler in ("uniform", "mixed"):
            name = f"{sampler}-s{seed}"
            runs[name] = grpo(work, name, start, sampler, seed, args.steps)
            runs[name]["held_out"] = held_out(f"local:smollm2@{runs[name]['checkpoint']}",
                                              work / "evals" / name)
            result.figures["runs"] = runs
            result.write(args.out)
    print(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
