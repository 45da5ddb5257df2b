"""`agent-gym serve` over WebSocket vs in-process `env.step`, measured in the same run.

For GSM8K-v0 (a step that does almost nothing, so the figure is the server's own cost) and
Search-v0 (a BM25 search per step), with 1, 16 and 64 concurrent sessions: steps/s and
p50/p99 step latency through the server, next to the same steps on in-process envs stepped
from as many threads (how eval and the trainers step local envs). "added_p50_ms" is the
server's p50 minus the in-process p50 at the same concurrency, both closed-loop (as fast as
answers come: the throughput, and at 64 sessions mostly queueing) and paced (the sessions
together offer a fixed rate, as trainers whose model thinks between steps do: the latency a
step through the server adds). Then the number of sessions
the server holds (default limit) before it refuses one. The server and the clients share
this machine's cores, so the figures include the client's own cost. To show where a served
step's time goes, each run also gives the CPU time per step of this (client) process and,
for served runs, of the server process ("client_cpu_ms", "server_cpu_ms"; Linux /proc).

    .venv/bin/python benchmarks/bench_serve.py [--steps 960] [--rate 400]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import RESULTS, Result

import agent_gym  # noqa: F401  (registers the envs)
from agent_gym.serve.sessions import DEFAULT_MAX_SESSIONS
from tests.helpers.serve_process import frame, running_server

SESSIONS = (1, 16, 64)
ENVS: dict[str, dict[str, Any]] = {
    # Budgets large enough that no episode ends during the measurement.
    "agent_gym/GSM8K-v0": {"max_turns": 100_000},
    "agent_gym/Search-v0": {"max_turns": 100_000, "max_searches": 100_000},
}
ACTIONS = {
    "agent_gym/GSM8K-v0": "Let me think about it step by step first.",
    "agent_gym/Search-v0": '<tool_call>\n{"name": "search", "arguments": {"query": '
                           '"when was the town founded"}}\n</tool_call>',
}


def summary(latencies: list[float], elapsed: float, client_cpu_s: float) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "steps_per_s": round(len(ordered) / elapsed, 1),
        "p50_ms": round(1000 * statistics.median(ordered), 3),
        "p99_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3),
        "client_cpu_ms": round(1000 * client_cpu_s / len(ordered), 3),
    }


def server_cpu_s() -> float:
    """CPU seconds (user + system, every thread) used so far by this process's children:
    the one server running at a time."""
    total = 0.0
    for task in Path("/proc/self/task").iterdir():
        for pid in (task / "children").read_text().split():
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


async def in_process(env_id: str, sessions: int, steps: int, pace_s: float = 0.0
                     ) -> dict[str, float]:
    envs = [gymnasium.make(env_id, **ENVS[env_id]) for _ in range(sessions)]
    for index, env in enumerate(envs):
        env.reset(options={"index": index % 20})
    latencies: list[float] = []

    async def drive(env: gymnasium.Env) -> None:
        pacing = random.Random(id(env))
        for _ in range(steps // sessions):
            if pace_s:
                await asyncio.sleep(pacing.uniform(0, 2 * pace_s))
            started = time.perf_counter()
            await asyncio.to_thread(env.step, ACTIONS[env_id])
            latencies.append(time.perf_counter() - started)

    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(drive(env) for env in envs))
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    for env in envs:
        env.close()
    return summary(latencies, elapsed, cpu)


async def served(url: str, env_id: str, sessions: int, steps: int, pace_s: float = 0.0
                 ) -> dict[str, float]:
    from websockets.asyncio.client import connect

    sockets = [await connect(url.replace("http", "ws") + "/ws", compression=None)
               for _ in range(sessions)]
    for index, ws in enumerate(sockets):
        await ws.send(frame("reset", {"index": index % 20}))
        assert json.loads(await ws.recv())["type"] == "observation"
    latencies: list[float] = []
    step = frame("step", {"text": ACTIONS[env_id]})

    async def drive(ws: Any) -> None:
        pacing = random.Random(id(ws))
        for _ in range(steps // sessions):
            if pace_s:
                await asyncio.sleep(pacing.uniform(0, 2 * pace_s))
            started = time.perf_counter()
            await ws.send(step)
            reply = await ws.recv()
            latencies.append(time.perf_counter() - started)
            assert reply.startswith('{"type": "observation"')

    started, cpu, on_server = time.perf_counter(), time.process_time(), server_cpu_s()
    await asyncio.gather(*(drive(ws) for ws in sockets))
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    on_server = server_cpu_s() - on_server
    for ws in sockets:
        await ws.close()
    return {**summary(latencies, elapsed, cpu),
            "server_cpu_ms": round(1000 * on_server / len(latencies), 3)}


async def capacity(url: str) -> int:
    """Open sessions until the server refuses one; the count it held."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    sockets = []
    try:
        while len(sockets) <= 4 * DEFAULT_MAX_SESSIONS:
            ws = await connect(url.replace("http", "ws") + "/ws")
            sockets.append(ws)
            with contextlib.suppress(ConnectionClosed):  # a refused one is closed at once
                await ws.send(frame("state"))
            reply = json.loads(await ws.recv())
            if reply["type"] == "error":
                assert reply["data"]["code"] == "CAPACITY_REACHED"
                return len(sockets) - 1
        raise RuntimeError("the server never refused a session")
    finally:
        for ws in sockets:
            await ws.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=960, help="steps per measurement")
    parser.add_argument("--rate", type=int, default=400,
                        help="steps/s all sessions offer together in the paced runs")
    args = parser.parse_args()
    record = Result()
    report: dict[str, Any] = record.figures
    report |= {"steps": args.steps, "envs": {}}
    for env_id, kwargs in ENVS.items():
        env_args = [part for key, value in kwargs.items()
                    for part in ("--env-arg", f"{key}={json.dumps(value)}")]
        rows: dict[str, Any] = {}
        with running_server(env_id, *env_args, "--max-sessions", "80") as url:
            for sessions in SESSIONS:
                # Closed loop (each session steps again as soon as it is answered): the
                # most steps/s; at many sessions its latency is mostly queueing for the cores.
                local = asyncio.run(in_process(env_id, sessions, args.steps))
                remote = asyncio.run(served(url, env_id, sessions, args.steps))
                # Paced (sessions together offer args.rate steps/s, as a trainer whose
                # model thinks between steps does): the latency one step adds.
                pace = sessions / args.rate
                paced_local = asyncio.run(in_process(env_id, sessions, args.steps // 2, pace))
                paced_remote = asyncio.run(served(url, env_id, sessions, args.steps // 2, pace))
                rows[f"{sessions}_sessions"] = {
                    "closed_loop": {
                        "in_process": local, "websocket": remote,
                        "added_p50_ms": round(remote["p50_ms"] - local["p50_ms"], 3),
                        "throughput_ratio": round(remote["steps_per_s"] / local["steps_per_s"],
                                                  3),
                    },
                    f"paced_{args.rate}_steps_per_s": {
                        "in_process": paced_local, "websocket": paced_remote,
                        "added_p50_ms": round(paced_remote["p50_ms"] - paced_local["p50_ms"], 3),
                    },
                }
                print(env_id, sessions, json.dumps(rows[f"{sessions}_sessions"]), flush=True)
        report["envs"][env_id] = rows
    with running_server("agent_gym/GSM8K-v0") as url:
        report["sessions_held_before_refusing"] = asyncio.run(capacity(url))
        report["default_max_sessions"] = DEFAULT_MAX_SESSIONS
    record.write(RESULTS / "serve.json")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
