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

Then whether one client can stall the server for everyone ("health_under_mixed_steps"):
the p50/p95 of ``GET /health``, polled every 10 ms, first while the server is idle and then
while one WebSocket client plays three quick steps and one slow one, over and over. The
env is Search-v0 (whose steps all run in process) with slow steps of two kinds, each taking
SLOW_STEP_S: one that waits (as a step does on a sandbox, a remote backend or a helper
process) and one that computes in Python (as a search of an index far larger than the
bundled one does), the harder case, since the thread running it holds the GIL and a core.
The goal is a loaded p95 within 2x the idle one.

    .venv/bin/python benchmarks/bench_serve.py [--steps 960] [--rate 400]
        [--section throughput --section capacity --section health]

A run of some sections keeps the other sections' figures from benchmarks/results/serve.json.
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

from harness import RESULTS, Result, figures_in

import agent_gym  # noqa: F401  (registers the envs)
from agent_gym.envs.search import SearchEnv
from agent_gym.serve.sessions import DEFAULT_MAX_SESSIONS
from tests.helpers.serve_process import ROOT, frame, running_server

SECTIONS = ("throughput", "capacity", "health")
SLOW_ENV_ID = "bench/SlowSearch-v0"
SLOW_STEP_S = 0.3
HEALTH_PROBES = 300

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


class SlowSearchEnv(SearchEnv):
    """Search-v0 whose actions starting "waits" or "computes" first wait, or compute in
    Python, for SLOW_STEP_S. Registered when the server imports this module
    (``--import bench_serve``)."""

    def step(self, action: str) -> Any:
        if action.startswith("waits"):
            time.sleep(SLOW_STEP_S)
        elif action.startswith("computes"):
            deadline = time.perf_counter() + SLOW_STEP_S
            while time.perf_counter() < deadline:
                pass
        return super().step(action)


if SLOW_ENV_ID not in gymnasium.registry:
    gymnasium.register(SLOW_ENV_ID, entry_point=SlowSearchEnv, disable_env_checker=True)


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


