"""ALFWorld that moves: SFT on ``large_train`` walkthroughs against the base model, GRPO
from the SFT checkpoint against SFT, and TEMPO against GRPO at equal CPU, on ALFWorld's
held-out ``large_test`` games.

    python benchmarks/bench_alfworld_sft.py [--work DIR] [--demos 200] [--held-out 240]
                                            [--grpo-steps 8] [--group-size 8]
                                            [--arm grpo|tempo] [--seed 0]

Every stage resumes where it stopped (rerun with the same ``--work`` to continue, or to only
rewrite the record). The record keeps the GRPO and TEMPO runs it holds whose directories
``--work`` has lost (a fresh checkout, a seed run on another day) when the SFT stage there
has the recorded weights (by their SHA-256), and refuses, before training, to overwrite runs
of another SFT checkpoint; each eval's solved games are recorded so a later TEMPO seed pairs
with its GRPO seed without that run's directory:

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
   or, with ``--arm tempo``, ``agent-gym train tempo --init-from SFT`` until it has spent
   the CPU seconds (trainer and engine) of the finished GRPO run of its seed
   (``--cpu-budget``), on the Search bench's TEMPO recipe with 5-turn macro-steps
   (``ALFWORLD_TEMPO``);
5. that checkpoint on the same held-out games; each stage against the one before, and TEMPO
   against GRPO seed by seed, paired by game (Newcombe's paired 95% interval, as
   ``agent-gym compare`` gives it).

Every eval samples from one vLLM server (merged weights, reloaded per checkpoint) when ``make
setup`` has built its venv, else from the local sampler; GRPO and TEMPO sample from a vLLM
server of their own (or the local sampler), so their metrics carry the engine's CPU seconds
step by step and a run stopped part way keeps them. CPU seconds per arm: the trainer's own
(``cpu_step``) plus its engine's (``engine_cpu_step``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_search_rl import TEMPO_RECIPE, checkpoint_step  # noqa: E402
from harness import (  # noqa: E402
    RESULTS,
    Result,
    figures_in,
    metric_mean,
    paired,
    paired_solved,
    solved,
    summary,
)

from agent_gym_train import grpo, sft, tempo  # noqa: E402
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
# TEMPO's recipe on Search-v0 (fixed before any run there), with macro-steps of 5 turns
# instead of 2: a third of an ALFWorld episode, as 2 was half of a Search one, so a
# 15-turn episode leaves states at turns 5 and 10 for TD updates to resume from
ALFWORLD_TEMPO = TEMPO_RECIPE | {"horizon": 5}
ARMS = ("grpo", "tempo")
# A section of the results file (a run's figures, an eval's), as its JSON reads
Record = dict[str, Any]


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
    if rows and "phase" in rows[0]:  # TEMPO: its TD updates are the ones that train the actor
        td = [row for row in rows if row["phase"] == "td"]
        figures |= {"td_updates": len(td),
                    "actor_datums": sum(row.get("actor/datums") or 0 for row in td),
                    "actor_degenerate_group_rate_mean": metric_mean(
                        td, "actor/degenerate_group_rate", 3),
                    "critic_abs_error_mean": metric_mean(rows, "critic/abs_error_mean", 3),
                    "critic_abs_error_constant_mean": metric_mean(
                        rows, "critic/abs_error_constant", 3)}
    return figures


def held_out(evaluated: Path) -> Record:
    """An eval's figures and the games it solved, which pair a later run with it after
    ``evaluated`` is gone."""
    return summary(evaluated) | {"solved": solved(evaluated)}


@dataclass(frozen=True)
class Earlier:
    """What a results file records of runs its bench's ``--work`` no longer holds."""

    runs: dict[str, dict[str, Record]]  # by arm, then by run name
    tempo_minus_grpo: dict[str, Record]  # by TEMPO run name


def recorded_runs(record: Record, arm: str) -> dict[str, Record]:
    return record.get("tempo", {}).get("runs", {}) if arm == "tempo" else record.get(arm, {})


