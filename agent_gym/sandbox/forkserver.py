"""Stateless calls forked from warm, sandboxed interpreters (the host side of the fork-servers).

A fresh bwrap sandbox per call costs a bwrap start and an interpreter start (~25 ms, and
~0.5x the throughput of a plain subprocess even when pre-started). A fork-server is a
long-lived bwrap sandbox whose interpreter has imported the standard library once
(``config.FORKSERVER_PRELOAD``) and forks a child per call. Each ``StatelessSandbox`` has
two: a lean one, and one with the math stack warm as well (``config.FORKSERVER_MATH_STACK``,
started at the first call that needs it; only calls of a kind wait for its server to
start). A call whose code names a module of that stack
(a word match: a false hit only costs the bigger fork) forks from the second, so
``import sympy`` costs it nothing; any other call forks from the lean one, whose forks cost
~1.5 ms less CPU because there is less heap to share and copy. Either way the call's code
can import anything a fresh interpreter could.

The child is isolated before it reads its code (``_worker._isolate``): pid 1 of a
pid namespace of its own, private mount, IPC and network namespaces with an empty private
``/tmp`` and ``/dev/shm``, its own user namespace (so ``RLIMIT_NPROC`` is per call), no
capabilities, rlimits, and only its own output files open. Its death takes every process it
started with it, so nothing of a call outlives it, and each call starts from the server's
untouched memory image, so nothing a call changes (files, environment, modules, signal
handlers) reaches the next one.

A server is trusted code and model code never runs in it; the host still treats it as
something that can fail. It is replaced when it dies, when it stops answering within a
call's timeout plus a grace period, when a reply breaks the protocol, and when it is found
stopped, traced (``TracerPid``) or running more than one thread before a call: the states a
debugger or an injected thread would leave, none of which the server ever enters by itself.
A call that was running when its server died runs once more on a fresh one (invisible to
a stateless call), and reports ``crashed`` if that one dies too.
"""

from __future__ import annotations

import logging
import marshal
import os
import re
import select
import socket
import threading
import time
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Literal

from agent_gym.sandbox.config import (
    FORKSERVER_MATH_STACK,
    FORKSERVER_PRELOAD,
    SandboxError,
    encode_code,
)
from agent_gym.sandbox.launch import Launcher
from agent_gym.sandbox.process import WorkerProcess, output_file, reaper
from agent_gym.sandbox.result import ExecResult, Status, collect

log = logging.getLogger(__name__)

# How long past a call's own timeout the server may take to answer before it is replaced.
GRACE = 2.0
_MAX_REPLY = 512  # bytes of an answer line

Warmth = Literal["lean", "math"]
_WARM: dict[Warmth, tuple[str, ...]] = {
    "lean": FORKSERVER_PRELOAD,
    "math": FORKSERVER_PRELOAD + FORKSERVER_MATH_STACK,
}
_NAMES_MATH = re.compile(r"\b(?:" + "|".join(FORKSERVER_MATH_STACK) + r")\b")


def warmth(code: str) -> Warmth:
    """The fork-server a call runs on: ``math`` when its code names a math-stack module."""
    return "math" if _NAMES_MATH.search(code) else "lean"


class _Server:
    """One running fork-server: its sandbox and the host pid of the server process in it."""

    def __init__(self, worker: WorkerProcess, pid: int) -> None:
        self.worker = worker
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)
        # Kept open and read from its start before every call (the kernel writes it anew):
        # no path to build, open and close each time.
        self.status = os.open(f"/proc/{pid}/status", os.O_RDONLY | os.O_CLOEXEC)
        assert worker.requests is not None
        self.requests = worker.requests

    def healthy(self) -> bool:
        """Alive, not stopped or traced, and still single-threaded (see the module docstring)."""
        if not self.worker.alive or select.select([self.pidfd], [], [], 0)[0]:
            return False
        try:
            status = os.pread(self.status, 1 << 14, 0)
        except OSError:  # the process is gone
            return False
        return (
            status.partition(b"\nState:\t")[2][:1] in (b"R", b"S", b"D")
            and b"\nTracerPid:\t0\n" in status
            and b"\nThreads:\t1\n" in status
        )

    def close(self) -> None:
        self.worker.close()
        os.close(self.pidfd)
        os.close(self.status)


