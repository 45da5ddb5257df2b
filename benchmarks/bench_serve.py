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

Then how many paced sessions one server core holds ("sessions"): 16, 256 and 1,000
concurrent WebSocket sessions of Search-v0, each reset once and then stepping once every
``--pace`` seconds (1 s: a model thinking between replies) at a random phase, from one
asyncio loop in this process. The first round of steps warms up; then each level measures
``--duration`` seconds, longer where it takes that for MIN_SAMPLES steps (16 sessions: 125 s).
The server (``agent-gym serve --max-sessions N``, otherwise its defaults) gets a fresh
process per level, so its memory is that level's. It is pinned to core 0 and this client
to core 1 (``os.sched_setaffinity``; the server's worker threads inherit it), so the figures
are one server core's and the client does not compete with it; other work on the machine
is not pinned and shows in the load average and "machine_busy_percent".
The env is ``bench/TimedSearch-v0``: Search-v0 whose step also puts in its info when it
started and ended, read on CLOCK_MONOTONIC, which every process of the machine shares.
A step's **added latency** is its round trip as this client sees it (frame sent to reply
read) minus the env call itself (that start to that end, in the server's worker thread):
parsing, the session lock, the hand-off to a worker thread and back, encoding the reply,
the event loop's queue on both sides, and loopback TCP. The client's own share is in it
(an upper bound on the server's), so it is split at the env call into "inbound" (sent to
env started) and "outbound" (env ended to reply read), and the client's lag (how late it
sent a step it had scheduled) is given too. Per level: p50/p99 of added, round trip, env
step, inbound and outbound; errors (error frames, timeouts, dropped connections: must be
0); the server's RSS before the sessions and with every session open (and so per session),
its threads and open files, and its CPU (percent of one core) over the measured window; the
client's CPU; the machine's load average and busy share; seconds to open the sessions.

    .venv/bin/python benchmarks/bench_serve.py [--steps 960] [--rate 400]
        [--section throughput --section capacity --section health --section sessions]
        [--levels 16 256 1000] [--pace 1.0] [--duration 20]

A run of some sections keeps the other sections' figures from benchmarks/results/serve.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import RESULTS, Result, figures_in

import agent_gym  # noqa: F401  (registers the envs)
from agent_gym import data
from agent_gym.envs.search import SearchEnv
from agent_gym.serve.sessions import DEFAULT_MAX_SESSIONS
from tests.helpers.serve_process import ROOT, frame, running_server

SECTIONS = ("throughput", "capacity", "health", "sessions")
SLOW_ENV_ID = "bench/SlowSearch-v0"
SLOW_STEP_S = 0.3
HEALTH_PROBES = 300
TIMED_ENV_ID = "bench/TimedSearch-v0"
ENV_CLOCK = "bench_env_clock"
LEVELS = (16, 256, 1000)
MIN_SAMPLES = 2000  # steps measured per level at least (a level of few sessions runs longer)
OPENING = 32  # sessions opened at once
REPLY_TIMEOUT_S = 30.0

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


class TimedSearchEnv(SearchEnv):
    """Search-v0 whose step info also carries ``[started, ended]`` of the step on
    CLOCK_MONOTONIC (``time.monotonic``, the same clock in every process of the machine), so
    a client can take the env's own time out of a round trip. Registered when the server
    imports this module (``--import bench_serve``)."""

    def step(self, action: str) -> Any:
        started = time.monotonic()
        observation, reward, terminated, truncated, info = super().step(action)
        info[ENV_CLOCK] = [started, time.monotonic()]
        return observation, reward, terminated, truncated, info


for bench_id, entry in ((SLOW_ENV_ID, SlowSearchEnv), (TIMED_ENV_ID, TimedSearchEnv)):
    if bench_id not in gymnasium.registry:
        gymnasium.register(bench_id, entry_point=entry, disable_env_checker=True)


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


# --------------------------------------------------------------------- sessions
@dataclass
class Tally:
    """What one level's sessions saw: seconds per measured step, and errors by kind."""

    added: list[float] = field(default_factory=list)
    round_trip: list[float] = field(default_factory=list)
    env_step: list[float] = field(default_factory=list)
    inbound: list[float] = field(default_factory=list)
    outbound: list[float] = field(default_factory=list)
    lag: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)

    def step(self, due: float, sent: float, env: list[float], received: float) -> None:
        started, ended = env
        self.lag.append(sent - due)
        self.round_trip.append(received - sent)
        self.env_step.append(ended - started)
        self.added.append((received - sent) - (ended - started))
        self.inbound.append(started - sent)
        self.outbound.append(received - ended)


