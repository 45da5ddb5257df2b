"""Can TEMPO's critic, the policy's own weights, learn Search-v0's values at all?

    python benchmarks/bench_critic.py --checkpoint runs/demo/sft/checkpoints/RUN/step-000014

TEMPO's runs (``bench_learning.py --only tempo``) never brought the critic below the best
constant. This benchmark asks the question without TEMPO around it: no TD targets, no
actor update sharing the weights, no policy drift, just the critic learning values from
the most direct signal it can get.

States are collected as TEMPO's warm-up collects them (``monte_carlo_targets``): the
checkpoint plays ``--branches`` episodes of every train-split question at temperature 1,
and the critic is asked at each task's opening (target: the mean return of its branches)
and after every turn before an episode's last (target: the reward it still collected).
This is done twice with different seeds. The first collection trains, the second measures:
the same questions, new episodes, the easiest generalisation a TD critic needs.

Training is cross-entropy on the reply that states each target (``Critic.target_reply``),
``--epochs`` passes over ``--train-states`` states. Measured on ``--test-states`` states
of the second collection, each against the best constant under absolute error (the median
of the training targets) on the same states:

- the greedy value;
- every one of 4 replies at temperature 1 (what ``bench_learning`` scores);
- the median of those 4 replies;
- the median of its distribution over the replies stating 0, 0.25, 0.5, 0.75 and 1, each
  scored whole (``Critic.median``, TEMPO's readout).

Also reported: what a predictor would score that knows the question, whether the state is
an opening, and whether a gold answer's string appears in the history so far. It takes the
median target of its cell in the training collection, so it bounds what those cues carry.

The critic learns each target as TEMPO does: the reply stating it, by cross-entropy. The
collected states are cached (``--states``, default in ``--work``) and reused by any run
with the same checkpoint and budgets, so variants are measured on the very same states.

Writes ``benchmarks/results/critic.json``. About 45 minutes on one thread of this machine.

What it measured is in ``docs/experiments/critic.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import RESULTS, Result  # noqa: E402

from agent_gym.durable import replace_file  # noqa: E402
from agent_gym_train.critic import Critic, CriticSample  # noqa: E402
from agent_gym_train.run.clients import Sampler  # noqa: E402
from agent_gym_train.run.episode import cross_entropy_datum  # noqa: E402
from agent_gym_train.run.rollout import RolloutConfig, rollout_groups  # noqa: E402
from agent_gym_train.run.run import Run, device_defaults, open_run  # noqa: E402
from agent_gym_train.run.store import cut  # noqa: E402
from agent_gym_train.tempo import Args, monte_carlo_targets  # noqa: E402

ENV_ID = "agent_gym/Search-v0"
TASKS_PER_ROLLOUT = 8
HOT_SAMPLES = 4


def collect(run: Run, sampler: Sampler, config: RolloutConfig, seed: int,
            questions: int) -> list[dict[str, Any]]:
    """Every critic state of ``--branches`` episodes per train question, with its target:
    the chat there (not the critic's prompt, so a cached collection serves any prompt)."""
    states = []
    for first in range(0, questions, TASKS_PER_ROLLOUT):
        tasks = [{"index": i} for i in range(first, min(first + TASKS_PER_ROLLOUT, questions))]
        groups = asyncio.run(rollout_groups(
            run.envs, tasks, sampler, run.renderer, config,
            seeds=[seed + first + g for g in range(len(tasks))],
            concurrency=run.args.concurrency))
        for episode, turn, target in monte_carlo_targets(groups, 1):
            if turn == 0:
                opening = episode.opening_messages
                messages, privileged = episode.messages[:opening], episode.privileged
            else:
                point = cut(episode, turn, 0)
                messages, opening, privileged = point.messages, point.opening, point.privileged
            history = " ".join(str(m.get("content", "")) for m in messages[opening:])
            answers = [str(a).lower() for a in privileged.get("answers", [])]
            states.append({
                "task": episode.task_id, "turn": turn, "target": target,
                "messages": [dict(m) for m in messages], "opening": opening,
                "privileged": dict(privileged),
                "answer_in_history": any(a in history.lower() for a in answers),
            })
    return states


def collections(run: Run, config: RolloutConfig, questions: int, key: dict[str, Any],
                path: Path) -> list[list[dict[str, Any]]]:
    """The two collections (seeds 0 and 10 000), read from ``path`` when it holds the
    same ones, else collected and written there.

    A cached copy lets the critic's prompt or training change without new episodes, so
    two variants are measured on the very same states."""
    if path.exists():
        saved = json.loads(path.read_text())
        if saved["key"] == key:
            return saved["pools"]
    sampler = run.training.save_weights_and_get_sampling_client()
    pools = [collect(run, sampler, config, seed, questions) for seed in (0, 10_000)]
    replace_file(path, json.dumps({"key": key, "pools": pools}))
    return pools


def scores(values: Sequence[float | None], targets: Sequence[float],
           constant: float) -> dict[str, Any]:
    """Absolute error of the parsed values and of ``constant`` on the same states."""
    pairs = [(v, t) for v, t in zip(values, targets, strict=True) if v is not None]
    if not pairs:
        return {"parsed": 0, "of": len(values)}
    v, t = np.array(pairs).T
    corr = float(np.corrcoef(v, t)[0, 1]) if np.ptp(v) and np.ptp(t) else None
    gain = np.abs(t - constant) - np.abs(v - t)  # per state: how much closer than the constant
    # A paired bootstrap of the mean gain: on 100 states whose errors are 0, 0.25, ... or 1,
    # a gap of a few hundredths is often noise.
    draws = np.random.default_rng(0).integers(0, len(gain), (2000, len(gain)))
    low, high = np.percentile(gain[draws].mean(axis=1), [2.5, 97.5])
    return {"parsed": len(pairs), "of": len(values),
            "abs_error": round(float(np.abs(v - t).mean()), 4),
            "abs_error_best_constant": round(float(np.abs(t - constant).mean()), 4),
            "gain_over_constant_95": [round(float(low), 4), round(float(high), 4)],
            "value_mean": round(float(v.mean()), 4), "value_target_corr": corr}


def measure(run: Run, greedy: Critic, hot: Critic, test: list[dict[str, Any]],
            constant: float) -> dict[str, Any]:
    sampler = run.training.save_weights_and_get_sampling_client()

    async def replies(critic: Critic, n: int) -> list[list[CriticSample]]:
        return list(await asyncio.gather(*(critic.sample(sampler, s["prompt"], n, i)
                                           for i, s in enumerate(test))))

    targets = [s["target"] for s in test]
    first = [r[0].value for r in asyncio.run(replies(greedy, 1))]
    sampled = asyncio.run(replies(hot, HOT_SAMPLES))
    each = [r.value for rs in sampled for r in rs]
    medians = [float(np.median(parsed)) if (parsed := [r.value for r in rs
                                                       if r.value is not None]) else None
               for rs in sampled]
    medians_of_replies = asyncio.run(reply_medians(greedy, sampler, test))
    return {"greedy": scores(first, targets, constant),
            "median_of_scored_replies": scores(medians_of_replies, targets, constant),
            "temperature_1_each_reply": scores(
                each, [t for t in targets for _ in range(HOT_SAMPLES)], constant),
            "temperature_1_median_of_4": scores(medians, targets, constant),
            "per_state": {"target": targets, "greedy": first, "median_of_4": medians,
                          "median_of_scored_replies": medians_of_replies}}


async def reply_medians(critic: Critic, sampler: Sampler,
                        states: list[dict[str, Any]]) -> list[float]:
    """Per state, the median readout (``Critic.median``): the replies stating 0, 0.25, ...,
    1 each scored whole, not read token by token as greedy decoding does."""
    return list(await asyncio.gather(*(critic.median(sampler, s["prompt"]) for s in states)))


async def stated(critic: Critic, sampler: Sampler,
                 states: list[dict[str, Any]]) -> list[CriticSample]:
    """The replies stating each state's target, to train on."""
    return list(await asyncio.gather(*(critic.target_reply(sampler, s["prompt"], s["target"])
                                       for s in states)))


def fit(run: Run, greedy: Critic, batch: list[dict[str, Any]], sampler: Sampler
        ) -> float | None:
    """One update of the critic on ``batch``, TEMPO's way: the reply stating each target,
    as a demonstration (its logprobs are unused, so ``sampler`` may be the epoch's); its
    loss."""
    replies = asyncio.run(stated(greedy, sampler, batch))
    return run.update([], supervised=[cross_entropy_datum(r.sequence)
                                      for r in replies])["supervised_loss"]


def cue_bound(train: list[dict[str, Any]], test: list[dict[str, Any]]) -> dict[str, Any]:
    """The median training target of each (question, opening?, answer in history?) cell,
    scored on the test states (a cell never seen predicts the overall median)."""
    cells: dict[tuple, list[float]] = defaultdict(list)
    for s in train:
        cells[(s["task"], s["turn"] == 0, s["answer_in_history"])].append(s["target"])
    overall = float(np.median([s["target"] for s in train]))
    guesses = [float(np.median(cells[key])) if (key := (s["task"], s["turn"] == 0,
                                                        s["answer_in_history"])) in cells
               else overall for s in test]
    return scores(guesses, [s["target"] for s in test], overall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="the policy (an SFT checkpoint)")
    parser.add_argument("--branches", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="the policy's sampling temperature in the collected episodes")
    parser.add_argument("--train-states", type=int, default=192)
    parser.add_argument("--test-states", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--questions", type=int, default=None,
                        help="the first N train questions only (default: all 56)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work", default="runs/bench-critic", help="the run's directory")
    parser.add_argument("--states", default=None,
                        help="where the collected states are cached (default: in --work); "
                        "a cache made with the same checkpoint and budgets is reused")
    parser.add_argument("--out", default=str(RESULTS / "critic.json"))
    options = parser.parse_args()
    record = Result()
    args = device_defaults(Args(
        env_id=ENV_ID, env_kwargs={"split": "train", "max_turns": options.max_turns},
        init_from=options.checkpoint, learning_rate=options.learning_rate,
        max_tokens=options.max_tokens, max_trajectory_tokens=4096, threads=options.threads,
        out=options.work, progress=False, branches=options.branches))
    with open_run(args, 1) as run:
        greedy = Critic(run.renderer, r_max=1.0, max_tokens=args.critic_max_tokens,
                        temperature=0.0)
        hot = Critic(run.renderer, r_max=1.0, max_tokens=args.critic_max_tokens,
                     temperature=1.0)
        config = RolloutConfig(max_turns=run.max_turns, group_size=options.branches,
                               max_tokens=options.max_tokens, max_trajectory_tokens=4096,
                               temperature=options.temperature, keep_states=True,
                               cut_continues=True)
        questions = min(options.questions or run.num_tasks, run.num_tasks)
        key = {k: getattr(options, k) for k in ("checkpoint", "branches", "max_tokens",
                                                "max_turns")} | {"questions": questions}
        if options.temperature != 1.0:  # caches made before the option stay valid
            key["temperature"] = options.temperature
        pools = collections(run, config, questions, key,
                            Path(options.states or Path(options.work) / "critic-states.json"))
        for state in pools[0] + pools[1]:
            state["prompt"] = greedy.prompt(state["messages"], state["opening"],
                                            state["privileged"])
            text = run.renderer.tokenizer.decode(state["prompt"])
            shown = text.split("## History", 1)[-1].split("## Privileged information", 1)[0]
            state["answer_shown"] = any(str(a).lower() in shown.lower()
                                        for a in state["privileged"].get("answers", []))
        # Separate streams: the measured states do not change with --train-states.
        chooser = random.Random(0)
        train = chooser.sample(pools[0], min(len(pools[0]), options.train_states))
        test = random.Random(1).sample(pools[1], min(len(pools[1]), options.test_states))
        constant = float(np.median([s["target"] for s in train]))
        print(f"{len(pools[0])} + {len(pools[1])} states; constant {constant}", flush=True)
        rows = [{"epoch": 0, **measure(run, greedy, hot, test, constant)}]
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "per_state"}), flush=True)
        for epoch in range(1, options.epochs + 1):
            order = chooser.sample(train, len(train))
            sampler = run.training.save_weights_and_get_sampling_client()
            losses = [fit(run, greedy, order[first:first + options.batch], sampler)
                      for first in range(0, len(order), options.batch)]
            losses = [loss for loss in losses if loss is not None]
            rows.append({"epoch": epoch,
                         "train_loss": round(float(np.mean(losses)), 4) if losses else None,
                         **measure(run, greedy, hot, test, constant)})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "per_state"}), flush=True)
    all_states = pools[0] + pools[1]
    targets = np.array([s["target"] for s in all_states])
    record.figures.update({
        # the results file's own path as the repository names it, not this machine's
        "settings": vars(options) | {"out": os.path.relpath(options.out, ROOT)},
        "states": {"train_pool": len(pools[0]), "test_pool": len(pools[1]),
                   "trained": len(train), "measured": len(test),
                   "target_mean": round(float(targets.mean()), 4),
                   "target_zero_fraction": round(float((targets == 0).mean()), 4),
                   # the cue the critic must read, and how often its prompt still shows it
                   "answer_in_history": sum(s["answer_in_history"] for s in all_states),
                   "answer_shown_to_critic": sum(s["answer_shown"] for s in all_states),
                   "mean_target_answer_in_history": round(float(np.mean(
                       [s["target"] for s in all_states if s["answer_in_history"]] or [0])), 4),
                   "mean_prompt_tokens": round(float(np.mean(
                       [len(s["prompt"]) for s in all_states])), 1)},
        "best_constant": constant,
        "by_epoch": rows,
        "cue_bound": cue_bound(train, test),
    })
    record.write(options.out)
    print(json.dumps({"cue_bound": record.figures["cue_bound"], "seconds": record.seconds}))


if __name__ == "__main__":
    main()
