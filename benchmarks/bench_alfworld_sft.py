"""ALFWorld that moves: SFT on ``large_train`` walkthroughs against the base model, and GRPO
from the SFT checkpoint against SFT, on ALFWorld's held-out ``large_test`` games.

    python benchmarks/bench_alfworld_sft.py [--work DIR] [--demos 200] [--held-out 240]
                                            [--grpo-steps 8] [--group-size 8] [--seed 0]

Every stage resumes where it stopped (rerun with the same ``--work`` to continue, or to only
rewrite the record):

1. the oracle on the first ``--demos`` games of ``large_train`` (960 games): the
   walkthroughs;
2. ``agent-gym train sft --preset cpu-demo`` on them (one epoch at 1e-3, 4 a step,
   SmolLM2-135M, LoRA r32), walkthroughs up to 4096 tokens;
3. the base model and the SFT checkpoint on the first ``--held-out`` games of
   ``large_test`` (240 games, on ALFRED's held-out floor plans only), greedy, text protocol,
   48-token replies, 15 turns;
4. ``agent-gym train grpo --init-from SFT`` on ``large_train``: ``--grpo-steps`` updates of
   4 tasks x ``--group-size`` branches at lr 1e-4 and temperature 1, replies and turns as in
   the eval. At SFT's success rate most groups of 4 were all failures (13 of 16 in the first
   run of this bench), so groups are larger, tasks that have split a group before are
   preferred (``--task-sampler mixed``) and a step rolls out more tasks until it has 4
   groups with a learning signal (``--dynamic-sampling``, at most ``--max-refill-groups``
   more);
5. the GRPO checkpoint on the same held-out games; each stage against the one before,
   paired by game (Newcombe's paired 95% interval, as ``agent-gym compare`` gives it).

Every eval samples from one vLLM server (merged weights, reloaded per checkpoint) when ``make
setup`` has built its venv, else from the local sampler; GRPO samples from a vLLM server of
its own (or the local sampler), so its metrics carry the engine's CPU seconds step by step
and a run stopped part way keeps them. CPU seconds per arm: the trainer's own
(``cpu_step``) plus its engine's (``engine_cpu_step``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import RESULTS, Result  # noqa: E402

from agent_gym.eval.compare import compare  # noqa: E402
from agent_gym.eval.runs import read_run  # noqa: E402
from agent_gym_train import grpo, sft  # noqa: E402
from agent_gym_train.backends.runtime import available_cores  # noqa: E402
from agent_gym_train.backends.vllm import vllm_python  # noqa: E402
from agent_gym_train.demo import HeldOut, Players, demonstrations  # noqa: E402
from agent_gym_train.run.args import with_preset  # noqa: E402
from agent_gym_train.run.files import read_metrics  # noqa: E402

ENV_ID = "agent_gym/ALFWorld-v0"
MAX_TOKENS, MAX_TURNS = 48, 15
# Every walkthrough fits (SFT would drop one that did not); a GRPO episode that outgrows
# it ends there, unfinished (its metrics' end_reasons count it as trajectory_budget)
MAX_TRAJECTORY_TOKENS = 4096
TRAIN = {"protocol": "text", "split": "large_train"}
TEST = HeldOut(ENV_ID, {"protocol": "text", "split": "large_test", "max_turns": MAX_TURNS},
               MAX_TOKENS)
GRPO_TASKS = 4


def summary(run: Path) -> dict[str, Any]:
    saved = json.loads((run / "summary.json").read_text())
    return {key: saved[key] for key in ("episodes", "success_rate", "success_low",
                                        "success_high", "mean_turns", "cut_replies")}


def paired(before: Path, after: Path) -> dict[str, Any]:
    """``after`` minus ``before``, paired by task: Newcombe's 95% interval and the counts."""
    result = compare([read_run(before)], [read_run(after)], "before", "after").overall
    return {"difference": round(result.difference, 3),
            "ci95": [round(result.low, 3), round(result.high, 3)],
            "both": result.both, "only_before": result.only_a, "only_after": result.only_b,
            "neither": result.neither}


