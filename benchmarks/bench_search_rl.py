"""GRPO from one SFT checkpoint on 250 held-out Search questions: rollouts on vLLM against
the local sampler and at staleness 1, RL against SFT on as many demonstrations, and TEMPO
against GRPO at equal CPU.

    python benchmarks/bench_search_rl.py [--work DIR] [--steps 12] [--seeds 0 1 2]
                               [--arms vllm local vllm-stale1 sft-equal sft-all tempo]

Search-v0 on its ``world-large`` set (1000 train and 250 test questions about two worlds
that share no entity), the recipe of ``make run`` (``agent_gym_train.demo``) at issue #38's
length:

1. the oracle on the first 200 train questions: the demonstrations;
2. ``agent-gym train sft --preset cpu-demo`` on them: the SFT checkpoint the GRPO arms
   start from;
3. per seed, per arm (``ARMS``): ``agent-gym train grpo --init-from SFT``, ``--steps``
   updates of 4 tasks x 8 branches (``demo.grpo_recipe``), rollouts from ``--sampler
   vllm`` (merged weights on the bench's one server), from ``--sampler local`` at its
   default precision (float32: the learner's own weights, so exactly on-policy), or from
   vLLM with ``--max-staleness 1``; or SFT from the base model on the oracle's first
   200 + steps x 32 train questions (as many demonstrations as SFT + GRPO played
   episodes), or on all 1000; or TEMPO from the SFT checkpoint (``TEMPO_RECIPE``) until
   it has spent the CPU seconds the local GRPO run of its seed spent (``--cpu-budget``);
4. every checkpoint on all 250 test questions, greedy, on that one vLLM server (the same
   evaluator for every arm); each run against SFT, and arms against each other seed by
   seed, paired by question.

Seed-major and one run at a time, each with every core, so the arms' seconds per update
are measured under the same conditions; every stage resumes where it stopped, and the
result file, rewritten after each, holds every run finished in ``--work`` (earlier
sittings' too). CPU seconds: the trainer's own (``cpu_step``) and, for vLLM, the engine's
processes over the run (from /proc).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import RESULTS, Result, metric_mean, paired, summary  # noqa: E402

from agent_gym.durable import replace_file  # noqa: E402
from agent_gym.eval.runs import read_run  # noqa: E402
from agent_gym.search import world_large  # noqa: E402
from agent_gym_train import grpo, sft, tempo  # noqa: E402
from agent_gym_train.backends.runtime import available_cores  # noqa: E402
from agent_gym_train.demo import (  # noqa: E402
    DEMOS,
    ENV_ID,
    GRPO_BRANCHES,
    GRPO_TASKS,
    MAX_TOKENS,
    MAX_TURNS,
    TEST,
    TRAIN,
    Players,
    demonstrations,
    grpo_recipe,
)
from agent_gym_train.run.args import with_preset  # noqa: E402
from agent_gym_train.run.files import read_metrics  # noqa: E402

QUESTIONS = 250  # every test question


def checkpoint_step(run: Path) -> int:
    path = run / "checkpoint.json"
    return json.loads(path.read_text())["step"] if path.is_file() else 0


def by_hops(run: Path, hops: dict[str, int]) -> dict[str, str]:
    """Successes per number of hops the question needs (searches before the answer)."""
    counts: dict[int, list[int]] = {}
    for episode in read_run(run).episodes.values():
        tally = counts.setdefault(hops[episode["task_id"]], [0, 0])
        tally[0] += bool(episode["success"])
        tally[1] += 1
    return {str(h): f"{won}/{played}" for h, (won, played) in sorted(counts.items())}


def training(run: Path, engine_cpu: float | None) -> dict[str, Any]:
    """Seconds per update, CPU and the sampler's logprob mismatch, from the run's metrics."""
    rows = read_metrics(run / "metrics.jsonl")
    # TEMPO's lines (they have a phase) name the actor's figures apart from the critic's
    actor = "actor/" if rows and "phase" in rows[0] else ""

    def mean(key: str) -> float | None:
        return metric_mean(rows, key)

    return {"updates": len(rows),
            "td_updates": sum(row["phase"] == "td" for row in rows) if actor else None,
            "step_seconds_mean": mean("time_step"),
            "rollout_seconds_mean": mean("time_rollout"), "train_seconds_mean": mean("time_train"),
            "trainer_cpu_seconds": round(sum(row["cpu_step"] for row in rows), 1),
            "engine_cpu_seconds": engine_cpu,
            "reward_mean": mean("reward_mean"),
            "degenerate_rate_mean": mean(f"{actor}degenerate_group_rate" if actor
                                         else "degenerate_rate"),
            "datums": sum(row.get(f"{actor}datums") or 0 for row in rows),
            "logprob_gap_abs_mean": mean("logprob_gap_abs_mean"),
            "truncated_fraction_mean": mean("truncated_fraction"),
            "engine_prefix_hit_rate_mean": mean("engine_prefix_hit_rate"),
            "critic_abs_error_mean": mean("critic/abs_error_mean"),
            "critic_abs_error_constant_mean": mean("critic/abs_error_constant")}


@dataclass(frozen=True)
class Arm:
    """How one arm's policy is trained: GRPO from the SFT checkpoint (on ``sampler``, at most
    ``max_staleness`` updates behind), SFT from the base model on more demonstrations
    (``demos``; 0: as many as SFT's 200 plus the episodes a GRPO run plays), or TEMPO from
    the SFT checkpoint at the CPU of the local GRPO run of its seed."""

    kind: str  # "grpo" | "sft" | "tempo"
    sampler: str | None = None
    precision: str = "float32"  # the local sampler's: the learner's own weights
    max_staleness: int = 0
    demos: int = 0

    def run(self, name: str, seed: int) -> str:
        """The run's directory name (its eval's is ``eval-`` and this)."""
        return f"{self.kind}-{name}-seed{seed}" if self.kind == "grpo" else f"{name}-seed{seed}"


# TEMPO's one recipe, fixed before its runs: docs/experiments/tempo.md's (the critic that
# beat the best constant in three seeds: cross-entropy on the target reply, the median
# readout, 8 replayed warm-up targets; 4 groups of 4 branches, macro-steps of 2 turns, half
# of each TD update's groups fresh, lr 2e-4), with 8 warm-up updates instead of its 24, so
# that the actor, which warm-up does not train, has most of a GRPO run's CPU; then TD
# updates until the budget is spent. Rollouts on the local float32 sampler, as the local GRPO
# arm's; replies and turns as every arm's.
TEMPO_RECIPE = {"warmup_updates": 8, "td_updates": 1000, "batch_size": 4, "branches": 4,
                "horizon": 2, "fresh_fraction": 0.5, "learning_rate": 2e-4,
                "critic_replay": 8}


ARMS: dict[str, Arm] = {
    "vllm": Arm("grpo", "vllm"),
    "local": Arm("grpo", "local"),
    "vllm-stale1": Arm("grpo", "vllm", max_staleness=1),  # samples t+1 while t trains
    "sft-equal": Arm("sft"),  # RL against SFT at equal data
    "sft-all": Arm("sft", demos=1000),  # every train question
    "tempo": Arm("tempo", "local"),  # TEMPO against GRPO at equal CPU
}
EPISODES_PER_UPDATE = GRPO_TASKS * GRPO_BRANCHES


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="runs/bench-search-rl",
                        help="where the runs go (recorded as $WORK)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", choices=tuple(ARMS), default=["vllm", "local"])
    parser.add_argument("--out", default=str(RESULTS / "search_rl.json"))
    args = parser.parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    threads = available_cores()
    # The one server: every eval and the vLLM runs' rollouts (the local runs leave it idle).
    options = argparse.Namespace(sampler="vllm", device="cpu", threads=threads, progress=False)
    players = Players(work, options)
    engine = players.engine
    if engine is None:
        raise SystemExit("no vLLM server: `make setup` builds its venv")
    record = Result(placeholders={str(work): "$WORK"})
    cpu_file = work / "engine_cpu.json"  # the engine's CPU seconds per vLLM run, all sittings
    engine_cpu: dict[str, float] = json.loads(cpu_file.read_text()) if cpu_file.is_file() else {}

    def supervised(demos: int, out: Path, seed: int) -> None:
        """SFT (``--preset cpu-demo``) on the oracle's first ``demos`` train questions."""
        played = work / ("oracle" if demos == DEMOS else f"oracle-{demos}")
        demonstrations(played, options, demos)
        sft.train(with_preset(sft.Args, "cpu-demo", env_id=ENV_ID, env_kwargs=TRAIN,
                              demos=str(played), out=str(out), seed=seed,
                              device="cpu", threads=threads, progress=False))

    try:
        print("demonstrations and SFT", flush=True)
        supervised(DEMOS, work / "sft", 0)
        players.held_out(work / "sft", work / "eval-sft", QUESTIONS)
        for seed in args.seeds:
            for name, arm in ((ARMS[a].run(a, seed), ARMS[a]) for a in args.arms):
                run = work / name
                print(f"{name}: training", flush=True)
                if arm.kind == "sft":
                    supervised(arm.demos or DEMOS + args.steps * EPISODES_PER_UPDATE, run,
                               seed)
                elif arm.kind == "tempo":
                    grpo_run = work / ARMS["local"].run("local", seed)
                    if checkpoint_step(grpo_run) < args.steps:
                        raise SystemExit(f"{name} spends the CPU of {grpo_run.name}: run "
                                         f"--arms local --seeds {seed} first")
                    budget = training(grpo_run, None)["trainer_cpu_seconds"]
                    tempo.train(tempo.Args(
                        env_id=ENV_ID, env_kwargs=TRAIN, init_from=str(work / "sft"),
                        max_tokens=MAX_TOKENS, max_turns=MAX_TURNS, seed=seed,
                        cpu_budget=budget, save_every=1, out=str(run), device="cpu",
                        threads=threads, progress=False, **TEMPO_RECIPE))
                elif checkpoint_step(run) < args.steps:
                    options.sampler = arm.sampler or "vllm"
                    before = engine.cpu_seconds() or 0.0
                    grpo.train(grpo_recipe(
                        work / "sft", run, args.steps, players, seed=seed,
                        sampler_precision=arm.precision, max_staleness=arm.max_staleness,
                        device="cpu", threads=threads, progress=False))
                    options.sampler = "vllm"
                    if arm.sampler == "vllm":
                        engine_cpu[name] = round(engine_cpu.get(name, 0.0)
                                                 + (engine.cpu_seconds() or 0.0) - before, 1)
                        replace_file(cpu_file, json.dumps(engine_cpu, indent=1))
                print(f"{name}: held-out eval", flush=True)
                players.held_out(run, work / f"eval-{name}", QUESTIONS)
                record.figures = figures(args.steps, work, engine_cpu)
                record.write(args.out)
    finally:
        players.close()
    print(json.dumps(record.figures, indent=1))
    return 0


