"""``agent-gym train demo``: watch the embedded model learn a task by imitation, then by
reinforcement (what `make run` does).

    agent-gym train demo                      # into runs/demo; rerunning it continues there
    rm -rf runs/demo && time agent-gym train demo   # re-measure from scratch

Search-v0 on its ``world-large`` set: 1000 train and 250 test questions about two worlds
that share no entity, so what the model gains on the test questions is procedure (search,
read, search again, answer), not facts. Six stages, each into its own directory under
``--out`` and each resumable the way its command is:

1. ``demos``: the oracle plays the first 200 train questions (its episodes are the
   demonstrations);
2. ``eval-base``: the embedded SmolLM2-135M plays 100 of the test questions (episodes 0-99
   of ``agent-gym eval``, so the same 100 in every stage), greedy;
3. ``sft``: ``agent-gym train sft --preset cpu-demo`` on the demonstrations;
4. ``eval-sft``: the SFT checkpoint on the same test questions;
5. ``grpo``: ``agent-gym train grpo`` from the SFT checkpoint on the train questions, 6
   updates of 4 tasks x 8 branches, the task sampler that prefers tasks of mixed outcome;
6. ``eval-grpo``: the GRPO checkpoint on the same test questions.

It ends with one table: each stage's held-out success with its 95% interval, and the
difference to the stage before with its paired 95% interval (the same questions, so the
interval is the paired one ``agent-gym compare`` gives), plus ``summary.json`` and the
training curves (``sft/metrics.png``, ``grpo/metrics.png``).

Why 100 test questions and 6 updates: the budget is 30 minutes on 2 cores, and the learner's
update on 32 episodes takes most of a GRPO step there (60-130 s of it). Six updates moved
SFT by 13 and by 34 points on these questions in two runs of this demo, twelve (on all 250)
by about 19 (docs/experiments/learning.md); the paired interval on 100 questions was clear of
0 in both runs, and an eval of 100 on vLLM takes about a minute.

Rollouts and evals sample from vLLM (``--sampler vllm``, merged weights) when ``make
setup`` has built its venv, and from the local sampler otherwise (``--sampler local``; the
same stages, slower).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from agent_gym.cli.parsing import OneLineParser
from agent_gym.eval.compare import compare
from agent_gym.eval.config import EvalConfig
from agent_gym.eval.policies import make_policy
from agent_gym.eval.run import evaluate
from agent_gym.eval.runfiles import SUMMARY_FILE
from agent_gym.eval.runs import read_run
from agent_gym.eval.summary import Summary, summarize
from agent_gym_train import grpo, sft
from agent_gym_train.backends import SAMPLERS
from agent_gym_train.backends.local import LocalServiceClient
from agent_gym_train.backends.merged import save_engine_model
from agent_gym_train.backends.models import load_model, load_tokenizer, model_dir
from agent_gym_train.backends.runtime import (
    THREADS_ENV,
    available_cores,
    native_bf16,
    resolve_device,
)
from agent_gym_train.backends.vllm import (
    BASE_WEIGHTS,
    Engine,
    EngineConfig,
    MergedWeights,
    vllm_python,
)
from agent_gym_train.plot import plot
from agent_gym_train.policies import SamplerPolicy, sampler_policy
from agent_gym_train.run.args import with_preset
from agent_gym_train.run.envpool import check_env
from agent_gym_train.run.files import checkpoint_path

# --help's description: the docstring's first paragraph, kept here (python -OO drops docstrings)
DESCRIPTION = ("``agent-gym train demo``: watch the embedded model learn a task by imitation, "
               "then by\nreinforcement (what `make run` does).")

ENV_ID = "agent_gym/Search-v0"
TRAIN = {"dataset": "world-large", "split": "train"}
TEST = {"dataset": "world-large", "split": "test"}
DEMOS = 200  # oracle demonstrations: the first train questions
HELD_OUT = 100  # test questions every stage plays, each once
MAX_TOKENS, MAX_TURNS = 48, 4  # per reply, per episode: an oracle episode needs 2-4
GRPO_STEPS = 6
GRPO_TASKS, GRPO_BRANCHES = 4, 8  # per update: tasks x branches of each


@dataclass(frozen=True)
class HeldOut:
    """The test set the players play: an env's kwargs (its test split and turn limit) and
    the reply length, the same for every policy so that their runs pair episode by episode."""

    env_id: str
    env_kwargs: dict[str, object]
    max_tokens: int


SEARCH_TEST = HeldOut(ENV_ID, {**TEST, "max_turns": MAX_TURNS}, MAX_TOKENS)


@dataclass(frozen=True)
class Stage:
    """One row of the table: a policy's held-out summary, and against the row before it."""

    name: str
    summary: Summary
    seconds: float
    difference: tuple[float, float, float] | None = None  # paired: value, low, high


