"""Trainer speed, each figure beside its baseline in the same run.

- render: the cost of building turn t's prompt over a 50-turn tool conversation, token
  continuous and incremental (``Conversation.append``: closing tokens + the new messages)
  vs re-rendering the whole chat with ``apply_chat_template`` (what the seed lab did every
  turn). Both produce identical tokens here (checked), so only the cost differs.
- datums: ``build_datum`` throughput (datums/s, tokens/s) on multi-turn token sequences vs a
  straightforward per-position Python loop building the same Datum.

    python benchmarks/bench_trainer.py [--turns 50] [--out benchmarks/results/trainer.json]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable

from harness import RESULTS, Result
from pytrio import Datum, ModelInput

from agent_gym.render import ChatRenderer, Conversation
from agent_gym_train.backends.models import load_tokenizer
from agent_gym_train.run.episode import TokenSequence, build_datum

OPENING = [
    {"role": "system", "content": "You are an agent. Use the python tool, then answer."},
    {"role": "user", "content": "Find the 40th prime number and explain how you checked it."},
]
REPLY = (
    "Let me check step {t}: I will count primes with a sieve and compare.\n"
    '<tool_call>\n{{"name": "python", "arguments": {{"code": "print(sieve({t}))"}}}}\n</tool_call>'
)
OBSERVATION = "step {t}: " + " ".join(str(p) for p in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29) * 4)


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def best_of(repeats: int, run: Callable[[], object]) -> float:
    return min(timed(run) for _ in range(repeats))


def bench_render(turns: int, repeats: int) -> dict[str, object]:
    renderer = ChatRenderer(load_tokenizer("smollm2"))
    conversation = Conversation.start(renderer, OPENING)
    rows = []
    for t in range(1, turns + 1):
        completion = renderer.encode(REPLY.format(t=t)) + renderer.stop_tokens
        observation = [{"role": "user", "content": OBSERVATION.format(t=t)}]
        forks = [conversation.fork() for _ in range(repeats)]  # copied outside the timing
        incremental = min(
            timed(functools.partial(f.append, completion, observation)) for f in forks
        )
        conversation.append(completion, observation)
        messages = conversation.messages
        full = best_of(repeats, functools.partial(renderer.prompt, messages))
        if renderer.prompt(messages) != conversation.tokens:
            raise AssertionError(f"turn {t}: incremental and full render disagree")
        rows.append({"turn": t, "prompt_tokens": len(conversation.tokens),
                     "incremental_ms": incremental * 1e3, "full_ms": full * 1e3})
    picked = [r for r in rows if r["turn"] in (1, 10, 25, turns)]
    return {
        "tokenizer": "SmolLM2 (ChatML)",
        "turns": turns,
        "by_turn": [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
                    for r in picked],
        "incremental_ms_mean": round(statistics.mean(r["incremental_ms"] for r in rows), 4),
        "full_ms_mean": round(statistics.mean(r["full_ms"] for r in rows), 4),
        "incremental_growth_last_vs_first": ratio(rows[-1], rows[0], "incremental_ms", 2),
        "full_growth_last_vs_first": ratio(rows[-1], rows[0], "full_ms", 2),
        "full_vs_incremental_at_last_turn": round(
            rows[-1]["full_ms"] / rows[-1]["incremental_ms"], 1),
        "full_vs_incremental_mean": round(
            statistics.mean(r["full_ms"] for r in rows)
            / statistics.mean(r["incremental_ms"] for r in rows), 1),
    }


def ratio(last: dict, first: dict, key: str, digits: int) -> float:
    return round(last[key] / first[key], digits)


def naive_datum(sequence: TokenSequence, advantage: float) -> Datum:
    """The obvious builder: walk every position in Python, append to lists."""
    tokens = list(sequence.tokens)
    sampled: dict[int, float] = {}
    for span in sequence.spans:
        for offset, logprob in enumerate(span.logprobs):
            sampled[span.start + offset] = logprob
    targets, logprobs, advantages = [], [], []
    for position in range(1, len(tokens)):
        if position in sampled:
            targets.append(tokens[position])
            logprobs.append(sampled[position])
            advantages.append(advantage)
        else:
            targets.append(-100)
            logprobs.append(0.0)
            advantages.append(0.0)
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": targets, "logprobs": logprobs, "advantages": advantages},
    )


def synthetic_episode(turn_count: int, prompt: int, reply: int, observation: int) -> TokenSequence:
    tokens = list(range(100, 100 + prompt))
    sequence = TokenSequence(tuple(tokens))
    for t in range(turn_count):
        completion = [(7 * t + i) % 40000 + 10 for i in range(reply)]
        sequence = sequence.extend(tokens, completion, [-0.5] * reply)
        tokens += completion + [(3 * t + i) % 40000 + 10 for i in range(observation)]
    return sequence


def bench_datums(seconds: float) -> dict[str, object]:
    results = {}
    for name, shape in {"1 turn x 512": (1, 256, 512, 0),
                        "10 turns x (150 + 100 obs)": (10, 256, 150, 100)}.items():
        sequence = synthetic_episode(*shape)
        tokens = len(sequence.tokens)
        if naive_datum(sequence, 1.0) != build_datum(sequence, 1.0):
            raise AssertionError("the two builders disagree")
        figures = {}
        for label, builder in (("build_datum", build_datum), ("naive_loop", naive_datum)):
            count, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                builder(sequence, 1.0)
                count += 1
            elapsed = time.perf_counter() - start
            figures[label] = {"datums_per_s": round(count / elapsed, 1),
                              "tokens_per_s": round(count * tokens / elapsed)}
        figures["ratio"] = round(figures["build_datum"]["datums_per_s"]
                                 / figures["naive_loop"]["datums_per_s"], 2)
        figures["tokens_per_datum"] = tokens
        results[name] = figures
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0, help="per datum figure")
    parser.add_argument("--out", default=str(RESULTS / "trainer.json"))
    args = parser.parse_args()
    record = Result()
    result: dict[str, object] = record.figures
    result |= {
        "render": bench_render(args.turns, args.repeats),
        "datums": bench_datums(args.seconds),
    }
    render = result["render"]
    print(f"{'turn':>5} {'prompt tokens':>14} {'incremental ms':>15} {'full re-render ms':>18}")
    for row in render["by_turn"]:  # type: ignore[index]
        print(f"{row['turn']:>5} {row['prompt_tokens']:>14} {row['incremental_ms']:>15.3f} "
              f"{row['full_ms']:>18.3f}")
    print(f"full / incremental: {render['full_vs_incremental_at_last_turn']}x at turn "  # type: ignore[index]
          f"{args.turns}, {render['full_vs_incremental_mean']}x on average")  # type: ignore[index]
    for name, figures in result["datums"].items():  # type: ignore[union-attr]
        print(f"datums {name}: {figures['build_datum']['datums_per_s']}/s "
              f"({figures['build_datum']['tokens_per_s']} tokens/s) vs naive "
              f"{figures['naive_loop']['datums_per_s']}/s -> {figures['ratio']}x")
    record.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