def figures(steps: int, work: Path, engine_cpu: dict[str, float]) -> dict[str, Any]:
    """The record of every run finished in ``work``, this sitting's and earlier ones'."""
    runs: dict[str, dict[str, Any]] = {}
    questions = (world_large.ensure() / world_large.QA_FILE).read_text().splitlines()
    hops = {row["id"]: row["hops"] for row in map(json.loads, questions)}
    for found in sorted(work.glob("eval-*-seed*/summary.json")):
        name = found.parent.name.removeprefix("eval-")
        arm, _, seed = name.removeprefix("grpo-").rpartition("-seed")
        runs[name] = {"arm": arm, **asdict(ARMS[arm]), "seed": int(seed),
                      "held_out": summary(found.parent),
                      "held_out_by_hops": by_hops(found.parent, hops),
                      "vs_sft": paired(work / "eval-sft", found.parent),
                      "training": training(work / name, engine_cpu.get(name))}

    def against(base: str, other: str) -> dict[str, Any]:
        """``other`` minus ``base`` per seed that has both, paired by question."""
        pairs = {str(run["seed"]): (ARMS[base].run(base, run["seed"]), name)
                 for name, run in runs.items() if run["arm"] == other}
        return {seed: paired(work / f"eval-{before}", work / f"eval-{after}")
                for seed, (before, after) in pairs.items() if before in runs}

    return {
        "env_id": ENV_ID, "train": TRAIN, "held_out": TEST, "held_out_questions": QUESTIONS,
        "max_tokens": MAX_TOKENS, "max_turns": MAX_TURNS, "decoding": "greedy",
        "evaluator": "every checkpoint on one vLLM server, merged bfloat16 weights",
        "demonstrations": f"the oracle on the first {DEMOS} train questions",
        "grpo_steps": steps, "episodes_per_update": EPISODES_PER_UPDATE,
        "threads": available_cores(),
        "sft": summary(work / "eval-sft"),
        "sft_by_hops": by_hops(work / "eval-sft", hops),
        "sft_training": training(work / "sft", None),  # every GRPO arm's first stage
        "runs": runs,
        # Paired by question, seed by seed.
        "vllm_minus_local": against("local", "vllm"),
        "stale1_minus_vllm": against("vllm", "vllm-stale1"),
        # RL against SFT at equal data (and on every question), GRPO on either sampler
        "grpo_minus_sft_equal": {arm: against("sft-equal", arm) for arm in ("vllm", "local")},
        "grpo_minus_sft_all": {arm: against("sft-all", arm) for arm in ("vllm", "local")},
        # TEMPO against GRPO (local sampler) at the GRPO run's CPU seconds
        "tempo": {"recipe": TEMPO_RECIPE, "minus_grpo_local": against("local", "tempo")},
    }


if __name__ == "__main__":
    sys.exit(main())
