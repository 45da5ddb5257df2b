"""GRPO over a mixture of envs: the task sampler that prefers mixed outcomes, against uniform
draws, at equal CPU time.

    python benchmarks/bench_task_sampler.py [--sft RUN_DIR] [--work DIR] [--steps 10]
                                            [--seeds 0 1]

The run trains over ``agent_gym/Mixture-v0`` of two envs with equal weights: Search-v0's
``world-large`` train questions (1000) and GSM8K-v0's bundled problems (54), starting from
the Search SFT checkpoint of ``bench_search_rl.py``. The SFT model has mixed outcomes on
Search questions and next to none on GSM8K at a 48-token reply (it was never taught to
solve math; most of its groups there are all-zero): a mixture in which one member has no
learning signal for the current policy, as a curriculum has while a skill is out of reach.
Uniform draws spend half their groups on it whatever happens; ``--task-sampler mixed``
learns, from the groups it has seen, which member teaches (``agent_gym_train.run.tasks``).

Per seed, both runs: the same seed and settings (``--preset cpu-demo``, 4 tasks x 8 branches,
learning rate 1e-4, bfloat16 sampling copy where the CPU has bf16 units), one torch thread
each, side by side, a checkpoint every step. Each metrics line carries the process's CPU
seconds (``cpu_step``), so the comparison is at **equal CPU time**: the budget is the
smaller of the two runs' totals, and each run is judged on its steps within that budget and
on the checkpoint of its last step within it: non-degenerate group share, training reward
per CPU second, the share of groups drawn from Search, and greedy success on all 250
held-out ``world-large`` test questions (``agent-gym eval``), the two paired by question
(``agent-gym compare``). The final checkpoints (the same number of updates) are evaluated
too, to tell what the sampler changes per update from what it changes per CPU second.
Every stage resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_search_rl import checkpoint_step  # noqa: E402
from harness import RESULTS, Result, summary  # noqa: E402

from agent_gym.durable import replace_file  # noqa: E402
from agent_gym.env import describe_env  # noqa: E402
from agent_gym.eval.compare import compare  # noqa: E402
from agent_gym.eval.runs import read_run  # noqa: E402
from agent_gym_train.backends.runtime import native_bf16  # noqa: E402
from agent_gym_train.run.files import read_metrics  # noqa: E402

DATASET = "world-large"
HELD_OUT = 250
MAX_TOKENS, MAX_TURNS = 48, 4  # what --preset cpu-demo trains GRPO with
# The runs' subprocesses: the checkout's packages, one torch thread each (two run at once)
ENV = os.environ | {"PYTHONPATH": str(ROOT), "AGENT_GYM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def agent_gym(*args: str) -> list[str]:
    return [sys.executable, "-m", "agent_gym.cli", *args]


def held_out_eval(policy: str, out: Path, precision: str) -> list[str]:
    """``agent-gym eval`` of ``policy`` on Search-v0's 250 test questions, greedy."""
    return agent_gym("eval", "agent_gym/Search-v0", "--policy", policy, "--episodes",
                     str(HELD_OUT), "--env-arg", f"dataset={DATASET}", "--env-arg",
                     "split=test", "--env-arg", f"max_turns={MAX_TURNS}", "--max-tokens",
                     str(MAX_TOKENS), "--concurrency", "8", "--sampler-precision", precision,
                     "--quiet", "--out", str(out))


def eval_done(run: Path, episodes: int) -> bool:
    path = run / "summary.json"
    return path.is_file() and json.loads(path.read_text())["episodes"] >= episodes


