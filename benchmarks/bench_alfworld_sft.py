"""Does SFT on ALFWorld walkthroughs beat the base model on held-out games, and GRPO from it?

    python benchmarks/bench_alfworld_sft.py [--work DIR] [--demos 60] [--held-out 100]
                                            [--sft-until] [--grpo-steps N]

Every stage is a project command, and each resumes where it stopped (rerun with the same
``--work`` to continue or to only rewrite the result file):

1. ``agent-gym eval agent_gym/ALFWorld-v0 --policy oracle --split large_train``: the
   walkthroughs of the first ``--demos`` games of the large train set (960 games).
2. ``agent-gym train sft --demos THAT_RUN --preset cpu-demo``: one epoch at 1e-3 on them,
   SmolLM2-135M, LoRA r32, demonstrations up to 4096 tokens.
3. ``agent-gym eval`` of the base model and of the SFT checkpoint on the first
   ``--held-out`` games of ``large_test`` (240 games on ALFRED's held-out floor plans only,
   none shared with the train set): text protocol, greedy, 48-token replies, 15 turns,
   both sampled from a bfloat16 copy of the weights where the CPU has bf16 units.
4. ``agent-gym compare`` of the two: paired by game, the difference in success with
   Newcombe's paired 95% interval.
5. With ``--grpo-steps N``: ``agent-gym train grpo --init-from SFT`` on ``large_train``
   (text protocol, 15 turns, 48-token replies, episodes up to 4096 tokens as in SFT; 4
   tasks x 4 branches, learning rate 1e-4, ``--task-sampler mixed``), its eval on the same
   held-out games and its comparison with SFT, paired by game.

The evals run on one torch thread each (the base eval beside the SFT), SFT and GRPO on two.
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

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import RESULTS, Result  # noqa: E402

from agent_gym.eval.compare import compare  # noqa: E402
from agent_gym.eval.runs import read_run  # noqa: E402
from agent_gym_train.backends.runtime import native_bf16  # noqa: E402

ENV_ID = "agent_gym/ALFWorld-v0"
MAX_TOKENS, MAX_TURNS = 48, 15
ENV = os.environ | {"PYTHONPATH": str(ROOT), "AGENT_GYM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def agent_gym(*args: str) -> list[str]:
    return [sys.executable, "-m", "agent_gym.cli", *args]


def held_out_eval(policy: str, out: Path, games: int, precision: str) -> list[str]:
    return agent_gym("eval", ENV_ID, "--policy", policy, "--episodes", str(games), "--split",
                     "large_test", "--env-arg", "protocol=text", "--env-arg",
                     f"max_turns={MAX_TURNS}", "--max-tokens", str(MAX_TOKENS),
                     "--concurrency", "32", "--sampler-precision", precision, "--quiet",
                     "--out", str(out))


def grpo_command(sft: Path, out: Path, steps: int, precision: str) -> list[str]:
    return [sys.executable, "-m", "agent_gym_train.grpo", "--env-id", ENV_ID,
            "--env-kwargs", json.dumps({"protocol": "text", "split": "large_train"}),
            "--init-from", str(sft), "--batch-size", "4", "--group-size", "4",
            "--max-turns", str(MAX_TURNS), "--max-tokens", str(MAX_TOKENS),
            "--max-trajectory-tokens", "4096", "--learning-rate", "1e-4",
            "--task-sampler", "mixed", "--sampler-precision", precision, "--steps", str(steps),
            "--save-every", "1", "--threads", "2", "--out", str(out), "--no-progress"]


def summary(run: Path) -> dict[str, Any]:
    saved = json.loads((run / "summary.json").read_text())
    return {key: saved[key] for key in ("episodes", "success_rate", "success_low",
                                        "success_high", "mean_turns", "cut_replies")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="runs/bench-alfworld-sft",
                        help="where the runs go (recorded as $WORK)")
    parser.add_argument("--demos", type=int, default=60)
    parser.add_argument("--held-out", type=int, default=100)
    parser.add_argument("--sft-until", action="store_true",
                        help="evaluate the SFT run's latest checkpoint as it stands, without "
                        "training it to the end (a run stopped part way through its epoch)")
    parser.add_argument("--grpo-steps", type=int, default=0,
                        help="then GRPO from the SFT checkpoint for this many steps (0: none)")
    parser.add_argument("--out", default=str(RESULTS / "alfworld_sft.json"))
    args = parser.parse_args()
    work = Path(args.work).resolve()
    result = Result(placeholders={str(work): "$WORK"})
    started = time.perf_counter()
    oracle, sft, base_eval, sft_eval = (work / name for name in (
        "alf-oracle", "alf-sft", "alf-eval-base", "alf-eval-sft"))
    subprocess.run(agent_gym("eval", ENV_ID, "--policy", "oracle", "--episodes",
                             str(args.demos), "--split", "large_train", "--env-arg",
                             "protocol=text", "--quiet", "--out", str(oracle)),
                   check=True, env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL)
    precision = "bfloat16" if native_bf16(torch.device("cpu")) else "float32"
    base = subprocess.Popen(held_out_eval("local:smollm2", base_eval, args.held_out, precision),
                            env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL)
    sft_command = [sys.executable, "-m", "agent_gym_train.sft", "--env-id", ENV_ID,
                   "--env-kwargs", json.dumps({"protocol": "text", "split": "large_train"}),
                   "--demos", str(oracle), "--preset", "cpu-demo",
                   "--max-trajectory-tokens", "4096", "--threads", "2", "--out", str(sft),
                   "--no-progress"]
    if not args.sft_until:
        subprocess.run(sft_command, check=True, env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL)
    saved = json.loads((sft / "checkpoint.json").read_text())
    checkpoint = saved["path"]
    subprocess.run(held_out_eval(f"local:smollm2@{checkpoint}", sft_eval, args.held_out,
                                 precision), check=True, env=ENV, cwd=ROOT,
                   stdout=subprocess.DEVNULL)
    if base.wait() != 0:
        raise SystemExit("the base model's eval failed")
    paired = compare([read_run(base_eval)], [read_run(sft_eval)], "base", "sft").overall
    demos = json.loads((sft / "demonstrations.json").read_text())
    result.figures |= {
        "env_id": ENV_ID, "protocol": "text", "max_tokens": MAX_TOKENS, "max_turns": MAX_TURNS,
        "decoding": "greedy", "sampler_precision": precision, "demonstrations": demos,
        "sft_steps_trained": saved["step"],
        "commands": {"demos": f"agent-gym eval {ENV_ID} --policy oracle --episodes "
                              f"{args.demos} --split large_train --env-arg protocol=text",
                     "sft": " ".join(sft_command[2:]),
                     "eval": " ".join(held_out_eval("POLICY", Path("OUT"), args.held_out,
                                                    precision)[2:]),
                     "compare": "agent-gym compare BASE_EVAL SFT_EVAL"},
        "base": summary(base_eval), "sft": summary(sft_eval),
        "paired_difference": {"sft_minus_base": round(paired.difference, 3),
                              "ci95": [round(paired.low, 3), round(paired.high, 3)],
                              "both": paired.both, "only_base": paired.only_a,
                              "only_sft": paired.only_b, "neither": paired.neither},
        "seconds_this_invocation": round(time.perf_counter() - started, 1),
    }
    if args.grpo_steps:
        grpo, grpo_eval = work / "alf-grpo", work / "alf-eval-grpo"
        command = grpo_command(sft, grpo, args.grpo_steps, precision)
        subprocess.run(command, check=True, env=ENV | {"AGENT_GYM_THREADS": "2"}, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
        subprocess.run(held_out_eval(f"local:smollm2@{grpo}", grpo_eval, args.held_out,
                                     precision), check=True, env=ENV, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
        paired = compare([read_run(sft_eval)], [read_run(grpo_eval)], "sft", "grpo").overall
        rows = [json.loads(line) for line in (grpo / "metrics.jsonl").read_text().splitlines()]
        result.figures["grpo"] = {
            "command": " ".join(command[2:]), "steps": len(rows),
            "groups": sum(row["groups"] for row in rows),
            "degenerate_groups": sum(row["degenerate_groups"] for row in rows),
            "training_reward_by_step": [round(row["reward_mean"], 3) for row in rows],
            "cpu_seconds": round(sum(row["cpu_step"] for row in rows), 1),
            "wall_seconds": round(sum(row["time_step"] for row in rows), 1),
            "held_out": summary(grpo_eval),
            "grpo_minus_sft": {"difference": round(paired.difference, 3),
                               "ci95": [round(paired.low, 3), round(paired.high, 3)],
                               "only_sft": paired.only_a, "only_grpo": paired.only_b,
                               "both": paired.both, "neither": paired.neither}}
    result.write(args.out)
    print(json.dumps(result.figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
