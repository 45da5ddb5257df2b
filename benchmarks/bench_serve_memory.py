"""The memory a loopback `agent-gym serve` holds: under math grading, and over connections.

"helpers": 40 WebSocket sessions of GSM8K-v0 at once, each stepping ``\\boxed{0.5}`` (not an
integer, so graded by math-verify in a helper process: ``agent_gym.rewards.MathVerifier``)
``--gradings`` times. Gives the most helpers seen running at once (polled from /proc every
50 ms; the bound is one per core of the server, at most eight), the RSS of the server and
its helpers together before the sessions (idle), at their peak and after they closed, and
the seconds from the close until that sum is back within 10% of idle (sampled every second,
at most ``--settle`` seconds; helpers stop after 30 s idle).

"churn": ``--connections`` WebSocket connections opened and closed, ``CHURN_CONCURRENCY`` at a
time, each opening a session and leaving (the server builds and closes an env each time).
Gives the server's RSS, threads and open files after the first 1,000 and then every 1,000;
the goal is an RSS after 12,000 within 10% of that after 1,000.

Each section runs its own server (``agent-gym serve agent_gym/GSM8K-v0``, default settings),
reached on 127.0.0.1 only. Memory is read from /proc (Linux).

    .venv/bin/python benchmarks/bench_serve_memory.py [--section helpers --section churn]
        [--connections 12000] [--gradings 5] [--settle 90]

A run of one section keeps the other's figures from benchmarks/results/serve_memory.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import RESULTS, Result, figures_in, timed
from websockets.asyncio.client import connect

from agent_gym.rewards import default_max_helpers
from tests.helpers.serve_process import frame, running_server

SECTIONS = ("helpers", "churn")
ENV_ID = "agent_gym/GSM8K-v0"
SESSIONS = 40
CHURN_CONCURRENCY = 8
MARK_EVERY = 1000
REPLY_TIMEOUT_S = 60.0
OUT = RESULTS / "serve_memory.json"


def children(pid: int) -> list[tuple[int, str]]:
    """The processes ``pid`` started that are running (pid, command line), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
        except (OSError, ValueError):
            continue
        if int(parent) == pid and state not in "ZX":
            found.append((int(entry.name), command))
    return found


def status(pid: int, field: str) -> int:
    """A number of /proc/PID/status (VmRSS in KB, Threads), 0 once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def server_pid() -> int:
    """The server ``running_server`` started: this process's child running the CLI."""
    (pid,) = [pid for pid, command in children(os.getpid()) if "agent_gym.cli serve" in command]
    return pid


def helpers(server: int) -> list[int]:
    return [pid for pid, command in children(server) if "math_verify" in command]


def total_rss_mb(server: int) -> float:
    """The server's RSS and its helpers', in MB."""
    return round(sum(status(pid, "VmRSS") for pid in [server, *helpers(server)]) / 1024, 1)


async def grade(ws_url: str, gradings: int) -> int:
    """One session stepping ``\\boxed{0.5}`` ``gradings`` times; the steps answered."""
    answered = 0
    async with connect(ws_url, open_timeout=REPLY_TIMEOUT_S) as ws:
        for _ in range(gradings):  # an answer ends a GSM8K-v0 episode
            await ws.send(frame("reset", {}))
            await asyncio.wait_for(ws.recv(), REPLY_TIMEOUT_S)
            await ws.send(frame("step", {"text": "So it is \\boxed{0.5}."}))
            if '"type": "observation"' in await asyncio.wait_for(ws.recv(), REPLY_TIMEOUT_S):
                answered += 1
    return answered


def measure_helpers(gradings: int, settle_s: float) -> dict[str, Any]:
    with running_server(ENV_ID) as url:
        server = server_pid()
        idle = total_rss_mb(server)
        peak = {"helpers": 0, "rss_mb": idle}
        polling = threading.Event()
        polling.set()

        def poll() -> None:
            while polling.is_set():
                peak["helpers"] = max(peak["helpers"], len(helpers(server)))
                peak["rss_mb"] = max(peak["rss_mb"], total_rss_mb(server))
                time.sleep(0.05)

        poller = threading.Thread(target=poll)
        poller.start()
        started = time.perf_counter()

        async def all_sessions() -> list[int]:
            ws_url = url.replace("http://", "ws://") + "/ws"
            return await asyncio.gather(*(grade(ws_url, gradings) for _ in range(SESSIONS)))

        try:
            answered = sum(asyncio.run(all_sessions()))
        finally:
            polling.clear()
            poller.join()
        grading_s = time.perf_counter() - started
        closed_at, after = time.monotonic(), []
        while time.monotonic() - closed_at < settle_s:
            time.sleep(1.0)
            after.append((round(time.monotonic() - closed_at, 1), total_rss_mb(server),
                          len(helpers(server))))
            if after[-1][1] <= 1.1 * idle and after[-1][2] == 0:
                break
        settled = after[-1]
        return {
            "sessions": SESSIONS, "gradings_per_session": gradings,
            "steps_answered": answered, "grading_seconds": round(grading_s, 1),
            "helper_bound": default_max_helpers(), "helpers_at_most": peak["helpers"],
            "idle_rss_mb": idle, "peak_rss_mb": peak["rss_mb"],
            "rss_mb_after_close": settled[1], "helpers_after_close": settled[2],
            "seconds_to_settle": settled[0] if settled[1] <= 1.1 * idle else None,
            "settle_trace": after[:: max(1, len(after) // 12)],
        }


async def churn(ws_url: str, count: int) -> int:
    """Open and close ``count`` WebSocket sessions, CHURN_CONCURRENCY at a time; how many
    opened."""
    gate = asyncio.Semaphore(CHURN_CONCURRENCY)

    async def one() -> int:
        async with gate, connect(ws_url, open_timeout=REPLY_TIMEOUT_S):
            return 1

    return sum(await asyncio.gather(*(one() for _ in range(count))))


def measure_churn(connections: int) -> dict[str, Any]:
    with running_server(ENV_ID) as url:
        server = server_pid()
        ws_url = url.replace("http://", "ws://") + "/ws"
        marks, opened, started = [], 0, time.perf_counter()
        while opened < connections:
            opened += asyncio.run(churn(ws_url, min(MARK_EVERY, connections - opened)))
            time.sleep(0.5)  # the last closes' envs are closed in worker threads
            marks.append({"connections": opened, "rss_mb": round(status(server, "VmRSS") / 1024, 1),
                          "threads": status(server, "Threads"),
                          "open_files": len(os.listdir(f"/proc/{server}/fd"))})
            print(marks[-1], flush=True)
        first, last = marks[0]["rss_mb"], marks[-1]["rss_mb"]
        return {"connections": opened, "concurrency": CHURN_CONCURRENCY,
                "connections_per_s": round(opened / (time.perf_counter() - started), 1),
                "rss_mb_after_first_1000": first, "rss_mb_after_all": last,
                "growth_percent": round(100 * (last - first) / first, 1), "marks": marks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--section", action="append", choices=SECTIONS)
    parser.add_argument("--connections", type=int, default=12_000)
    parser.add_argument("--gradings", type=int, default=5)
    parser.add_argument("--settle", type=float, default=90.0)
    args = parser.parse_args()
    result = Result(figures=figures_in(OUT))
    for section in args.section or SECTIONS:
        if section == "helpers":
            result.figures["helpers"] = timed(lambda: measure_helpers(args.gradings, args.settle))
        else:
            result.figures["churn"] = timed(lambda: measure_churn(args.connections))
        print(section, result.figures[section], flush=True)
        result.write(OUT)


if __name__ == "__main__":
    main()