def training(run: Path) -> dict[str, Any]:
    """What a training run cost and saw, from its metrics lines."""
    rows = read_metrics(run / "metrics.jsonl")
    trainer = sum(row["cpu_step"] for row in rows)
    engine = sum(row.get("engine_cpu_step") or 0.0 for row in rows)
    figures: dict[str, Any] = {
        "steps": len(rows), "trainer_cpu_seconds": round(trainer, 1),
        "engine_cpu_seconds": round(engine, 1), "cpu_seconds": round(trainer + engine, 1),
        "wall_seconds": round(sum(row["time_step"] for row in rows), 1)}
    if rows and "groups" in rows[0]:
        figures |= {"groups": sum(row["groups"] for row in rows),
                    "refill_groups": sum(row["refill_groups"] for row in rows),
                    "degenerate_groups": sum(row["degenerate_groups"] for row in rows),
                    "training_reward_by_step": [round(row["reward_mean"], 3) for row in rows]}
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="runs/bench-alfworld",
                        help="where the runs go (recorded as $WORK)")
    parser.add_argument("--demos", type=int, default=200)
    parser.add_argument("--held-out", type=int, default=240)
    parser.add_argument("--grpo-steps", type=int, default=8,
                        help="GRPO updates from the SFT checkpoint (0: stop after SFT)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-refill-groups", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "alfworld_sft.json"))
    args = parser.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    threads = available_cores()
    sampler = "vllm" if vllm_python().is_file() else "local"
    options = argparse.Namespace(sampler=sampler, device="cpu", threads=threads,
                                 progress=False)
    record = Result(placeholders={str(work): "$WORK"})
    oracle, sft_run, grpo_run = work / "oracle", work / "sft", work / f"grpo-seed{args.seed}"
    evals = {name: work / f"eval-{name}" for name in ("base", "sft", f"grpo-seed{args.seed}")}
    players = Players(work, options, TEST)
    try:
        print(f"the oracle on {args.demos} large_train games, then SFT", flush=True)
        demonstrations(oracle, options, args.demos, ENV_ID, TRAIN)
        sft.train(with_preset(sft.Args, "cpu-demo", env_id=ENV_ID, env_kwargs=TRAIN,
                              demos=str(oracle), max_trajectory_tokens=MAX_TRAJECTORY_TOKENS,
                              out=str(sft_run), seed=0, device="cpu", threads=threads,
                              progress=False))
        print(f"base and SFT on {args.held_out} large_test games", flush=True)
        players.held_out(None, evals["base"], args.held_out)
        players.held_out(sft_run, evals["sft"], args.held_out)
        if args.grpo_steps:
            print(f"GRPO, {args.grpo_steps} updates", flush=True)
            grpo.train(with_preset(
                grpo.Args, "cpu-demo", env_id=ENV_ID, env_kwargs=TRAIN,
                init_from=str(sft_run), batch_size=GRPO_TASKS, group_size=args.group_size,
                max_turns=MAX_TURNS, max_tokens=MAX_TOKENS,
                max_trajectory_tokens=MAX_TRAJECTORY_TOKENS, learning_rate=1e-4,
                task_sampler="mixed", dynamic_sampling=True,
                max_refill_groups=args.max_refill_groups, steps=args.grpo_steps,
                save_every=1, seed=args.seed, out=str(grpo_run), device="cpu",
                threads=threads, progress=False,
                **(players.rollouts() | {"vllm_url": None})))  # its own server
            players.held_out(grpo_run, evals[f"grpo-seed{args.seed}"], args.held_out)
    finally:
        players.close()
    record.figures = figures(work, args, sampler)
    record.write(args.out)
    print(json.dumps(record.figures, indent=1))
    return 0


def figures(work: Path, args: argparse.Namespace, sampler: str) -> dict[str, Any]:
    """The record of what ``work`` holds: SFT, every GRPO seed run there (its held-out eval
    and the comparison with SFT once it has one), their comparisons."""
    grpo_runs: dict[str, dict[str, Any]] = {}
    for found in sorted(work.glob("grpo-seed*/metrics.jsonl")):
        run = found.parent
        grpo_runs[run.name] = {"training": training(run)}
        evaluated = work / f"eval-{run.name}"
        if (evaluated / "summary.json").is_file():
            grpo_runs[run.name] |= {"held_out": summary(evaluated),
                                    "minus_sft": paired(work / "eval-sft", evaluated)}
    return {
        "env_id": ENV_ID, "train": TRAIN, "held_out": TEST.env_kwargs,
        "held_out_games": args.held_out, "max_tokens": MAX_TOKENS, "max_turns": MAX_TURNS,
        "decoding": "greedy", "sampler": sampler, "threads": available_cores(),
        "demonstrations": json.loads((work / "sft" / "demonstrations.json").read_text()),
        "grpo_recipe": {"tasks": GRPO_TASKS, "group_size": args.group_size,
                        "learning_rate": 1e-4, "temperature": 1.0, "task_sampler": "mixed",
                        "dynamic_sampling": True,
                        "max_refill_groups": args.max_refill_groups},
        "base": summary(work / "eval-base"),
        "sft": summary(work / "eval-sft"),
        "sft_training": training(work / "sft"),
        "sft_minus_base": paired(work / "eval-base", work / "eval-sft"),
        "grpo": grpo_runs,
    }


if __name__ == "__main__":
    sys.exit(main())