def _first_line(data: bytes) -> str | None:
    end = data.find(b"\n")
    return None if end < 0 else data[:end].decode("utf-8", errors="replace")


def _await_answer(outcome: int, verdict: int, deadline: float) -> str | None:
    """A call's answer: the child's own ``ok`` / ``error <name>`` line as soon as it comes
    (straight from the child, one wake-up less than through the server), else the server's
    word on how the child ended. ``None`` if the server died first, ``""`` at the deadline.

    The outcome pipe is one model code can write to as well, so only those two words are
    taken from it; anything else waits for the server, whose pipe the child never holds.
    """
    buffers = {outcome: b"", verdict: b""}
    watching = {outcome, verdict}
    while True:
        line = _first_line(buffers[outcome])
        if line is not None and line.partition(" ")[0] in ("ok", "error"):
            return line
        line = _first_line(buffers[verdict])
        if line is not None and outcome in watching and select.select([outcome], [], [], 0)[0]:
            watching.discard(outcome)  # what the child wrote before it ended comes first
            buffers[outcome] += os.read(outcome, _MAX_REPLY)
            continue
        if line is not None:
            return line
        if verdict not in watching:
            return None
        remaining = deadline - time.monotonic()
        ready = select.select(list(watching), [], [], remaining)[0] if remaining > 0 else []
        if not ready:
            return ""
        for fd in ready:
            chunk = os.read(fd, _MAX_REPLY)
            buffers[fd] += chunk
            if not chunk or len(buffers[fd]) > _MAX_REPLY:
                watching.discard(fd)


