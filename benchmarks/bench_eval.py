"""Eval throughput against a loopback OpenAI-compatible server with a fixed reply delay.

GSM8K-v0 (one reply per episode) and Search-v0 (a native ``search`` tool call, then an
answer: two replies), each at concurrency 1/4/8/32, reported as the ratio to the
sequential run of the same env measured in the same process. The server sleeps DELAY
seconds per reply, standing in for model latency, so the ratio shows how well env work,
HTTP and logging overlap; ideal is the concurrency itself.

The server runs in its own process, as a model server would (in this one it would share
the GIL with the eval loop it is meant to measure), and is checked first: one request alone
must take about DELAY and a burst of concurrent bare requests about ``rounds x DELAY``, or
the server, not eval, is the limit. Each env is warmed up at the highest concurrency first
(math-verify helper processes, imports, the thread pool), so no level pays one-off costs.

``cpu_ms_per_episode`` is the eval process's own CPU time per episode (load-independent,
unlike wall time): with one core's worth of GIL, ``sequential s/episode / cpu s/episode``
bounds the speedup any concurrency can reach, whatever else runs on the machine.

    .venv/bin/python benchmarks/bench_eval.py [--episodes 256] [--sequential-episodes 48]
        [--delay 0.1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_gym.eval import EvalConfig, evaluate
from agent_gym.policies import OpenAIChatPolicy
from tests.helpers.openai_server import Behaviour, ChatServer

ENVS = ("agent_gym/GSM8K-v0", "agent_gym/Search-v0")
LEVELS = (1, 4, 8, 32)


def scripted_reply(body: dict[str, Any]) -> dict[str, Any]:
    """A boxed answer where no tools are offered (GSM8K); with tools (Search), a search
    call first and an answer once the chat holds its result."""
    if not body.get("tools"):
        return {"content": "I think the answer is \\boxed{42}."}
    if any(message["role"] == "tool" for message in body["messages"]):
        return {"content": "<answer>1066</answer>"}
    query = json.dumps({"query": body["messages"][-1]["content"][:200]})
    return {"content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "search", "arguments": query}}
    ]}


def serve(delay: float, urls: Any, stop: Any) -> None:
    """The loopback server's process: serve until ``stop`` is set."""
    with ChatServer(Behaviour(reply=scripted_reply, delay=delay)) as server:
        urls.put(server.url)
        stop.wait()


async def check_server(url: str, concurrency: int, rounds: int) -> tuple[float, float]:
    """Mean latency of one bare request alone, and wall time of ``rounds`` bursts of
    ``concurrency`` concurrent ones (connections opened outside the clock)."""
    body = {"model": "bench", "messages": [{"role": "user", "content": "hi"}]}
    # One client per concurrent request: one httpx pool of many connections is itself slow
    # (see OpenAIChatPolicy), and this checks the server, not the client.
    clients = [httpx.AsyncClient(base_url=url, timeout=30) for _ in range(concurrency)]
    async with contextlib.AsyncExitStack() as stack:
        for client in clients:
            await stack.enter_async_context(client)

        async def burst() -> None:
            replies = await asyncio.gather(
                *(client.post("/chat/completions", json=body) for client in clients)
            )
            assert all(reply.status_code == 200 for reply in replies)

        await burst()
        started = time.perf_counter()
        for _ in range(rounds):
            await clients[0].post("/chat/completions", json=body)
        alone = (time.perf_counter() - started) / rounds
        started = time.perf_counter()
        for _ in range(rounds):
            await burst()
        return alone, time.perf_counter() - started


def run_eval(env_id: str, url: str, episodes: int, concurrency: int) -> dict[str, float]:
    """One timed eval run into a fresh directory: throughput and own CPU per episode."""
    policy = OpenAIChatPolicy("bench", url)
    config = EvalConfig(env_id, "openai:bench", episodes)
    with tempfile.TemporaryDirectory() as out:
        cpu, started = time.process_time(), time.perf_counter()
        summary = asyncio.run(evaluate(config, policy, Path(out), concurrency=concurrency,
                                       progress=False))
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    if summary.episodes != episodes or summary.errors:
        raise RuntimeError(f"{env_id} at concurrency {concurrency}: {summary}")
    return {"episodes": episodes, "episodes_per_s": episodes / wall,
            "cpu_ms_per_episode": 1000 * cpu / episodes, "turns": summary.mean_turns or 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=256, help="per concurrent level")
    parser.add_argument("--sequential-episodes", type=int, default=48)
    parser.add_argument("--delay", type=float, default=0.1)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    urls, stop = context.Queue(), context.Event()
    server = context.Process(target=serve, args=(args.delay, urls, stop), daemon=True)
    server.start()
    load_before = os.getloadavg()
    try:
        url = urls.get(timeout=60)
        rounds = 4
        alone, burst = asyncio.run(check_server(url, max(LEVELS), rounds))
        report: dict[str, Any] = {
            "command": " ".join(["benchmarks/bench_eval.py", *sys.argv[1:]]),
            "server_delay_s": args.delay,
            "server_check": {
                "one_request_s": round(alone, 4),
                "concurrent_requests": max(LEVELS), "rounds": rounds,
                "wall_s": round(burst, 3), "ideal_s": rounds * args.delay,
            },
            "envs": {},
        }
        for env_id in ENVS:
            run_eval(env_id, url, 2 * max(LEVELS), max(LEVELS))  # warm-up, not reported
            levels = {}
            for concurrency in LEVELS:
                episodes = args.sequential_episodes if concurrency == 1 else args.episodes
                levels[concurrency] = run_eval(env_id, url, episodes, concurrency)
            base = levels[1]
            report["envs"][env_id] = {
                f"c{c}": {
                    "episodes": r["episodes"],
                    "episodes_per_s": round(r["episodes_per_s"], 2),
                    "speedup_vs_sequential": round(r["episodes_per_s"] / base["episodes_per_s"],
                                                   2),
                    "cpu_ms_per_episode": round(r["cpu_ms_per_episode"], 2),
                    "cpu_bound_limit": round(
                        1000 / base["episodes_per_s"] / r["cpu_ms_per_episode"], 1
                    ),
                } for c, r in levels.items()
            }
            report["envs"][env_id]["turns_per_episode"] = base["turns"]
        report["load_average"] = {"before": [round(x, 2) for x in load_before],
                                  "after": [round(x, 2) for x in os.getloadavg()]}
    finally:
        stop.set()
        server.join(timeout=10)
        if server.is_alive():
            server.kill()
    out_path = Path(__file__).parent / "results" / "eval.json"
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