def earlier_runs(out: Path, work: Path) -> Earlier:
    """The GRPO and TEMPO runs ``out`` records that ``work`` does not hold (a new checkout
    starts without ``runs/``, and a seed's runs take longer than a sitting): the new record
    keeps them, and a TEMPO seed takes its budget from its GRPO run there. They count only
    beside the SFT checkpoint they trained from, so a record of runs from another one stops
    the bench before any training rather than be overwritten."""
    record = figures_in(out)
    kept = {arm: {name: run for name, run in recorded_runs(record, arm).items()
                  if not (work / name / "metrics.jsonl").is_file()} for arm in ARMS}
    if any(kept.values()) and record.get("sft_weights_sha256") != sft_weights(work):
        raise SystemExit(f"{out} holds runs trained from another SFT checkpoint than "
                         f"{work / 'sft'}'s (or one it names by no hash): pass another --out")
    pairs = record.get("tempo", {}).get("minus_grpo", {})
    return Earlier(kept, {name: pairs[name] for name in kept["tempo"] if name in pairs})


def sft_weights(work: Path) -> str:
    """The SHA-256 of the SFT run's final weights: what names the checkpoint every recorded
    run trained from (a rebuilt SFT stage need not reproduce it bit for bit)."""
    final = Path(json.loads((work / "sft" / "checkpoint.json").read_text())["path"])
    return hashlib.sha256((final / "weights.safetensors").read_bytes()).hexdigest()


def demonstrations_used(work: Path) -> Record:
    return json.loads((work / "sft" / "demonstrations.json").read_text())


def grpo_budget(grpo_run: Path, recorded: Record | None, steps: int) -> float:
    """The CPU seconds (trainer and engine) of the finished GRPO run TEMPO is held to: from
    its directory, or from the record when the directory is gone."""
    figures = training(grpo_run) if checkpoint_step(grpo_run) else (recorded or {}).get(
        "training", {})
    if figures.get("steps", 0) < steps:
        raise SystemExit(f"TEMPO spends the CPU seconds of {grpo_run.name}: run it first "
                         f"(--arm grpo --seed {grpo_run.name.removeprefix('grpo-seed')})")
    return figures["cpu_seconds"]


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
    parser.add_argument("--arm", choices=ARMS, default="grpo",
                        help="what trains from the SFT checkpoint: GRPO, or TEMPO until it has "
                        "spent the CPU seconds of the finished GRPO run of its --seed")
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
    oracle, sft_run = work / "oracle", work / "sft"
    grpo_run, run = work / f"grpo-seed{args.seed}", work / f"{args.arm}-seed{args.seed}"
    players = Players(work, options, TEST)
    try:
        print(f"the oracle on {args.demos} large_train games, then SFT", flush=True)
        demonstrations(oracle, options, args.demos, ENV_ID, TRAIN)
        sft.train(with_preset(sft.Args, "cpu-demo", env_id=ENV_ID, env_kwargs=TRAIN,
                              demos=str(oracle), max_trajectory_tokens=MAX_TRAJECTORY_TOKENS,
                              out=str(sft_run), seed=0, device="cpu", threads=threads,
                              progress=False))
        earlier = earlier_runs(Path(args.out), work)  # before the evals: it may refuse
        print(f"base and SFT on {args.held_out} large_test games", flush=True)
        players.held_out(None, work / "eval-base", args.held_out)
        players.held_out(sft_run, work / "eval-sft", args.held_out)
        # Each arm samples from a vLLM server of its own (or the local sampler)
        rollouts = players.rollouts() | {"vllm_url": None}
        if args.arm == "grpo" and args.grpo_steps:
            print(f"GRPO, {args.grpo_steps} updates", flush=True)
            grpo.train(with_preset(
                grpo.Args, "cpu-demo", env_id=ENV_ID, env_kwargs=TRAIN,
                init_from=str(sft_run), batch_size=GRPO_TASKS, group_size=args.group_size,
                max_turns=MAX_TURNS, max_tokens=MAX_TOKENS,
                max_trajectory_tokens=MAX_TRAJECTORY_TOKENS, learning_rate=1e-4,
                task_sampler="mixed", dynamic_sampling=True,
                max_refill_groups=args.max_refill_groups, steps=args.grpo_steps,
                save_every=1, seed=args.seed, out=str(run), device="cpu",
                threads=threads, progress=False, **rollouts))
        elif args.arm == "tempo":
            budget = grpo_budget(grpo_run, earlier.runs["grpo"].get(grpo_run.name),
                                 max(args.grpo_steps, 1))
            print(f"TEMPO until {budget:.0f} CPU seconds", flush=True)
            tempo.train(tempo.Args(
                env_id=ENV_ID, env_kwargs=TRAIN, init_from=str(sft_run),
                max_tokens=MAX_TOKENS, max_turns=MAX_TURNS,
                max_trajectory_tokens=MAX_TRAJECTORY_TOKENS, seed=args.seed,
                cpu_budget=budget, save_every=1, out=str(run), device="cpu",
                threads=threads, progress=False, **rollouts, **ALFWORLD_TEMPO))
        if checkpoint_step(run):
            players.held_out(run, work / f"eval-{run.name}", args.held_out)
    finally:
        players.close()
    record.figures = figures(work, args, sampler, earlier)
    record.write(args.out)
    print(json.dumps(record.figures, indent=1))
    return 0