def spread_ms(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    if not ordered:
        return {}
    return {"p50": round(1000 * statistics.median(ordered), 3),
            "p99": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3),
            "max": round(1000 * ordered[-1], 3)}


async def open_session(url: str, index: int, gate: asyncio.Semaphore, tally: Tally) -> Any:
    """A WebSocket session reset on task ``index``, or None (the error counted)."""
    from websockets.asyncio.client import connect

    async with gate:
        try:
            ws = await connect(url.replace("http", "ws") + "/ws", compression=None,
                               open_timeout=REPLY_TIMEOUT_S)
        except Exception as exc:  # any failure to open is one error of its kind
            tally.errors[f"connect: {type(exc).__name__}"] += 1
            return None
        try:
            await ws.send(frame("reset", {"index": index}))
            async with asyncio.timeout(REPLY_TIMEOUT_S):
                reply = json.loads(await ws.recv())
        except Exception as exc:
            tally.errors[f"reset: {type(exc).__name__}"] += 1
            await ws.close()
            return None
        if reply["type"] != "observation":
            tally.errors[f"reset: {reply['data'].get('code')}"] += 1
            await ws.close()
            return None
        return ws


async def paced_steps(ws: Any, index: int, steps: list[str], window: tuple[float, float, float],
                      pace: float, tally: Tally) -> None:
    """Step every ``pace`` seconds at a random phase from ``window``'s start; steps sent
    before its measured part (a warm-up round) are not recorded; none starts after its end."""
    start, measured_from, stop = window
    phase = random.Random(index).uniform(0, pace)
    for turn in itertools.count():
        due = start + phase + turn * pace
        if due >= stop:
            return
        await asyncio.sleep(due - time.monotonic())
        sent = time.monotonic()
        try:
            await ws.send(steps[(index + turn) % len(steps)])
            async with asyncio.timeout(REPLY_TIMEOUT_S):
                raw = await ws.recv()
        except Exception as exc:  # a timeout or a dropped connection ends the session
            tally.errors[f"step: {type(exc).__name__}"] += 1
            return
        received = time.monotonic()
        reply = json.loads(raw)
        if reply["type"] != "observation":
            tally.errors[f"step: {reply['data'].get('code')}"] += 1
        elif sent >= measured_from:
            tally.step(due, sent, reply["data"]["observation"]["info"][ENV_CLOCK], received)


