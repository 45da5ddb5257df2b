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
handlers) reaches the next one. A call ends when the server has reaped its child, never on
a line the call's own code could have written (``_await_answer``). Its memory is bounded
for all its processes together (``memory``): the child enters a cgroup of the call's own (a
reused one: making one per call cost ~0.1 ms) before it reads its code, or the host's
watcher watches it.

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
from collections.abc import Callable
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Literal, NamedTuple

from agent_gym.sandbox.config import (
    FORKSERVER_MATH_STACK,
    FORKSERVER_PRELOAD,
    SandboxError,
    encode_code,
)
from agent_gym.sandbox.launch import Launcher
from agent_gym.sandbox.memory import Bound, Cgroup, Watch, sandbox_limit
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
    """One running fork-server: its sandbox and the host pid of the server process in it.

    ``warm`` is its resident memory once warm: the most of it a call's child can copy, which
    the call's memory bound allows on top of the code's own.
    """

    def __init__(self, worker: WorkerProcess, pid: int, kind: Warmth) -> None:
        self.worker = worker
        self.pid = pid
        self.kind = kind
        self.pidfd = os.pidfd_open(pid)
        # Kept open and read from its start before every call (the kernel writes it anew):
        # no path to build, open and close each time.
        self.status = os.open(f"/proc/{pid}/status", os.O_RDONLY | os.O_CLOEXEC)
        assert worker.requests is not None
        self.requests = worker.requests
        status = os.pread(self.status, 1 << 14, 0).decode()
        self.warm = next(int(line.split()[1]) << 10 for line in status.splitlines()
                         if line.startswith("VmRSS:"))

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

    def child(self, pid: int) -> int | None:
        """The host pid of the server's child that is ``pid`` in the server's namespace."""
        try:
            children = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()
        except OSError:  # the server is gone: so is the child
            return None
        for host_pid in children:
            try:
                status = Path(f"/proc/{host_pid}/status").read_text()
            except OSError:
                continue
            nspids = next((line.split()[1:] for line in status.splitlines()
                           if line.startswith("NSpid:")), [])
            # The child is pid 1 of a namespace of its own, one level below the server's.
            if len(nspids) >= 2 and nspids[-2] == str(pid):
                return int(host_pid)
        return None

    def close(self) -> None:
        self.worker.close()
        os.close(self.pidfd)
        os.close(self.status)


class _Answer(NamedTuple):
    """What a call's pipes said: the server's verdict on how its child ended (``None`` if
    the server died first, ``""`` at the deadline) and the last line the child wrote on its
    outcome pipe, if any."""

    verdict: str | None
    outcome: str | None

    @property
    def ended(self) -> bool:
        """The server said how the child ended: it has reaped it, so the call's processes
        are all gone (anything else is a server that died, hangs or broke its protocol)."""
        return (self.verdict or "").partition(" ")[0] in ("exited", "timeout", "crashed", "fault")


def _last_line(data: bytes) -> str | None:
    lines = data.split(b"\n")
    return lines[-2].decode("utf-8", errors="replace") if len(lines) > 1 else None


def _await_answer(
    outcome: int, verdict: int, deadline: float, announced: Callable[[int], None] | None
) -> _Answer:
    """Wait for the server's verdict, which it writes once it has reaped the call's child:
    the child is pid 1 of its namespace, so every process of the call is gone by then.

    The outcome pipe carries the child's ``ok`` / ``error <name>`` line, written as its
    last act; model code can write to that pipe too, so what it says is read only after the
    verdict, and a line the code forges can misreport its own call but never end it early.
    It is drained all along (a full pipe would block the child) and only its tail kept. A
    ``pid N`` line before the verdict names the child, for the memory watcher
    (``announced``).
    """
    tail = verdict_data = b""
    watching = [outcome, verdict]
    while True:
        line, newline, rest = verdict_data.partition(b"\n")
        if newline:
            text = line.decode("utf-8", errors="replace")
            word, _, number = text.partition(" ")
            if word == "pid" and number.isdigit() and announced is not None:
                announced(int(number))
                verdict_data = rest
                continue
            while outcome in watching and select.select([outcome], [], [], 0)[0]:
                chunk = os.read(outcome, _MAX_REPLY)
                if not chunk:
                    break
                tail = (tail + chunk)[-_MAX_REPLY:]
            return _Answer(text, _last_line(tail))
        if verdict not in watching:
            return _Answer(None, None)
        if len(verdict_data) > _MAX_REPLY:  # no server of ours writes this
            return _Answer(verdict_data[:80].decode("utf-8", errors="replace"), None)
        remaining = deadline - time.monotonic()
        ready = select.select(watching, [], [], remaining)[0] if remaining > 0 else []
        if not ready:
            return _Answer("", None)
        for fd in ready:
            chunk = os.read(fd, _MAX_REPLY)
            if not chunk:
                watching.remove(fd)
            elif fd == outcome:
                tail = (tail + chunk)[-_MAX_REPLY:]
            else:
                verdict_data += chunk


