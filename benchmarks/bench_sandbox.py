"""Sandbox speed: per-call latency and throughput of each mode next to a plain subprocess.

Modes, all running ``print(1 + 1)``:

- ``plain``: the unisolated baseline, ``subprocess.run([python, "-S", "-c", code])`` with
  captured output, measured in the same run;
- ``forkserver``: stateless calls as they run by default, each a freshly forked and fully
  isolated child of a warm sandboxed interpreter (for this code, which names no math
  module, the lean fork-server: the standard library imported);
- ``per-call``: a fresh bwrap sandbox and interpreter per call (``forkserver=False``);
- ``pooled``: per-call sandboxes pre-started by a pool of 4;
- ``stateful``: one persistent sandboxed interpreter per client (a notebook).

Two phases per mode and concurrency (1, 2, 4 client threads):

- latency: each client makes calls with a 50 ms pause between them, as an agent does while
  the model generates; p50/p99 of the call time;
- throughput: clients call back to back for a fixed time; calls per second.

Ratios are against ``plain`` at the same concurrency; ``forkserver_targets`` says whether
the fork-server met issue 19's bar (p50 <= 0.3x, throughput >= 2x plain at every level).

A second table, ``math_results``, runs a cell that uses the math stack
(``MATH_CODE``: sympy) in ``plain`` (with site-packages, so the import is paid per call) and
``forkserver`` (the math fork-server, where sympy is already imported), with fewer paced
calls because a plain call takes most of a second.
The load average is recorded because the host is shared. Writes
``benchmarks/results/sandbox.json`` and prints a table. Takes about a minute.

    python benchmarks/bench_sandbox.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from harness import RESULTS, Result

from agent_gym.sandbox import Limits, StatefulSandbox, open_sandbox

CODE = "print(1 + 1)"
MATH_CODE = "import sympy\nprint(sympy.factorint(2**32 + 1))"
EXPECTED = {CODE: "2\n", MATH_CODE: "{641: 1, 6700417: 1}\n"}
Call = Callable[[], None]


def _plain(code: str = CODE) -> Call:
    flags = ["-S"] if code == CODE else []  # the math cell needs site-packages

    def run() -> None:
        out = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True)
        assert out.stdout == EXPECTED[code], out

    return run


def _checked(run: Callable[[str], Any], code: str = CODE) -> Call:
    def call() -> None:
        result = run(code)
        assert result.stdout == EXPECTED[code], result.observation()

    return call


def _rows(figures: dict[str, dict[str, float]], concurrency: int) -> list[dict[str, Any]]:
    base = figures["plain"]
    return [
        {
            "mode": mode,
            "concurrency": concurrency,
            **figure,
            "p50_vs_plain": round(figure["p50_ms"] / base["p50_ms"], 3),
            "throughput_vs_plain": round(figure["throughput_per_s"] / base["throughput_per_s"], 2),
        }
        for mode, figure in figures.items()
    ]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _clients(calls: list[Call], body: Callable[[Call, list[float]], None]) -> list[float]:
    latencies: list[list[float]] = [[] for _ in calls]
    threads = [
        threading.Thread(target=body, args=(call, out))
        for call, out in zip(calls, latencies, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [x for out in latencies for x in out]


def measure(calls: list[Call], paced: int, seconds: float) -> dict[str, float]:
    """Latency with pauses between calls, then back-to-back throughput."""

    def pace(call: Call, out: list[float]) -> None:
        for _ in range(paced):
            start = time.perf_counter()
            call()
            out.append(time.perf_counter() - start)
            time.sleep(0.05)

    latencies = _clients(calls, pace)
    counts: list[int] = []
    stop = time.perf_counter() + seconds

    def flood(call: Call, out: list[float]) -> None:
        n = 0
        while time.perf_counter() < stop:
            call()
            n += 1
        counts.append(n)

    start = time.perf_counter()
    _clients(calls, flood)
    elapsed = time.perf_counter() - start
    return {
        "p50_ms": round(1000 * _percentile(latencies, 0.5), 2),
        "p99_ms": round(1000 * _percentile(latencies, 0.99), 2),
        "latency_samples": len(latencies),
        "throughput_per_s": round(sum(counts) / elapsed, 1),
    }


def _targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 19's bar for the fork-server: p50 <= 0.3x and throughput >= 2x plain, per level."""
    forked = [row for row in rows if row["mode"] == "forkserver"]
    return {
        "p50_at_most_0.3x_plain": all(row["p50_vs_plain"] <= 0.3 for row in forked),
        "throughput_at_least_2x_plain": all(row["throughput_vs_plain"] >= 2.0 for row in forked),
        "by_concurrency": {
            row["concurrency"]: [row["p50_vs_plain"], row["throughput_vs_plain"]] for row in forked
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls (a smoke run)")
    args = parser.parse_args()
    record = Result()
    paced, seconds = (5, 0.5) if args.quick else (25, 2.0)
    limits = Limits(timeout=10.0)
    forked = open_sandbox("stateless", limits=limits, forkserver=True)
    stateless = open_sandbox("stateless", limits=limits, forkserver=False)
    pooled = open_sandbox("stateless", limits=limits, pool_size=4, forkserver=False)
    notebooks = [open_sandbox("stateful", limits=limits) for _ in range(4)]
    rows: list[dict[str, Any]] = []
    math_rows: list[dict[str, Any]] = []
    try:
        for notebook in notebooks:  # start the interpreters before timing
            notebook.run("pass")
        time.sleep(0.5)  # let the pool fill
        for concurrency in (1, 2, 4):
            modes: dict[str, list[Call]] = {
                "plain": [_plain() for _ in range(concurrency)],
                "forkserver": [_checked(forked.run) for _ in range(concurrency)],
                "per-call": [_checked(stateless.run) for _ in range(concurrency)],
                "pooled": [_checked(pooled.run) for _ in range(concurrency)],
                "stateful": [_checked(nb.run) for nb in notebooks[:concurrency]],
            }
            figures = {mode: measure(calls, paced, seconds) for mode, calls in modes.items()}
            rows += _rows(figures, concurrency)
        forked.run(MATH_CODE)  # start the math fork-server before timing
        for concurrency in (1, 2, 4):
            math_modes = {
                "plain": [_plain(MATH_CODE) for _ in range(concurrency)],
                "forkserver": [_checked(forked.run, MATH_CODE) for _ in range(concurrency)],
            }
            figures = {
                mode: measure(calls, max(2, paced // 5), seconds)
                for mode, calls in math_modes.items()
            }
            math_rows += _rows(figures, concurrency)
    finally:
        forked.close()
        stateless.close()
        pooled.close()
        for notebook in notebooks:
            assert isinstance(notebook, StatefulSandbox)
            notebook.close()
    report = record.figures
    report |= {
        "benchmark": "sandbox",
        "workload": CODE,
        "isolation": stateless.isolation,
        "memory_bound": stateless.memory_bound,
        "method": "latency: clients pause 50 ms between calls; throughput: back to back for "
        f"{seconds} s; ratios against the plain subprocess at the same concurrency",
        "results": rows,
        "forkserver_targets": _targets(rows),
        "math_workload": MATH_CODE,
        "math_results": math_rows,
    }
    if not args.quick:
        record.write(RESULTS / "sandbox.json")
    header = (
        f"{'mode':<11}{'conc':>5}{'p50 ms':>9}{'p99 ms':>9}{'calls/s':>9}{'p50 x':>8}{'tput x':>8}"
    )
    print(f"load average {record.load_at_start:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    for title, table in ((CODE, rows), (MATH_CODE.replace("\n", "; "), math_rows)):
        print(title)
        print(header)
        for row in table:
            print(
                f"{row['mode']:<11}{row['concurrency']:>5}{row['p50_ms']:>9}{row['p99_ms']:>9}"
                f"{row['throughput_per_s']:>9}{row['p50_vs_plain']:>8}"
                f"{row['throughput_vs_plain']:>8}"
            )


if __name__ == "__main__":
    main()