class Stages:
    """Runs a stage's commands a few at a time and keeps each stage's wall-clock and CPU
    seconds (children's user + system) in ``timings.json``."""

    def __init__(self, work: Path) -> None:
        self.file = work / "timings.json"
        self.timings: dict[str, dict[str, float]] = (
            json.loads(self.file.read_text()) if self.file.is_file() else {})

    def run(self, name: str, commands: Sequence[tuple[str, list[str]]], at_once: int = 2
            ) -> None:
        """Run ``commands`` (label, argv) as stage ``name``, ``at_once`` side by side."""
        if not commands:
            return
        started, cpu = time.perf_counter(), _children_cpu()
        for pair in (commands[i:i + at_once] for i in range(0, len(commands), at_once)):
            running = [(label, subprocess.Popen(argv, env=ENV, cwd=ROOT,
                                                stdout=subprocess.DEVNULL))
                       for label, argv in pair]
            for label, process in running:
                if process.wait() != 0:
                    raise SystemExit(f"{name}: {label} failed (exit {process.returncode})")
        previous = self.timings.get(name, {"wall_seconds": 0.0, "cpu_seconds": 0.0})
        self.timings[name] = {
            "wall_seconds": round(previous["wall_seconds"] + time.perf_counter() - started, 1),
            "cpu_seconds": round(previous["cpu_seconds"] + _children_cpu() - cpu, 1)}
        replace_file(self.file, json.dumps(self.timings, indent=1))


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


MEMBERS = [
    {"env_id": "agent_gym/Search-v0", "env_kwargs": {"dataset": DATASET, "split": "train"},
     "weight": 1},
    {"env_id": "agent_gym/GSM8K-v0", "weight": 1},
]
SAMPLERS = ("uniform", "mixed")


def grpo_command(sft: Path, out: Path, sampler: str, seed: int, steps: int,
                 precision: str) -> list[str]:
    return [sys.executable, "-m", "agent_gym_train.grpo", "--env-id", "agent_gym/Mixture-v0",
            "--env-kwargs", json.dumps({"members": MEMBERS}), "--init-from", str(sft),
            "--preset", "cpu-demo", "--batch-size", "4", "--group-size", "8",
            "--learning-rate", "1e-4", "--task-sampler", sampler, "--steps", str(steps),
            "--seed", str(seed), "--sampler-precision", precision, "--save-every", "1",
            "--threads", "1", "--out", str(out), "--no-progress"]


def within(rows: list[dict[str, Any]], budget: float) -> list[dict[str, Any]]:
    """The leading steps whose CPU seconds, summed, stay within ``budget``."""
    kept, spent = [], 0.0
    for row in rows:
        spent += row["cpu_step"]
        if spent > budget + 1e-9:  # a step that ends past the budget is not counted
            break
        kept.append(row)
    return kept