def percentiles(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {"probes": len(ordered), "p50_ms": round(1000 * statistics.median(ordered), 3),
            "p95_ms": round(1000 * ordered[int(0.95 * (len(ordered) - 1))], 3)}


async def probe_health(url: str, probes: int) -> dict[str, float]:
    """``GET /health`` ``probes`` times, 10 ms apart, on one keep-alive connection."""
    import httpx

    latencies = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for _ in range(probes):
            started = time.perf_counter()
            reply = await http.get("/health")
            latencies.append(time.perf_counter() - started)
            assert reply.status_code == 200
            await asyncio.sleep(0.01)
    return percentiles(latencies)


async def health_while_mixing(url: str, probes: int, slow: str) -> dict[str, Any]:
    """/health while one client loops over three quick steps and a ``slow`` one."""
    from websockets.asyncio.client import connect

    steps: dict[str, list[float]] = {"quick": [], slow: []}
    stop = asyncio.Event()

    async def mix() -> None:
        async with connect(url.replace("http", "ws") + "/ws", compression=None) as ws:
            await ws.send(frame("reset", {"index": 0}))
            assert json.loads(await ws.recv())["type"] == "observation"
            turn = 0
            while not stop.is_set():
                kind = slow if turn % 4 == 3 else "quick"
                started = time.perf_counter()
                await ws.send(frame("step", {"text": f"{kind}: let me think"}))
                reply = json.loads(await ws.recv())
                steps[kind].append(time.perf_counter() - started)
                assert reply["type"] == "observation", reply
                turn += 1

    client = asyncio.create_task(mix())
    await asyncio.sleep(1.0)  # into the rhythm: a slow step has run at least once
    loaded = await probe_health(url, probes)
    stop.set()
    await client
    return {**loaded, "quick_steps": len(steps["quick"]), "slow_steps": len(steps[slow]),
            "slow_step_p50_ms": round(1000 * statistics.median(steps[slow]), 1)}


async def health_under_mixed_steps(url: str, probes: int) -> dict[str, Any]:
    """/health idle, then under each kind of slow step, in one run on one server."""
    idle = await probe_health(url, probes)
    report: dict[str, Any] = {
        "env": f"{SLOW_ENV_ID}: Search-v0 whose actions starting 'waits' or 'computes' "
               f"first wait, or compute in Python, for {SLOW_STEP_S} s",
        "pattern": "one WebSocket client: 3 quick steps, 1 slow step, repeated",
        "goal": "loaded p95 within 2x of idle",
        "idle": idle,
    }
    for slow in ("waits", "computes"):
        loaded = await health_while_mixing(url, probes, slow)
        report[f"slow_step_{slow}"] = {
            **loaded, "p95_over_idle_p95": round(loaded["p95_ms"] / idle["p95_ms"], 2)}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=960, help="steps per measurement")
    parser.add_argument("--rate", type=int, default=400,
                        help="steps/s all sessions offer together in the paced runs")
    parser.add_argument("--section", action="append", choices=SECTIONS,
                        help="run only this section (repeatable; default: all)")
    args = parser.parse_args()
    sections = args.section or SECTIONS
    record = Result()
    report: dict[str, Any] = record.figures
    if set(sections) != set(SECTIONS):
        report |= figures_in(RESULTS / "serve.json")
    if "throughput" in sections:
        report |= {"steps": args.steps, "envs": throughput(args.steps, args.rate)}
    if "capacity" in sections:
        with running_server("agent_gym/GSM8K-v0") as url:
            report["sessions_held_before_refusing"] = asyncio.run(capacity(url))
            report["default_max_sessions"] = DEFAULT_MAX_SESSIONS
    if "health" in sections:
        pythonpath = f"{ROOT}:{ROOT / 'benchmarks'}"
        with running_server(SLOW_ENV_ID, "--import", "bench_serve", "--env-arg",
                            "max_turns=1000000", env={"PYTHONPATH": pythonpath}) as url:
            report["health_under_mixed_steps"] = asyncio.run(
                health_under_mixed_steps(url, HEALTH_PROBES))
        print(json.dumps(report["health_under_mixed_steps"]), flush=True)
    record.write(RESULTS / "serve.json")
    print(json.dumps(report, indent=2))


def throughput(steps: int, rate: int) -> dict[str, Any]:
    """Steps/s and latency through the server next to in-process envs, per env."""
    envs: dict[str, Any] = {}
    for env_id, kwargs in ENVS.items():
        env_args = [part for key, value in kwargs.items()
                    for part in ("--env-arg", f"{key}={json.dumps(value)}")]
        rows: dict[str, Any] = {}
        with running_server(env_id, *env_args, "--max-sessions", "80") as url:
            for sessions in SESSIONS:
                # Closed loop (each session steps again as soon as it is answered): the
                # most steps/s; at many sessions its latency is mostly queueing for the cores.
                local = asyncio.run(in_process(env_id, sessions, steps))
                remote = asyncio.run(served(url, env_id, sessions, steps))
                # Paced (sessions together offer rate steps/s, as a trainer whose
                # model thinks between steps does): the latency one step adds.
                pace = sessions / rate
                paced_local = asyncio.run(in_process(env_id, sessions, steps // 2, pace))
                paced_remote = asyncio.run(served(url, env_id, sessions, steps // 2, pace))
                rows[f"{sessions}_sessions"] = {
                    "closed_loop": {
                        "in_process": local, "websocket": remote,
                        "added_p50_ms": round(remote["p50_ms"] - local["p50_ms"], 3),
                        "throughput_ratio": round(remote["steps_per_s"] / local["steps_per_s"],
                                                  3),
                    },
                    f"paced_{rate}_steps_per_s": {
                        "in_process": paced_local, "websocket": paced_remote,
                        "added_p50_ms": round(paced_remote["p50_ms"] - paced_local["p50_ms"], 3),
                    },
                }
                print(env_id, sessions, json.dumps(rows[f"{sessions}_sessions"]), flush=True)
        envs[env_id] = rows
    return envs


if __name__ == "__main__":
    main()
