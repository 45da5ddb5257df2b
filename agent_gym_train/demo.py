"""``agent-gym train demo``: watch the embedded model learn a bundled task (what `make run` does).

    agent-gym train demo                      # into runs/demo; rerunning it continues there
    rm -rf runs/demo && time agent-gym train demo   # re-measure from scratch

Three stages, each into its own directory under ``--out``: the embedded SmolLM2-135M plays
every held-out question of Search-v0 (``split="test"``, 18 questions it is never trained
on; greedy, as ``agent-gym eval`` does); it is fine-tuned on the oracle demonstrations of
the 56 ``split="train"`` questions (``agent-gym train sft --preset cpu-demo``); the
checkpoint plays the held-out questions again. It prints the before/after table (successes
out of episodes, with 95% Wilson intervals, and the held-out demonstrations' NLL per
token), writes ``summary.json`` and the training curves (``sft/metrics.png``).

Why SFT alone, without a GRPO or OPD stage after it: on two cores the two evals and the
SFT epoch take most of the demo's budget, and the few GRPO steps that would fit could not
move 18 held-out episodes by more than their interval (the figures:
docs/experiments/learning.md).

Each stage is resumable the way its command is (eval keeps finished episodes, SFT continues
from its checkpoint), so an interrupted demo picks up where it stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from agent_gym.cli.parsing import OneLineParser
from agent_gym.eval.config import EvalConfig
from agent_gym.eval.run import evaluate
from agent_gym.eval.summary import Summary
from agent_gym_train import sft
from agent_gym_train.plot import plot
from agent_gym_train.policies import sampler_policy
from agent_gym_train.run.args import with_preset
from agent_gym_train.run.envpool import check_env
from agent_gym_train.run.files import CHECKPOINT_FILE, Checkpoint

# --help's description: the docstring's first paragraph, kept here (python -OO drops docstrings)
DESCRIPTION = ("``agent-gym train demo``: watch the embedded model learn a bundled task "
               "(what `make run` does).")

ENV_ID = "agent_gym/Search-v0"
TRAIN, TEST = {"split": "train"}, {"split": "test"}
HELD_OUT = 18  # questions in Search-v0's test split: each is played once
MAX_TOKENS, MAX_TURNS = 48, 4  # per reply, per episode: an oracle episode needs 2-4 of ~30


def held_out_success(policy: str, out: Path, args: argparse.Namespace) -> tuple[Summary, float]:
    """Greedy episodes of ``policy`` on every held-out question; its summary and seconds."""
    started = time.perf_counter()
    player = sampler_policy(policy, seed=0, max_tokens=MAX_TOKENS, device=args.device,
                            threads=args.threads)
    config = EvalConfig(ENV_ID, policy, HELD_OUT, 0, {**TEST, "max_turns": MAX_TURNS})
    summary = asyncio.run(evaluate(config, player, out, concurrency=8,
                                   progress=args.progress))
    return summary, time.perf_counter() - started


def table(rows: Sequence[tuple[str, Summary, float | None]]) -> str:
    """The before/after table: successes of episodes, rate, 95% Wilson interval, NLL."""
    lines = [f"{'model':<28} {'held-out success':<18} {'95% CI':<14} {'NLL/token':>9}"]
    for name, summary, nll in rows:
        successes = round((summary.success_rate or 0.0) * summary.episodes)
        lines.append(
            f"{name:<28} {f'{successes}/{summary.episodes}':<7} "
            f"{(summary.success_rate or 0.0):<10.2f} "
            f"{f'[{summary.success_low:.2f}, {summary.success_high:.2f}]':<14} "
            f"{'' if nll is None else f'{nll:.3f}':>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="agent-gym train demo", description=DESCRIPTION)
    parser.add_argument("--out", default="runs/demo",
                        help="run directory; rerunning into it continues (default runs/demo)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda[:N] or mps")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: the free cores, or $AGENT_GYM_THREADS)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="show progress bars")
    args = parser.parse_args(argv)
    # Both splits build before a model loads or --out is made: a missing extra (Search-v0's
    # index needs bm25s) is one line now, not a traceback after the first stage's model.
    for kwargs in (TRAIN, {**TEST, "max_turns": MAX_TURNS}):
        check_env(ENV_ID, kwargs, option=None)
    out = Path(args.out)
    started = time.perf_counter()

    print(f"1/3 the embedded model on {HELD_OUT} held-out {ENV_ID} questions", flush=True)
    base, base_seconds = held_out_success("local:smollm2", out / "eval-base", args)

    print("2/3 SFT on the oracle demonstrations of the train split "
          "(agent-gym train sft --preset cpu-demo)", flush=True)
    t0 = time.perf_counter()
    sft_args = with_preset(sft.Args, "cpu-demo", env_id=ENV_ID, env_kwargs=TRAIN,
                           heldout_env_kwargs=TEST, out=str(out / "sft"), device=args.device,
                           threads=args.threads, progress=args.progress)
    sft.train(sft_args)
    sft_seconds = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "sft" / "metrics.jsonl").read_text().splitlines()]
    nll_before = next((r["heldout_nll_before"] for r in rows if "heldout_nll_before" in r), None)
    nll_after = [r["heldout_nll"] for r in rows if "heldout_nll" in r][-1]
    checkpoint = Checkpoint.read(out / "sft" / CHECKPOINT_FILE).path
    curves = plot(out / "sft")

    print("3/3 the fine-tuned model on the same held-out questions", flush=True)
    after, after_seconds = held_out_success(f"local:smollm2@{checkpoint}", out / "eval-sft",
                                            args)
    total = time.perf_counter() - started
    print(table([("SmolLM2-135M (base)", base, nll_before),
                 (f"after SFT ({len(rows)} steps)", after, nll_after)]))
    summary = {
        "env_id": ENV_ID, "heldout": TEST, "train": TRAIN, "episodes": HELD_OUT,
        "decoding": "greedy", "max_tokens": MAX_TOKENS, "max_turns": MAX_TURNS,
        "base": base.__dict__, "sft": after.__dict__,
        "heldout_nll_before": nll_before, "heldout_nll_after": nll_after,
        "sft_steps": len(rows), "checkpoint": checkpoint, "curves": str(curves),
        "seconds": {"eval_base": round(base_seconds, 1), "sft": round(sft_seconds, 1),
                    "eval_sft": round(after_seconds, 1), "total": round(total, 1)},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(f"curves: {curves}; summary: {out / 'summary.json'}; {total:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