class Players:
    """The policies the held-out stages play: on one vLLM server that serves every stage
    (GRPO's rollouts too: a server's start costs about a minute, four would cost four), its
    weights reloaded for each checkpoint, or on the local sampler."""

    def __init__(self, out: Path, args: argparse.Namespace, test: HeldOut = SEARCH_TEST
                 ) -> None:
        self.out, self.args, self.test = out, args, test
        self.engine: Engine | None = None
        if args.sampler == "vllm":
            base = save_engine_model(load_model("smollm2"), model_dir("smollm2"),
                                     out / "engine" / BASE_WEIGHTS)
            self.engine = Engine.start(EngineConfig(
                base, "smollm2", 0, 1, out / "vllm.log", threads=args.threads, reloads=True))

    def player(self, checkpoint: Path | None) -> SamplerPolicy:
        spec = f"{self.args.sampler}:smollm2" + (f"@{checkpoint}" if checkpoint else "")
        if self.engine is None:
            return sampler_policy(spec, seed=0, max_tokens=self.test.max_tokens,
                                  device=self.args.device, threads=self.args.threads)
        if checkpoint is None:
            weights = MergedWeights(self.engine, load_tokenizer("smollm2"), self.out / "engine",
                                    keep=1, loaded=None)
            sampler = weights.base()
        else:
            weights = MergedWeights(self.engine, load_tokenizer("smollm2"),
                                    self.out / "engine" / checkpoint.name, keep=1, loaded=None)
            local = LocalServiceClient(checkpoint_dir=self.out / "engine" / "checkpoints",
                                       device="cpu", threads=self.args.threads)
            client = local.create_training_client_from_state(checkpoint_path(str(checkpoint)))
            sampler = weights.publish(weights.saver(client))
        return SamplerPolicy(spec, sampler, max_tokens=self.test.max_tokens, temperature=0.0,
                             seed=0)

    def held_out(self, checkpoint: Path | None, out: Path, questions: int = HELD_OUT
                 ) -> tuple[Summary, float]:
        """Greedy episodes 0 to ``questions - 1`` on the test set (none when a finished run is
        there already: no weights are loaded for it)."""
        started = time.perf_counter()
        if (out / SUMMARY_FILE).is_file():
            done = read_run(out)
            if len(done.episodes) >= questions:
                return summarize(done.config, list(done.episodes.values()),
                                 len(done.errors)), 0.0
        player = self.player(checkpoint)
        config = EvalConfig(self.test.env_id, player.name, questions, 0,
                            self.test.env_kwargs, max_tokens=self.test.max_tokens)
        summary = asyncio.run(evaluate(config, player, out, progress=self.args.progress,
                                       concurrency=32 if self.engine else 8))
        return summary, time.perf_counter() - started

    def rollouts(self) -> dict[str, object]:
        """A trainer's sampling options for rollouts on the players' sampler: its vLLM
        server, or the local sampler's bfloat16 copy where the CPU multiplies bf16 (the
        faster of its two precisions)."""
        vllm = self.engine is not None and self.args.sampler == "vllm"
        native = native_bf16(resolve_device(self.args.device))
        return {"sampler": self.args.sampler,
                "sampler_precision": "bfloat16" if native and not vllm else "float32",
                "vllm_url": self.engine.url if vllm and self.engine else None}

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def demonstrations(out: Path, args: argparse.Namespace, questions: int = DEMOS,
                   env_id: str = ENV_ID, train: dict[str, object] = TRAIN) -> float:
    """The oracle's episodes on the first ``questions`` train tasks (no model: seconds)."""
    started = time.perf_counter()
    config = EvalConfig(env_id, "oracle", questions, 0, train)
    asyncio.run(evaluate(config, make_policy("oracle", seed=0), out, progress=args.progress))
    return time.perf_counter() - started


def grpo_recipe(sft_run: Path, out: Path, steps: int, players: Players, **given: object
                ) -> grpo.Args:
    """GRPO from ``sft_run`` on the train questions: 4 tasks x 8 branches at lr 1e-4, the
    task sampler that prefers tasks of mixed outcome; rollouts on the players' sampler
    (``Players.rollouts``). ``given`` overrides any of it."""
    return with_preset(
        grpo.Args, "cpu-demo", env_id=ENV_ID, env_kwargs=TRAIN, init_from=str(sft_run),
        batch_size=GRPO_TASKS, group_size=GRPO_BRANCHES, learning_rate=1e-4,
        task_sampler="mixed", steps=steps, save_every=1, out=str(out),
        **(players.rollouts() | given))


def table(stages: list[Stage]) -> str:
    lines = [f"{'policy':<22} {'held-out success':<20} {'95% CI':<14} "
             f"{'vs the row above [paired 95% CI]':<34} {'time':>6}"]
    for stage in stages:
        s = stage.summary
        successes = round((s.success_rate or 0.0) * s.tasks)
        versus = ("" if stage.difference is None else
                  "{:+.2f} [{:+.2f}, {:+.2f}]".format(*stage.difference))
        lines.append(f"{stage.name:<22} {f'{successes}/{s.tasks}':<8} "
                     f"{(s.success_rate or 0.0):<11.2f} "
                     f"{f'[{s.success_low:.2f}, {s.success_high:.2f}]':<14} {versus:<34} "
                     f"{stage.seconds / 60:>4.1f}m")
    return "\n".join(lines)


