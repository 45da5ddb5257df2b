"""Step time of degenerate actions against plain text of the same length, in every env.

A policy stuck in a loop emits the same fragment until the token limit: an unclosed
``\\boxed{``, an unclosed ``<parameter=``, ``[`` after ``[``, fence after fence. Parsers
that rescan the rest of the text from each fragment are quadratic (a 98 KB GSM8K step took
76 s). Here every env steps each degenerate action of 10 KB, 100 KB and 1 MB (the action
limit) and, in the same run and interleaved with it, a plain-text action of the same
length; the figure is the ratio of their median step times. Linear parsing keeps that ratio
flat as the action grows: the check is that the ratio at 1 MB stays within 2x of the ratio
at 10 KB (a quadratic parser grows it ~100x over that range).

Step time is the stepping thread's CPU time: on a shared, loaded machine a 10 ms step is
preempted by other processes and a 0.1 ms one is not, which inflated wall-clock times of
large actions up to 3x here and would fake superlinear growth. Wall-clock medians are
recorded beside them. None of these steps waits on another thread or process (no answer is
found, no code runs, no search is sent), so CPU time is all of their work.

A size is skipped when the step measured at the size below, were it quadratic, would take
over ``--budget`` seconds at this one; a skipped case fails the check.

    python benchmarks/bench_parsers.py [--out benchmarks/results/parsers.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium
from harness import RESULTS, Result

import agent_gym  # noqa: F401  (registers the envs)

SIZES = (10_000, 100_000, 1_000_000)
REPEATS = {10_000: 25, 100_000: 9, 1_000_000: 5}
GROWTH_LIMIT = 2.0
# (label, env id, constructor kwargs, the tool name its calls use)
ENVS: list[tuple[str, str, dict[str, Any], str]] = [
    ("GSM8K", "agent_gym/GSM8K-v0", {}, "search"),
    ("CodeInterpreter/tool", "agent_gym/CodeInterpreter-v0", {"protocol": "tool"},
     "code_interpreter"),
    ("CodeInterpreter/fenced", "agent_gym/CodeInterpreter-v0", {"protocol": "fenced"},
     "code_interpreter"),
    ("Search/tool", "agent_gym/Search-v0", {"protocol": "tool"}, "search"),
    ("Search/tag", "agent_gym/Search-v0", {"protocol": "tag"}, "search"),
    ("ALFWorld/tool", "agent_gym/ALFWorld-v0", {"protocol": "tool"}, "alfworld_step"),
    ("ALFWorld/text", "agent_gym/ALFWorld-v0", {"protocol": "text"}, "alfworld_step"),
]


def repeated(fragment: str, size: int) -> str:
    return (fragment * (size // len(fragment) + 1))[:size]


def framed(head: str, fragment: str, tail: str, size: int) -> str:
    return head + repeated(fragment, size - len(head) - len(tail)) + tail


def deep_json(size: int) -> str:
    head, tail = "<tool_call>", "</tool_call>"
    depth, pad = divmod(size - len(head) - len(tail), 2)
    return head + "[" * depth + " " * pad + "]" * depth + tail


# Each shape builds an action of exactly `size` characters for a tool named `tool`.
SHAPES: dict[str, Callable[[int, str], str]] = {
    "unclosed \\boxed{": lambda size, tool: repeated("\\boxed{", size),
    "unclosed <parameter=NAME>": lambda size, tool: framed(
        f"<function={tool}>", "<parameter=query>", "</function>", size),
    "unclosed <parameter=": lambda size, tool: framed(
        f"<tool_call><function={tool}>", "<parameter=", "</function></tool_call>", size),
    "deep JSON": lambda size, tool: deep_json(size),
    "repeated fences": lambda size, tool: repeated("```python\nx = 1\n", size),
    "repeated tags": lambda size, tool: repeated(
        "<tool_call><search><answer><function=x><information>", size),
    "answer line of spaces": lambda size, tool: framed("Answer: x", " ", "y", size),
}
PLAIN = "The train leaves at nine and the answer may take some thought. "


def step_seconds(env: gymnasium.Env, action: str) -> tuple[float, float]:
    """(CPU, wall-clock) seconds of one step."""
    cpu, wall = time.thread_time(), time.perf_counter()
    _, _, terminated, truncated, _ = env.step(action)
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    if terminated or truncated:
        env.reset(seed=0)
    return cpu, wall


def measure(env: gymnasium.Env, action: str, plain: str, repeats: int) -> dict[str, float]:
    """Median CPU and wall-clock seconds per step of `action` and of `plain`, stepped turn
    about so that load drift hits both alike."""
    samples: dict[str, list[float]] = {"plain_cpu": [], "plain_wall": [], "cpu": [], "wall": []}
    for _ in range(repeats):
        for prefix, text in (("plain_", plain), ("", action)):
            cpu, wall = step_seconds(env, text)
            samples[f"{prefix}cpu"].append(cpu)
            samples[f"{prefix}wall"].append(wall)
    return {key: statistics.median(values) for key, values in samples.items()}


def bench_env(label: str, env_id: str, kwargs: dict[str, Any], tool: str,
              budget: float) -> list[dict[str, Any]]:
    env = gymnasium.make(env_id, max_turns=100_000, **kwargs)
    env.reset(seed=0)
    cases = []
    try:
        for shape, build in SHAPES.items():
            case: dict[str, Any] = {"env": label, "shape": shape, "plain_cpu_ms": {},
                                    "degenerate_cpu_ms": {}, "ratio": {}, "wall_ratio": {}}
            previous: tuple[int, float] | None = None
            for size in SIZES:
                if previous is not None and previous[1] * (size / previous[0]) ** 2 > budget:
                    case["skipped"] = (f"{size} chars: {previous[1]:.2f} s at {previous[0]} "
                                       f"would be over {budget:g} s if quadratic")
                    break
                degenerate, plain = build(size, tool), repeated(PLAIN, size)
                assert len(degenerate) == len(plain) == size, (shape, len(degenerate))
                m = measure(env, degenerate, plain, REPEATS[size])
                case["plain_cpu_ms"][size] = round(m["plain_cpu"] * 1000, 4)
                case["degenerate_cpu_ms"][size] = round(m["cpu"] * 1000, 4)
                case["ratio"][size] = round(m["cpu"] / m["plain_cpu"], 3)
                case["wall_ratio"][size] = round(m["wall"] / m["plain_wall"], 3)
                previous = (size, m["wall"])
            ratios = case["ratio"]
            if "skipped" in case:
                case["growth"], case["within_limit"] = None, False
            else:
                case["growth"] = round(ratios[SIZES[-1]] / ratios[SIZES[0]], 3)
                case["within_limit"] = case["growth"] <= GROWTH_LIMIT
            cases.append(case)
            print(_row(case), flush=True)
    finally:
        env.close()
    return cases


def _row(case: dict[str, Any]) -> str:
    ratios = " ".join(f"{case['ratio'].get(s, float('nan')):8.2f}" for s in SIZES)
    growth = "skipped" if case["growth"] is None else f"{case['growth']:.2f}"
    verdict = "ok" if case["within_limit"] else "FAIL"
    return f"{case['env']:24} {case['shape']:27} {ratios}   {growth:>7} {verdict}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "parsers.json")
    parser.add_argument("--budget", type=float, default=30.0,
                        help="seconds a single step may be expected to take")
    parser.add_argument("--env", action="append", help="only these env labels")
    args = parser.parse_args()
    record = Result()
    results: dict[str, Any] = record.figures
    results |= {
        "sizes_chars": list(SIZES), "plain_action": PLAIN,
        "check": f"ratio(degenerate / plain step CPU time) at {SIZES[-1]} chars within "
                 f"{GROWTH_LIMIT:g}x of the ratio at {SIZES[0]} chars",
    }
    print(f"{'env':24} {'degenerate action':27} " + " ".join(f"{s:>8}" for s in SIZES)
          + "   growth")
    cases = []
    for label, env_id, kwargs, tool in ENVS:
        if args.env is None or label in args.env:
            cases.extend(bench_env(label, env_id, kwargs, tool, args.budget))
    results["cases"] = cases
    results["failures"] = [f"{c['env']}: {c['shape']}" for c in cases if not c["within_limit"]]
    record.write(args.out)
    print(f"{len(cases) - len(results['failures'])}/{len(cases)} cases within "
          f"{GROWTH_LIMIT:g}x; results in {args.out}")


if __name__ == "__main__":
    main()