class ForkServer:
    """Runs stateless calls in children of warm sandboxed interpreters. Thread-safe."""

    def __init__(self, launcher: Launcher) -> None:
        if launcher.isolation != "bwrap":
            raise ValueError("the fork-server needs isolation='bwrap'")
        self.launcher = launcher
        self.restarts = 0
        self._servers: dict[Warmth, _Server | None] = {"lean": None, "math": None}
        # The calls' cgroups no call is using (all their processes gone), by server kind.
        self._cgroups: dict[Warmth, list[Cgroup]] = {"lean": [], "math": []}
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
            return _Server(worker, int(children[0]), kind)
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

    def _bound(self, server: _Server) -> Bound:
        """A call's memory bound: an unused cgroup of its server's kind (made if there is
        none, or if its server's warm memory changed), or a watch."""
        limits = self.launcher.limits
        if self.launcher.memory_bound == "watcher":
            return self.launcher.memory.bound(limits, server.warm)
        with self._lock:
            cgroup = self._cgroups[server.kind].pop() if self._cgroups[server.kind] else None
        if cgroup is not None and cgroup.limit == sandbox_limit(limits, server.warm):
            return cgroup
        if cgroup is not None:
            cgroup.close()
        return self.launcher.memory.bound(limits, server.warm)

    def _release(self, server: _Server, bound: Bound, ended: bool) -> None:
        """After a call: a cgroup whose call ``ended`` (its processes are gone) is kept for
        the next call; otherwise it is removed once its server has been torn down (it is
        queued after the server on the reaper thread)."""
        if isinstance(bound, Cgroup) and ended:
            bound.rearm()
            with self._lock:
                if not self._closed:
                    self._cgroups[server.kind].append(bound)
                    return
        if isinstance(bound, Cgroup) and not ended:
            with self._lock:
                future = reaper().submit(bound.close)
                self._retiring.add(future)
            future.add_done_callback(self._retired)
            return
        bound.close()

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
                bound = self._bound(server)
                answer = _Answer(None, None)
                try:
                    answer, duration = self._call(server, bound, source, files, timeout)
                    # The bound kills with SIGKILL (as the CPU limit does, which the server
                    # names as such).
                    killed = answer.verdict == "crashed killed by SIGKILL"
                    exceeded = killed and bound.exceeded()
                finally:
                    if not answer.ended:  # the server is dead, stuck or broken: it goes first
                        self._discard(server)
                    self._release(server, bound, ended=answer.ended)
                if answer.verdict is None and attempt == 1:
                    continue
                return self._result(answer, bound, exceeded, files, timeout, duration)
            raise AssertionError("unreachable")
        finally:
            os.close(source)

    def _call(
        self, server: _Server, bound: Bound, source: int, files: tuple[int, int], timeout: float
    ) -> tuple[_Answer, float]:
        """Hand one call to ``server`` and wait for its answer and how long it took."""
        outcome_r, outcome_w = os.pipe2(os.O_CLOEXEC)
        verdict_r, verdict_w = os.pipe2(os.O_CLOEXEC)
        try:
            try:
                request = [marshal.dumps({"timeout": timeout})]
                fds = [source, *files, outcome_w, verdict_w]
                if isinstance(bound, Cgroup):
                    fds.append(bound.door)  # the child enters before it reads its code
                socket.send_fds(server.requests, request, fds)
                sent = True
            except OSError:
                sent = False
            finally:  # the server holds the only other copies: EOF if it dies
                os.close(outcome_w)
                os.close(verdict_w)
            announced = None
            if isinstance(bound, Watch):

                def announced(pid: int) -> None:
                    child = server.child(pid)
                    if child is not None:
                        bound.start(child)  # SIGKILL to it takes its whole namespace

            started = time.monotonic()
            deadline = started + timeout + GRACE
            answer = (
                _await_answer(outcome_r, verdict_r, deadline, announced)
                if sent
                else _Answer(None, None)
            )
            return answer, time.monotonic() - started
        finally:
            os.close(outcome_r)
            os.close(verdict_r)

    def _result(
        self,
        answer: _Answer,
        bound: Bound,
        exceeded: bool,
        files: tuple[int, int],
        timeout: float,
        duration: float,
    ) -> ExecResult:
        reply = answer.verdict
        word, _, rest = (reply or "").partition(" ")
        outcome_word, _, name = (answer.outcome or "").partition(" ")
        status: Status
        error: str | None
        if reply is None or reply == "":
            # EOF: the server died mid-call. No answer in time: it is stuck or was stopped.
            status = "crashed" if reply is None else "timeout"
            error = "the sandbox's fork-server died" if reply is None else "TimeoutError"
        elif word == "exited" and outcome_word in ("ok", "error"):
            status = "ok" if outcome_word == "ok" else "error"
            error = name.strip() or None
        elif word == "exited":  # it ended itself (os._exit(0)) before its outcome line
            status, error = "crashed", "exit code 0"
        elif word == "timeout":
            status, error = "timeout", "TimeoutError"
        elif word == "crashed" and rest:
            status, error = "crashed", bound.description() if exceeded else rest
        elif word == "fault":
            raise SandboxError(f"the sandbox fork-server could not run the call: {rest}")
        else:
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
            idle = [c for pool in self._cgroups.values() for c in pool]
            self._cgroups = {"lean": [], "math": []}
        wait(retiring)
        for cgroup in idle:
            cgroup.close()