def machine_jiffies() -> tuple[int, int]:
    """Busy and total jiffies of all cores since boot (idle and iowait are not busy)."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


@dataclass
class Usage:
    """CPU seconds of the server (process ``pid``) and of this client, and the machine's
    busy and total jiffies (/proc/stat), at one moment."""

    pid: int
    at: float = field(default_factory=time.monotonic)
    server: float = 0.0
    client: float = field(default_factory=time.process_time)
    machine: tuple[int, int] = field(default_factory=machine_jiffies)

    def __post_init__(self) -> None:
        self.server = cpu_s(self.pid)

    def since(self, before: Usage) -> dict[str, float]:
        wall = self.at - before.at
        busy, total = (now - then for now, then in zip(self.machine, before.machine,
                                                          strict=True))
        return {"server_cpu_percent_of_core": round(100 * (self.server - before.server) / wall, 1),
                "client_cpu_percent_of_core": round(100 * (self.client - before.client) / wall, 1),
                "machine_busy_percent": round(100 * busy / max(total, 1), 1)}


def server_pid() -> int:
    """The running server's pid: this process's one child."""
    (pid,) = [pid for task in Path("/proc/self/task").iterdir()
              for pid in (task / "children").read_text().split()]
    return int(pid)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_process(pid: int) -> dict[str, float]:
    """The server's resident memory, threads and open files."""
    status = dict(line.split(":", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines())
    return {"rss_mb": round(int(status["VmRSS"].split()[0]) / 1024, 1),
            "threads": int(status["Threads"]),
            "open_files": len(os.listdir(f"/proc/{pid}/fd"))}


async def hold_sessions(url: str, pid: int, sessions: int, pace: float, duration: float
                        ) -> dict[str, Any]:
    """Open ``sessions`` sessions, step each every ``pace`` s for a warm-up round and then
    ``duration`` s measured, and report what they saw and what the server (``pid``) used."""
    questions = [record["question"] for record in data.bundled("search_qa")]
    steps = [frame("step", {"text": ACTIONS["agent_gym/Search-v0"].replace(
        "when was the town founded", question.rstrip("?"))}) for question in questions]
    tally = Tally()
    gate = asyncio.Semaphore(OPENING)
    idle = server_process(pid)
    opening = time.monotonic()
    sockets = await asyncio.gather(*(open_session(url, index % len(questions), gate, tally)
                                     for index in range(sessions)))
    open_s = time.monotonic() - opening
    live = [ws for ws in sockets if ws is not None]
    start = time.monotonic() + 0.2
    window = (start, start + pace, start + pace + duration)
    load_at_start = os.getloadavg()[0]

    async def usage_over_window() -> dict[str, float]:
        await asyncio.sleep(window[1] - time.monotonic())
        before = Usage(pid)
        await asyncio.sleep(window[2] - time.monotonic())
        return Usage(pid).since(before)

    watch = asyncio.create_task(usage_over_window())
    await asyncio.gather(*(paced_steps(ws, index, steps, window, pace, tally)
                           for index, ws in enumerate(live)))
    usage = await watch
    held = server_process(pid)  # every session still open
    held["rss_mb_before_sessions"] = idle["rss_mb"]
    held["kb_per_session"] = round(1024 * (held["rss_mb"] - idle["rss_mb"]) / sessions, 1)
    await asyncio.gather(*(ws.close() for ws in live))
    return {
        "sessions": sessions, "sessions_open": len(live), "open_s": round(open_s, 2),
        "measured_s": round(duration, 1), "steps_measured": len(tally.added),
        "errors": sum(tally.errors.values()), "error_kinds": dict(tally.errors),
        "added_ms": spread_ms(tally.added), "round_trip_ms": spread_ms(tally.round_trip),
        "env_step_ms": spread_ms(tally.env_step), "inbound_ms": spread_ms(tally.inbound),
        "outbound_ms": spread_ms(tally.outbound), "client_lag_ms": spread_ms(tally.lag),
        "server": held, **usage,
        "load_average": [round(load_at_start, 2), round(os.getloadavg()[0], 2)],
    }


def sessions_section(levels: list[int], pace: float, duration: float) -> dict[str, Any]:
    """Each level on a fresh server, pinned to its own core where there are two."""
    cores = sorted(os.sched_getaffinity(0))
    pin = len(cores) >= 2
    report: dict[str, Any] = {
        "env": f"{TIMED_ENV_ID}: Search-v0 (bm25, bundled corpus) whose step info carries "
               "its start and end on CLOCK_MONOTONIC",
        "pattern": f"each session: reset, then a search step every {pace:g} s at a random "
                   "phase; one asyncio loop (the websockets package) for all sessions",
        "added_latency": "client round trip (frame sent to reply read) minus the env step "
                         "(its start to end in the server's worker thread); inbound: sent to "
                         "env started, outbound: env ended to reply read",
        "pinned": f"server on core {cores[0]}, client on core {cores[1]}" if pin else "no",
        "goal": "0 errors at 1,000 sessions; added p50 <= 1 ms at 256",
        "levels": {},
    }
    pythonpath = f"{ROOT}:{ROOT / 'benchmarks'}"
    for sessions in levels:
        measured = max(duration, MIN_SAMPLES * pace / sessions)
        if pin:  # the server, forked now, inherits this thread's core
            os.sched_setaffinity(0, {cores[0]})
        try:
            with running_server(TIMED_ENV_ID, "--import", "bench_serve", "--max-sessions",
                                str(sessions), "--env-arg", "max_turns=1000000", "--env-arg",
                                "max_searches=1000000", env={"PYTHONPATH": pythonpath}) as url:
                if pin:
                    os.sched_setaffinity(0, {cores[1]})
                level = asyncio.run(hold_sessions(url, server_pid(), sessions, pace, measured))
        finally:
            os.sched_setaffinity(0, cores)
        report["levels"][str(sessions)] = level
        print(f"sessions {sessions}: {json.dumps(level)}", flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=960, help="steps per measurement")
    parser.add_argument("--rate", type=int, default=400,
                        help="steps/s all sessions offer together in the paced runs")
    parser.add_argument("--section", action="append", choices=SECTIONS,
                        help="run only this section (repeatable; default: all)")
    parser.add_argument("--levels", type=int, nargs="+", default=list(LEVELS),
                        help="concurrent sessions per level of the sessions section")
    parser.add_argument("--pace", type=float, default=1.0,
                        help="seconds between one session's steps in the sessions section")
    parser.add_argument("--duration", type=float, default=20.0,
                        help="seconds measured per level (longer where it takes that to "
                        f"measure {MIN_SAMPLES} steps)")
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
    if "sessions" in sections:
        report["sessions"] = sessions_section(args.levels, args.pace, args.duration)
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
                        "throughput_ratio": round(remote["steps_per_s"] / local["steps_per_s"], 3),
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
