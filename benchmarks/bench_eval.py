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

Each level runs ``--repeats`` times, interleaved, and the median run is reported (with
every run's speedup). ``cpu_ms_per_episode`` is the eval process's own CPU time per episode
(load-independent, unlike wall time): with one core's worth of GIL, ``sequential
s/episode / cpu s/episode`` (``cpu_bound_limit``) bounds the speedup any concurrency can
reach. ``c32_share_of_bare_client`` is eval's request rate at concurrency 32 over a bare
client's against the same server in the same run: on a loaded machine the server and its
clients slow down together, and this ratio separates what eval itself costs.

    .venv/bin/python benchmarks/bench_eval.py [--episodes 256] [--sequential-episodes 48]
        [--delay 0.1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import RESULTS, Result

from agent_gym.eval.config import EvalConfig
from agent_gym.eval.policies import OpenAIChatPolicy
from agent_gym.eval.run import evaluate
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


def median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run of median throughput (the machine is shared: one run can be unlucky)."""
    return sorted(runs, key=lambda r: r["episodes_per_s"])[len(runs) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=256, help="per concurrent level")
    parser.add_argument("--sequential-episodes", type=int, default=48)
    parser.add_argument("--delay", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=3, help="runs per level; the median")
    args = parser.parse_args()
    harness = Result()
    context = multiprocessing.get_context("spawn")
    urls, stop = context.Queue(), context.Event()
    server = context.Process(target=serve, args=(args.delay, urls, stop), daemon=True)
    server.start()
    top = max(LEVELS)
    try:
        url = urls.get(timeout=60)
        rounds = 4
        alone, burst = asyncio.run(check_server(url, top, rounds))
        report: dict[str, Any] = harness.figures
        report.update({
            "server_delay_s": args.delay,
            "server_check": {
                "one_request_s": round(alone, 4),
                "concurrent_requests": top, "rounds": rounds,
                "wall_s": round(burst, 3), "ideal_s": rounds * args.delay,
                "requests_per_s": round(top * rounds / burst, 1),
            },
            "envs": {},
        })
        for env_id in ENVS:
            run_eval(env_id, url, 2 * top, top)  # warm-up, not reported
            runs: dict[int, list[dict[str, float]]] = {c: [] for c in LEVELS}
            bare = []  # a bare client's requests/s, measured next to each top-level run
            for _ in range(args.repeats):  # levels interleaved, so load drifts hit all
                for concurrency in LEVELS:
                    episodes = args.sequential_episodes if concurrency == 1 else args.episodes
                    if concurrency == top:
                        bare.append(top * rounds / asyncio.run(check_server(url, top, rounds))[1])
                    runs[concurrency].append(run_eval(env_id, url, episodes, concurrency))
            bare_rps = sorted(bare)[len(bare) // 2]
            levels = {c: median_run(r) for c, r in runs.items()}
            base = levels[1]
            result: dict[str, Any] = {
                f"c{c}": {
                    "episodes": r["episodes"],
                    "episodes_per_s": round(r["episodes_per_s"], 2),
                    "speedup_vs_sequential": round(r["episodes_per_s"] / base["episodes_per_s"],
                                                   2),
                    "all_speedups": [round(x["episodes_per_s"] / base["episodes_per_s"], 2)
                                     for x in runs[c]],
                    "cpu_ms_per_episode": round(r["cpu_ms_per_episode"], 2),
                    "cpu_bound_limit": round(
                        1000 / base["episodes_per_s"] / r["cpu_ms_per_episode"], 1
                    ),
                } for c, r in levels.items()
            }
            result["turns_per_episode"] = base["turns"]
            result[f"bare_client_c{top}_requests_per_s"] = round(bare_rps, 1)
            # Eval's request rate at the top level over a bare client's at the same
            # concurrency: how much of what this server gives at this moment eval gets.
            result[f"c{top}_share_of_bare_client"] = round(
                levels[top]["episodes_per_s"] * base["turns"] / bare_rps, 2
            )
            report["envs"][env_id] = result
    finally:
        stop.set()
        server.join(timeout=10)
        if server.is_alive():
            server.kill()
    harness.write(RESULTS / "eval.json")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
