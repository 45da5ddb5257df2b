"""Does GRPO from an SFT checkpoint beat that checkpoint on 250 held-out Search questions?

    python benchmarks/bench_search_rl.py [--work DIR] [--demos 200] [--steps 20] [--seeds 0 1 2]

Search-v0 on its ``world-large`` set: 1000 train and 250 test questions about two worlds
that share no entity (``agent_gym.search.world_large``), so a held-out gain is a gain in
procedure, not in facts. Every stage is a project command and resumes where it stopped
(rerun with the same ``--work`` to continue, or only to rewrite the result file):

1. ``agent-gym eval --policy oracle`` on the first ``--demos`` train questions: the
   demonstrations.
2. ``agent-gym train sft --preset cpu-demo`` on them (one epoch at 1e-3, LoRA r32).
3. ``agent-gym train grpo --init-from SFT`` per seed on the train split: ``--steps``
   updates of 4 tasks x 8 branches (48-token replies, 4 turns) at learning rate 1e-4 (at
   which an earlier GRPO run from SFT raised its training reward from 0 to 0.75 in 12
   steps, ``benchmarks/results/learning.json``), the task sampler that prefers tasks with
   mixed outcomes (``--task-sampler mixed``: more non-degenerate groups than uniform draws
   at equal CPU time, ``benchmarks/results/task_sampler.json``), rollouts from a bfloat16
   copy where the CPU has bf16 units (``--sampler-precision``).
4. ``agent-gym eval`` of the SFT checkpoint and of each GRPO run on all 250 test questions,
   greedy, 48-token replies and 4 turns as in training, and ``agent-gym compare`` of each
   GRPO run against SFT, paired by question.

One torch thread per process: the GRPO seeds train side by side (three processes share the
two cores rather than leave one idle while a third seed runs alone), then the evals two at
a time. Wall-clock and CPU seconds of each stage are those of the invocation that ran it,
kept in ``WORK/timings.json``.
"""

from __future__ import annotations

import argparse
import json
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

from bench_alfworld_sft import ENV, agent_gym, summary  # noqa: E402
from harness import RESULTS, Result  # noqa: E402

from agent_gym.durable import replace_file  # noqa: E402
from agent_gym.eval.compare import compare  # noqa: E402
from agent_gym.eval.runs import read_run  # noqa: E402
from agent_gym_train.backends.runtime import native_bf16  # noqa: E402

ENV_ID = "agent_gym/Search-v0"
DATASET = "world-large"
HELD_OUT = 250
MAX_TOKENS, MAX_TURNS = 48, 4  # what --preset cpu-demo trains GRPO with


def env_args(split: str) -> list[str]:
    return ["--env-arg", f"dataset={DATASET}", "--env-arg", f"split={split}"]


def held_out_eval(policy: str, out: Path, precision: str) -> list[str]:
    return agent_gym("eval", ENV_ID, "--policy", policy, "--episodes", str(HELD_OUT),
                     *env_args("test"), "--env-arg", f"max_turns={MAX_TURNS}",
                     "--max-tokens", str(MAX_TOKENS), "--concurrency", "8",
                     "--sampler-precision", precision, "--quiet", "--out", str(out))


def grpo_command(sft: Path, out: Path, seed: int, steps: int, precision: str) -> list[str]:
    return [sys.executable, "-m", "agent_gym_train.grpo", "--env-id", ENV_ID,
            "--env-kwargs", json.dumps({"dataset": DATASET, "split": "train"}),
            "--init-from", str(sft), "--preset", "cpu-demo", "--batch-size", "4",
            "--group-size", "8", "--learning-rate", "1e-4", "--task-sampler", "mixed",
            "--steps", str(steps),
            "--seed", str(seed), "--sampler-precision", precision, "--save-every", "1",
            "--threads", "1", "--out", str(out), "--no-progress"]