class ForkServer:
    """Runs stateless calls in children of warm sandboxed interpreters. Thread-safe."""

    def __init__(self, launcher: Launcher) -> None:
        if launcher.isolation != "bwrap":
            raise ValueError("the fork-server needs isolation='bwrap'")
        self.launcher = launcher
        self.restarts = 0
        self._servers: dict[Warmth, _Server | None] = {"lean": None, "math": None}
        self._retiring: set[Future[None]] = set()
        # Reentrant: a retired server's done-callback may run at once, inside _retire.
        self._lock = threading.RLock()
        # Held while a server of that kind starts (~1 s with the math stack), and taken
        # before ``_lock``, never inside it: calls of the other kind do not wait for it.
        self._starting: dict[Warmth, threading.Lock] = {
            "lean": threading.Lock(), "math": threading.Lock()
        }
        self._closed = False

    def start(self) -> None:
        """Start the lean server now (not on the first call); raise if it cannot start here."""
        self._current("lean")

    def _spawn(self, kind: Warmth) -> _Server:
        worker = self.launcher.spawn(single=True, forkserver=True, warm=_WARM[kind])
        try:
            self.launcher.wait_ready(worker)
            init = worker.inner_pid
            children = Path(f"/proc/{init}/task/{init}/children").read_text().split()
            if len(children) != 1:
                raise SandboxError("the fork-server's sandbox does not hold exactly one server")
            return _Server(worker, int(children[0]))
        except BaseException:
            worker.close()
            raise

    def _current(self, kind: Warmth) -> _Server:
        """The running server of a kind, started first if there is none (or it is gone or
        was tampered with). Not under ``_lock``: a start holds only its kind's lock."""
        server = self._healthy(kind)
        if server is not None:
            return server
        with self._starting[kind]:
            server = self._healthy(kind)  # another caller may have started it meanwhile
            if server is not None:
                return server
            server = self._spawn(kind)
            with self._lock:
                # close() takes every start lock first, so it cannot have run meanwhile.
                assert not self._closed and self._servers[kind] is None
                self._servers[kind] = server
            return server

    def _healthy(self, kind: Warmth) -> _Server | None:
        """The server of a kind if it is running; a failed one is retired first."""
        with self._lock:
            if self._closed:
                raise SandboxError("this sandbox is closed")
            server = self._servers[kind]
            if server is not None and server.healthy():
                return server
            if server is not None:
                self._replace(server, "died or was tampered with")
            return None

    def _retire(self, server: _Server) -> None:
        """Kill a server's whole sandbox off the caller's path (locked)."""
        for kind, running in self._servers.items():
            if running is server:
                self._servers[kind] = None
        future = reaper().submit(server.close)
        self._retiring.add(future)
        future.add_done_callback(self._retired)

    def _retired(self, future: Future[None]) -> None:
        with self._lock:
            self._retiring.discard(future)

    def _replace(self, server: _Server, why: str) -> None:
        """Retire a failed server; the next call starts a fresh one (locked)."""
        log.warning("the sandbox fork-server %s; starting a fresh one", why)
        self.restarts += 1
        self._retire(server)

    def _discard(self, server: _Server) -> None:
        with self._lock:
            if server in self._servers.values():
                self._replace(server, "stopped answering")

    def run(self, code: str, timeout: float) -> ExecResult:
        """Run ``code`` in a fresh child; ``timeout`` is its wall time in seconds."""
        data = encode_code(code)
        files = (output_file("stdout"), output_file("stderr"))
        try:
            return self._run(data, warmth(code), timeout, files)
        finally:
            for fd in files:
                os.close(fd)

    def _run(
        self, data: bytes, kind: Warmth, timeout: float, files: tuple[int, int]
    ) -> ExecResult:
        """Send the call; if its server dies first, run it once more on a fresh one.

        Running a stateless call twice is invisible to it (nothing of the first run
        survives); a call whose second server dies too reports ``crashed``.
        """
        source = os.memfd_create("sandbox-code", os.MFD_CLOEXEC)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(source, view) :]
            for attempt in (1, 2):
                server = self._current(kind)
                for fd in files:
                    os.ftruncate(fd, 0)
                outcome_r, outcome_w = os.pipe2(os.O_CLOEXEC)
                verdict_r, verdict_w = os.pipe2(os.O_CLOEXEC)
                try:
                    try:
                        request = [marshal.dumps({"timeout": timeout})]
                        fds = [source, *files, outcome_w, verdict_w]
                        socket.send_fds(server.requests, request, fds)
                        sent = True
                    except OSError:
                        sent = False
                    finally:  # the server holds the only other copies: EOF if it dies
                        os.close(outcome_w)
                        os.close(verdict_w)
                    started = time.monotonic()
                    deadline = started + timeout + GRACE
                    reply = _await_answer(outcome_r, verdict_r, deadline) if sent else None
                    duration = time.monotonic() - started
                finally:
                    os.close(outcome_r)
                    os.close(verdict_r)
                if reply is None and attempt == 1:
                    self._discard(server)
                    continue
                return self._result(server, reply, files, timeout, duration)
            raise AssertionError("unreachable")
        finally:
            os.close(source)

    def _result(
        self,
        server: _Server,
        reply: str | None,
        files: tuple[int, int],
        timeout: float,
        duration: float,
    ) -> ExecResult:
        word, _, rest = (reply or "").partition(" ")
        status: Status
        error: str | None
        if reply is None or reply == "":
            # EOF: the server died mid-call. No answer in time: it is stuck or was stopped.
            self._discard(server)
            status = "crashed" if reply is None else "timeout"
            error = "the sandbox's fork-server died" if reply is None else "TimeoutError"
        elif word in ("ok", "error"):
            status, error = word, rest.strip() or None
        elif word == "timeout":
            status, error = "timeout", "TimeoutError"
        elif word == "crashed" and rest:
            status, error = "crashed", rest
        elif word == "fault":
            raise SandboxError(f"the sandbox fork-server could not run the call: {rest}")
        else:
            self._discard(server)
            raise SandboxError(f"the sandbox fork-server broke its protocol: {reply[:80]!r}")
        return collect(status, error, files, self.launcher.limits, timeout, duration)

    def close(self) -> None:
        """Kill the servers' sandboxes and wait until they are gone (a server still starting
        is waited for first); later calls raise. Idempotent."""
        with self._starting["lean"], self._starting["math"], self._lock:
            self._closed = True
            for server in list(self._servers.values()):
                if server is not None:
                    self._retire(server)
            retiring = list(self._retiring)
        wait(retiring)
