"""Eval throughput against a loopback OpenAI-compatible server with a fixed reply delay.

Concurrency 1/4/8, each reported as the ratio to the sequential run measured in the same
process. The server sleeps DELAY seconds per reply, standing in for model latency, so the
ratio shows how well env work and policy calls overlap.

    .venv/bin/python benchmarks/bench_eval.py [--episodes 32] [--delay 0.1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_gym.eval import EvalConfig, evaluate
from agent_gym.policies import OpenAIChatPolicy
from tests.helpers.openai_server import Behaviour, ChatServer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--delay", type=float, default=0.1)
    args = parser.parse_args()
    results: dict[str, float] = {}
    with ChatServer(Behaviour(delay=args.delay)) as server:
        for concurrency in (1, 4, 8):
            policy = OpenAIChatPolicy("bench", server.url)
            config = EvalConfig("agent_gym/GSM8K-v0", "openai:bench", args.episodes)
            with tempfile.TemporaryDirectory() as out:
                started = time.perf_counter()
                asyncio.run(evaluate(config, policy, Path(out), concurrency=concurrency,
                                     progress=False))
                results[f"c{concurrency}"] = args.episodes / (time.perf_counter() - started)
    report = {
        "episodes": args.episodes,
        "server_delay_s": args.delay,
        "episodes_per_s": {k: round(v, 2) for k, v in results.items()},
        "speedup_vs_sequential": {k: round(v / results["c1"], 2) for k, v in results.items()},
    }
    out_path = Path(__file__).parent / "results" / "eval.json"
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