def figures(work: Path, args: argparse.Namespace, sampler: str, earlier: Earlier
            ) -> dict[str, Any]:
    """The record of what ``work`` holds and ``earlier`` recorded: SFT, every GRPO and TEMPO
    seed run (its held-out eval and the comparison with SFT once it has one), TEMPO against
    GRPO seed by seed."""
    arms: dict[str, dict[str, Record]] = {arm: {} for arm in ARMS}
    for arm in ARMS:
        for found in sorted(work.glob(f"{arm}-seed*/metrics.jsonl")):
            run = found.parent
            arms[arm][run.name] = {"training": training(run)}
            evaluated = work / f"eval-{run.name}"
            if (evaluated / "summary.json").is_file():
                arms[arm][run.name] |= {"held_out": held_out(evaluated),
                                        "minus_sft": paired(work / "eval-sft", evaluated)}
        arms[arm] = dict(sorted((earlier.runs[arm] | arms[arm]).items()))
    tempo_minus_grpo = dict(earlier.tempo_minus_grpo)
    for name, run in arms["tempo"].items():
        grpo_name = name.replace("tempo", "grpo", 1)
        grpo_held_out = arms["grpo"].get(grpo_name, {}).get("held_out", {})
        if name in earlier.runs["tempo"] or "held_out" not in run or not grpo_held_out:
            continue
        if (work / f"eval-{grpo_name}").is_dir():
            tempo_minus_grpo[name] = paired(work / f"eval-{grpo_name}", work / f"eval-{name}")
        elif "solved" in grpo_held_out:
            tempo_minus_grpo[name] = paired_solved(grpo_held_out["solved"],
                                                   run["held_out"]["solved"], args.held_out)
    return {
        "env_id": ENV_ID, "train": TRAIN, "held_out": TEST.env_kwargs,
        "held_out_games": args.held_out, "max_tokens": MAX_TOKENS, "max_turns": MAX_TURNS,
        "decoding": "greedy", "sampler": sampler, "threads": available_cores(),
        "demonstrations": demonstrations_used(work),
        "grpo_recipe": {"tasks": GRPO_TASKS, "group_size": args.group_size,
                        "learning_rate": 1e-4, "temperature": 1.0, "task_sampler": "mixed",
                        "dynamic_sampling": True,
                        "max_refill_groups": args.max_refill_groups},
        "base": held_out(work / "eval-base"),
        "sft": held_out(work / "eval-sft"),
        "sft_training": training(work / "sft"),
        "sft_weights_sha256": sft_weights(work),
        "sft_minus_base": paired(work / "eval-base", work / "eval-sft"),
        "grpo": arms["grpo"],
        # TEMPO against GRPO at the GRPO run's CPU seconds (trainer and engine), per seed
        "tempo": {"recipe": ALFWORLD_TEMPO, "runs": arms["tempo"],
                  "minus_grpo": dict(sorted(tempo_minus_grpo.items()))},
    }


if __name__ == "__main__":
    sys.exit(main())