def checkpoint_step(run: Path) -> int:
    path = run / "checkpoint.json"
    return json.loads(path.read_text())["step"] if path.is_file() else 0


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="runs/bench-search-rl",
                        help="where the runs go (recorded as $WORK)")
    parser.add_argument("--demos", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default=str(RESULTS / "search_rl.json"))
    args = parser.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    precision = "bfloat16" if native_bf16(torch.device("cpu")) else "float32"
    result = Result(placeholders={str(work): "$WORK"})
    stages = Stages(work)
    oracle, sft, sft_eval = work / "oracle", work / "sft", work / "eval-sft"
    grpo = {seed: work / f"grpo-seed{seed}" for seed in args.seeds}
    grpo_eval = {seed: work / f"eval-grpo-seed{seed}" for seed in args.seeds}

    if not eval_done(oracle, args.demos):
        stages.run("demonstrations", [("oracle", agent_gym(
            "eval", ENV_ID, "--policy", "oracle", "--episodes", str(args.demos),
            *env_args("train"), "--quiet", "--out", str(oracle)))])
    sft_command = [sys.executable, "-m", "agent_gym_train.sft", "--env-id", ENV_ID,
                   "--env-kwargs", json.dumps({"dataset": DATASET, "split": "train"}),
                   "--demos", str(oracle), "--preset", "cpu-demo", "--threads", "2",
                   "--out", str(sft), "--no-progress"]
    stages.run("sft", [("sft", sft_command)])  # a finished run only loads and exits
    stages.run("grpo", [(f"grpo seed {seed}",
                         grpo_command(sft, grpo[seed], seed, args.steps, precision))
                        for seed in args.seeds if checkpoint_step(grpo[seed]) < args.steps],
               at_once=len(args.seeds))
    evals = [("sft", held_out_eval(f"local:smollm2@{sft}", sft_eval, precision), sft_eval),
             *((f"grpo seed {seed}", held_out_eval(f"local:smollm2@{grpo[seed]}",
                                                   grpo_eval[seed], precision), grpo_eval[seed])
               for seed in args.seeds)]
    stages.run("held_out_evals", [(label, [*argv[:-1], str(out)])
                                  for label, argv, out in evals
                                  if not eval_done(out, HELD_OUT)])

    sft_run = read_run(sft_eval)
    per_seed: dict[str, Any] = {}
    for seed in args.seeds:
        paired = compare([sft_run], [read_run(grpo_eval[seed])], "sft", "grpo").overall
        per_seed[str(seed)] = {
            "held_out": summary(grpo_eval[seed]), "grpo_minus_sft": round(paired.difference, 3),
            "ci95": [round(paired.low, 3), round(paired.high, 3)], "only_sft": paired.only_a,
            "only_grpo": paired.only_b, "both": paired.both, "neither": paired.neither,
            "training": training_summary(grpo[seed])}
    result.figures |= {
        "env_id": ENV_ID, "dataset": DATASET, "held_out_questions": HELD_OUT,
        "max_tokens": MAX_TOKENS, "max_turns": MAX_TURNS, "decoding": "greedy",
        "sampler_precision": precision,
        "demonstrations": args.demos, "grpo_steps": args.steps,
        "commands": {
            "demos": f"agent-gym eval {ENV_ID} --policy oracle --episodes {args.demos} "
                     + " ".join(env_args("train")),
            "sft": " ".join(sft_command[2:]),
            "grpo": " ".join(grpo_command(Path("$SFT"), Path("OUT"), 0, args.steps,
                                          precision)[2:]).replace("--seed 0", "--seed SEED"),
            "eval": " ".join(held_out_eval("POLICY", Path("OUT"), precision)[2:]),
            "compare": "agent-gym compare SFT_EVAL GRPO_EVAL"},
        "sft": summary(sft_eval), "grpo": per_seed,
        # Each seed against the one SFT run, paired by question (the seeds share that run,
        # so they are not pooled into one interval).
        "mean_grpo_minus_sft": round(sum(seed["grpo_minus_sft"] for seed in per_seed.values())
                                     / len(per_seed), 3),
        "seeds_with_interval_above_0": sum(seed["ci95"][0] > 0 for seed in per_seed.values()),
        "timings": stages.timings,
    }
    result.write(args.out)
    print(json.dumps(result.figures, indent=1))
    return 0


def training_summary(run: Path) -> dict[str, Any]:
    """Non-degenerate groups, training reward and the time the run took, from its metrics
    (``cpu_step`` counts the CPU seconds of every thread of the training process)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    half = max(1, len(rows) // 2)
    first, last = rows[:half], rows[-half:]

    def mean(key: str, part: list[dict[str, Any]]) -> float:
        return round(sum(row[key] for row in part) / len(part), 3)

    return {"steps": len(rows), "degenerate_rate_mean": mean("degenerate_rate", rows),
            "reward_first_half": mean("reward_mean", first),
            "reward_last_half": mean("reward_mean", last),
            "step_seconds_mean": mean("time_step", rows),
            # This seed alone: the stage's timings cover the seeds together.
            "wall_seconds": round(sum(row["time_step"] for row in rows), 1),
            "cpu_seconds": round(sum(row["cpu_step"] for row in rows), 1)}


if __name__ == "__main__":
    sys.exit(main())
