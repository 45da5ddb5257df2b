"""Start `agent-gym serve` as a real subprocess on a free loopback port, and stop it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(
    env_id: str, *args: str, env: dict[str, str] | None = None, startup_s: float = 90.0
) -> Iterator[str]:
    """Yield the base URL of a server started with ``agent-gym serve ENV_ID ARGS``; the
    process (and its group) is killed on exit, whatever happened."""
    port = free_port()
    command = [sys.executable, "-m", "agent_gym.cli", "serve", env_id, "--port", str(port), *args]
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if process.poll() is not None:
                output = process.stdout.read().decode(errors="replace") if process.stdout else ""
                raise RuntimeError(f"agent-gym serve exited with {process.returncode}:\n{output}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"agent-gym serve did not answer on {url}")
            time.sleep(0.2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=15)
        if process.stdout:
            process.stdout.close()


def frame(kind: str, data: object = None) -> str:
    message: dict[str, object] = {"type": kind}
    if data is not None:
        message["data"] = data
    return json.dumps(message)