def training_figures(rows: list[dict[str, Any]], search_tasks: int) -> dict[str, Any]:
    groups = sum(row["groups"] for row in rows)
    informative = groups - sum(row["degenerate_groups"] for row in rows)
    rewards = sum(row["reward_mean"] * row["episodes"] for row in rows)
    cpu = sum(row["cpu_step"] for row in rows)
    drawn = [int(i) for row in rows for i in row["task_outcomes"]]
    return {"steps": len(rows), "cpu_seconds": round(cpu, 1), "groups": groups,
            "non_degenerate_groups": informative,
            "non_degenerate_share": round(informative / groups, 3),
            "reward_per_cpu_second": round(rewards / cpu, 4),
            "search_share_of_groups": round(sum(i < search_tasks for i in drawn) / len(drawn), 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft", default="runs/bench-search-rl/sft",
                        help="the Search SFT run to start from (bench_search_rl.py makes it)")
    parser.add_argument("--work", default="runs/bench-task-sampler",
                        help="where the runs go (recorded as $WORK)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", default=str(RESULTS / "task_sampler.json"))
    args = parser.parse_args()
    work, sft = Path(args.work).resolve(), Path(args.sft).resolve()
    if not (sft / "checkpoint.json").is_file():
        raise SystemExit(f"{sft} holds no SFT checkpoint: run benchmarks/bench_search_rl.py "
                         "first, or name one with --sft")
    work.mkdir(parents=True, exist_ok=True)
    precision = "bfloat16" if native_bf16(torch.device("cpu")) else "float32"
    stages = Stages(work)
    per_seed = {str(seed): one_seed(stages, work / f"seed{seed}", sft, seed, args.steps,
                                    precision) for seed in args.seeds}
    result = Result(placeholders={str(work): "$WORK", str(sft): "$SFT"})
    result.figures |= {
        "mixture": MEMBERS, "init_from": "$SFT", "steps": args.steps,
        "sampler_precision": precision,
        "commands": {
            "grpo": " ".join(grpo_command(Path("$SFT"), Path("OUT"), "SAMPLER", 0, args.steps,
                                          precision)[2:]).replace("--seed 0", "--seed SEED"),
            "eval": " ".join(held_out_eval("POLICY", Path("OUT"), precision)[2:]),
            "compare": "agent-gym compare UNIFORM_EVAL MIXED_EVAL"},
        "seeds": per_seed,
        "mean_over_seeds": {
            key: round(sum(seed[key]["difference"] for seed in per_seed.values())
                       / len(per_seed), 3)
            for key in ("held_out_mixed_minus_uniform",
                        "held_out_mixed_minus_uniform_at_equal_steps")},
        "timings": stages.timings,
    }
    result.write(args.out)
    print(json.dumps(result.figures, indent=1))
    return 0


def one_seed(stages: Stages, work: Path, sft: Path, seed: int, steps: int, precision: str
             ) -> dict[str, Any]:
    """Both samplers' runs of one seed, side by side; each judged at the pair's CPU budget
    (the smaller total) and at its last step (equal updates)."""
    runs = {name: work / f"grpo-{name}" for name in SAMPLERS}
    stages.run(f"grpo seed {seed}", [
        (name, grpo_command(sft, runs[name], name, seed, steps, precision))
        for name in SAMPLERS if checkpoint_step(runs[name]) < steps])
    metrics = {name: read_metrics(runs[name] / "metrics.jsonl") for name in SAMPLERS}
    budget = min(sum(row["cpu_step"] for row in rows) for rows in metrics.values())
    search_tasks = describe_env("agent_gym/Mixture-v0", {"members": MEMBERS}).parts[0].num_tasks
    judged = {name: (len(within(metrics[name], budget)), len(metrics[name])) for name in SAMPLERS}
    evals = {(name, step): work / f"eval-{name}-step{step}"
             for name in SAMPLERS for step in judged[name]}
    stages.run(f"held_out_evals seed {seed}", [
        (f"{name} step {step}", held_out_eval(
            f"local:smollm2@{next((runs[name] / 'checkpoints').glob(f'*/step-{step:06d}'))}",
            out, precision))
        for (name, step), out in evals.items() if not eval_done(out, 250)])

    def mixed_minus_uniform(which: int) -> dict[str, Any]:
        paired = compare([read_run(evals["uniform", judged["uniform"][which]])],
                         [read_run(evals["mixed", judged["mixed"][which]])], "uniform",
                         "mixed").overall
        return {"difference": round(paired.difference, 3),
                "ci95": [round(paired.low, 3), round(paired.high, 3)],
                "only_uniform": paired.only_a, "only_mixed": paired.only_b,
                "both": paired.both, "neither": paired.neither}

    return {
        "cpu_budget_seconds": round(budget, 1),
        "runs": {name: {**training_figures(metrics[name][:judged[name][0]], search_tasks),
                        "checkpoint_step": judged[name][0], "steps_run": judged[name][1],
                        "held_out": summary(evals[name, judged[name][0]]),
                        "held_out_final_checkpoint": summary(evals[name, judged[name][1]])}
                 for name in SAMPLERS},
        # the judged comparison: each run's checkpoint at the CPU budget
        "held_out_mixed_minus_uniform": mixed_minus_uniform(0),
        # for reading it: the two runs after the same number of updates (every step run)
        "held_out_mixed_minus_uniform_at_equal_steps": mixed_minus_uniform(1),
    }


if __name__ == "__main__":
    sys.exit(main())