def paired(before: Path, after: Path) -> tuple[float, float, float]:
    result = compare([read_run(before)], [read_run(after)], "before", "after").overall
    return result.difference, result.low, result.high


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="agent-gym train demo", description=DESCRIPTION)
    parser.add_argument("--out", default="runs/demo",
                        help="run directory; rerunning into it continues (default runs/demo)")
    parser.add_argument("--sampler", choices=SAMPLERS, default=None,
                        help="where rollouts and evals sample (default: vllm when make setup "
                             "has built its venv, else local)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda[:N] or mps")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads of every stage (default: $AGENT_GYM_THREADS, else every "
                             "usable core)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="show progress bars")
    args = parser.parse_args(argv)
    args.sampler = args.sampler or ("vllm" if vllm_python().is_file() else "local")
    # Every core, every stage: the demo is the machine's only job, and the load its own
    # previous stage leaves would make each trainer's free-core default take one.
    args.threads = args.threads or int(os.environ.get(THREADS_ENV) or available_cores())
    # Both splits build before a model loads or --out is made: a missing extra (Search-v0's
    # index needs bm25s) is one line now, not a traceback after the first stage's model.
    for kwargs in (TRAIN, SEARCH_TEST.env_kwargs):
        check_env(ENV_ID, kwargs, option=None)
    out = Path(args.out)
    started = time.perf_counter()
    print(f"sampling with {args.sampler}" + ("" if args.sampler == "vllm" else
          " (no vLLM venv: `make setup` builds it; the local sampler is slower)"), flush=True)
    players = Players(out, args)
    try:
        return stages(out, args, players, started)
    finally:
        players.close()


def stages(out: Path, args: argparse.Namespace, players: Players, started: float) -> int:

    print(f"1/6 the oracle on the first {DEMOS} train questions: the demonstrations",
          flush=True)
    demo_seconds = demonstrations(out / "demos", args)
    print(f"2/6 the embedded model on {HELD_OUT} held-out questions", flush=True)
    base, base_seconds = players.held_out(None, out / "eval-base")

    print(f"3/6 SFT on the {DEMOS} demonstrations (agent-gym train sft --preset cpu-demo)",
          flush=True)
    t0 = time.perf_counter()
    sft.train(with_preset(sft.Args, "cpu-demo", env_id=ENV_ID, env_kwargs=TRAIN,
                          demos=str(out / "demos"), out=str(out / "sft"), device=args.device,
                          threads=args.threads, progress=args.progress))
    sft_seconds = time.perf_counter() - t0
    print("4/6 the SFT checkpoint on the held-out questions", flush=True)
    after_sft, sft_eval_seconds = players.held_out(out / "sft", out / "eval-sft")

    print(f"5/6 GRPO from the SFT checkpoint, {GRPO_STEPS} updates of 4 tasks x 8 branches "
          "(agent-gym train grpo --init-from SFT)", flush=True)
    t0 = time.perf_counter()
    grpo.train(grpo_recipe(out / "sft", out / "grpo", GRPO_STEPS, players, device=args.device,
                           threads=args.threads, progress=args.progress))
    grpo_seconds = time.perf_counter() - t0
    print("6/6 the GRPO checkpoint on the held-out questions", flush=True)
    after_grpo, grpo_eval_seconds = players.held_out(out / "grpo", out / "eval-grpo")

    stages = [
        Stage("SmolLM2-135M (base)", base, base_seconds),
        Stage("after SFT", after_sft, sft_seconds + sft_eval_seconds,
              paired(out / "eval-base", out / "eval-sft")),
        Stage("after SFT + GRPO", after_grpo, grpo_seconds + grpo_eval_seconds,
              paired(out / "eval-sft", out / "eval-grpo")),
    ]
    curves = [str(plot(out / "sft")), str(plot(out / "grpo"))]
    total = time.perf_counter() - started
    print(table(stages))
    summary = {
        "env_id": ENV_ID, "train": TRAIN, "heldout": TEST, "heldout_questions": HELD_OUT,
        "demonstrations": DEMOS, "grpo_steps": GRPO_STEPS, "sampler": args.sampler,
        "decoding": "greedy", "max_tokens": MAX_TOKENS, "max_turns": MAX_TURNS,
        "stages": [{"name": s.name, "summary": asdict(s.summary), "vs_previous": s.difference,
                    "seconds": round(s.seconds, 1)} for s in stages],
        "curves": curves,
        "seconds": {"demos": round(demo_seconds, 1), "eval_base": round(base_seconds, 1),
                    "sft": round(sft_seconds, 1), "eval_sft": round(sft_eval_seconds, 1),
                    "grpo": round(grpo_seconds, 1), "eval_grpo": round(grpo_eval_seconds, 1),
                    "total": round(total, 1)},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(f"curves: {', '.join(curves)}; summary: {out / 'summary.json'}; "
          f"{total / 60:.1f} min in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
