"""Running code: stateless calls (on a fork-server, or a sandbox each) and notebooks.

A stateless call gets a fresh interpreter that runs exactly one cell and is then killed, so
nothing leaks from one call to the next. By default it is a freshly forked, fully isolated
child of a warm sandboxed interpreter (``forkserver``: a few ms, and the math stack already
imported for code that names it); the per-call engine starts a bwrap sandbox and an
interpreter for every call, and its pool only moves that ~25 ms start off the call's
critical path. A stateful sandbox keeps one persistent worker per episode, like a notebook
kernel; when a cell times out or kills its interpreter the worker is replaced and the
result says plainly that the state was lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, wait
from dataclasses import replace

from agent_gym.sandbox.config import Limits, SandboxError, encode_code
from agent_gym.sandbox.forkserver import ForkServer
from agent_gym.sandbox.launch import Launcher
from agent_gym.sandbox.memory import MemoryBound
from agent_gym.sandbox.process import TIMEOUT, WorkerProcess, reaper, spawner
from agent_gym.sandbox.result import ExecResult, Status, collect

log = logging.getLogger(__name__)


def _execute(
    launcher: Launcher, worker: WorkerProcess, code: str, timeout: float, *, single: bool
) -> ExecResult:
    """Send one cell to ``worker`` and collect its result; the worker may be left dead.

    A ``single`` (stateless) worker's call ends only once its whole sandbox has ended: the
    reply comes on a pipe the cell's code can also write to, and a forged one must not end
    the call while the code still runs (on, outside any call, until the worker is torn
    down). A notebook's reply cannot be checked that way; its worker
    lives on between cells by design, within its memory bound and per-cell CPU budget.
    """
    encode_code(code)
    limits = launcher.limits
    worker.clear_output()
    sent = worker.send({"code": code}, time.monotonic() + limits.startup_timeout + timeout)
    launcher.wait_ready(worker)
    started = time.monotonic()
    reply = worker.receive(started + timeout) if sent else None
    if (
        single
        and isinstance(reply, str)
        and not worker.wait_gone(max(0.0, started + timeout - time.monotonic()))
    ):
        reply = TIMEOUT  # it answered, but its code is still running
    duration = time.monotonic() - started
    if reply is TIMEOUT:
        worker.terminate()
        status: Status = "timeout"
        error: str | None = "TimeoutError"
    elif isinstance(reply, str) and reply.split(" ")[0] in ("ok", "error"):
        word, _, name = reply.partition(" ")
        status = "ok" if word == "ok" else "error"
        error = name or None
    else:  # the worker died, or broke the protocol
        worker.wait_exit(1.0)  # read its own exit status before a kill overwrites it
        status, error = "crashed", worker.exit_description()
        worker.terminate()
    return collect(status, error, worker.output_files, limits, timeout, duration)


def _timeout(limits: Limits, timeout: float | None) -> float:
    if timeout is None:
        return limits.timeout
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


class StatelessSandbox:
    """Every call runs in a fresh sandboxed interpreter that is killed right after it.

    With a ``forkserver`` (``engine == "forkserver"``) each call is a freshly forked, fully
    isolated child of a warm sandboxed interpreter (see ``forkserver``). Otherwise
    (``engine == "per-call"``) each call starts a bwrap sandbox and an interpreter of its
    own; with ``pool_size > 0`` that many are kept started ahead of time (each still serves
    exactly one call) and replaced in the background. Thread-safe.
    """

    mode = "stateless"

    def __init__(
        self, launcher: Launcher, *, pool_size: int = 0, forkserver: ForkServer | None = None
    ) -> None:
        if not isinstance(pool_size, int) or pool_size < 0:
            raise ValueError(f"pool_size must be a non-negative int, got {pool_size!r}")
        self.launcher = launcher
        self.forkserver = forkserver
        self.pool_size = 0 if forkserver is not None else pool_size
        self._idle: deque[WorkerProcess] = deque()
        self._pending = 0
        self._retiring: set[Future[None]] = set()
        self._spawning: set[Future[WorkerProcess]] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._refill()

    @property
    def isolation(self) -> str:
        return self.launcher.isolation

    @property
    def memory_bound(self) -> str:
        """How its memory is bounded as a whole: "cgroup-v1", "cgroup-v2" or "watcher"."""
        return self.launcher.memory_bound

    @property
    def engine(self) -> str:
        return "per-call" if self.forkserver is None else "forkserver"

    def reset(self) -> None:
        """Nothing to drop: no call sees another's state. (Same interface as the notebook.)"""
        if self._closed:
            raise SandboxError("this sandbox is closed")

    def run(self, code: str, *, timeout: float | None = None) -> ExecResult:
        seconds = _timeout(self.launcher.limits, timeout)
        if self.forkserver is not None:
            if self._closed:
                raise SandboxError("this sandbox is closed")
            return self.forkserver.run(code, seconds)
        worker = self._acquire()
        try:
            return _execute(self.launcher, worker, code, seconds, single=True)
        finally:
            self._retire(worker)

    def _retire(self, worker: WorkerProcess) -> None:
        """Tear the used worker down on the reaper thread: the caller has its result."""
        future = reaper().submit(worker.close)
        with self._lock:
            self._retiring.add(future)
        future.add_done_callback(self._retired)

    def _retired(self, future: Future[None]) -> None:
        with self._lock:
            self._retiring.discard(future)

    def _acquire(self) -> WorkerProcess:
        with self._lock:
            if self._closed:
                raise SandboxError("this sandbox is closed")
            worker = self._idle.popleft() if self._idle else None
        self._refill()
        while worker is not None and not worker.alive:
            worker.close()
            with self._lock:
                worker = self._idle.popleft() if self._idle else None
        return worker or self.launcher.spawn(single=True)

    def _refill(self) -> None:
        with self._lock:
            missing = self.pool_size - len(self._idle) - self._pending
            if self._closed or missing <= 0:
                return
            self._pending += missing
        for _ in range(missing):
            future = spawner().submit(lambda: self.launcher.spawn(single=True))
            with self._lock:
                self._spawning.add(future)
            future.add_done_callback(self._arrived)

    def _arrived(self, future: Future[WorkerProcess]) -> None:
        error = future.exception()
        with self._lock:
            self._pending -= 1
            self._spawning.discard(future)
            closed = self._closed
            if error is None and not closed:
                self._idle.append(future.result())
        if error is not None:
            log.warning("a pooled sandbox worker failed to start: %s", error)
        elif closed:
            future.result().close()

    def close(self) -> None:
        """Kill the pre-started workers and wait for used ones to be gone. Idempotent.

        Later calls raise.
        """
        with self._lock:
            self._closed = True
            idle, self._idle = list(self._idle), deque()
            retiring, spawning = list(self._retiring), list(self._spawning)
        if self.forkserver is not None:
            self.forkserver.close()
        for worker in idle:
            worker.close()
        wait(retiring)
        for future in wait(spawning).done:  # a refill that lands now is not left running
            if future.exception() is None:
                future.result().close()

    def __enter__(self) -> StatelessSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StatefulSandbox:
    """One persistent sandboxed interpreter that keeps its globals between calls.

    A cell that raises (``MemoryError`` included) leaves the state intact. A cell that
    times out or kills the interpreter loses it: the worker is replaced, and the result
    carries ``state_lost=True`` and says so in its observation.
    """

    mode = "stateful"

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self._worker: WorkerProcess | None = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def isolation(self) -> str:
        return self.launcher.isolation

    @property
    def memory_bound(self) -> str:
        """How its memory is bounded as a whole: "cgroup-v1", "cgroup-v2" or "watcher"."""
        return self.launcher.memory_bound

    def reset(self) -> None:
        """Drop all state and start a fresh interpreter (it warms up in the background)."""
        with self._lock:
            self._replace_worker()

    def _replace_worker(self) -> None:
        if self._closed:
            raise SandboxError("this sandbox is closed")
        if self._worker is not None:
            self._worker.close()
        self._worker = None
        self._worker = self.launcher.spawn(single=False)

    def run(self, code: str, *, timeout: float | None = None) -> ExecResult:
        seconds = _timeout(self.launcher.limits, timeout)
        with self._lock:
            if self._worker is None:
                self._replace_worker()
            assert self._worker is not None
            try:
                result = _execute(self.launcher, self._worker, code, seconds, single=False)
            except SandboxError:
                # It did not start (or broke its protocol) and is closed: the next call must
                # start a fresh interpreter, not reuse a dead one.
                self._worker.close()
                self._worker = None
                raise
            if result.status in ("timeout", "crashed"):
                self._replace_worker()
                result = replace(result, state_lost=True)
            return result

    def close(self) -> None:
        """Kill the interpreter; later calls raise. Idempotent."""
        with self._lock:
            self._closed = True
            if self._worker is not None:
                self._worker.close()
                self._worker = None

    def __enter__(self) -> StatefulSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_sandbox(
    mode: str = "stateless",
    *,
    isolation: str = "bwrap",
    limits: Limits | None = None,
    pool_size: int = 0,
    preload: Sequence[str] = (),
    python: str | None = None,
    forkserver: bool | None = None,
    memory_bound: MemoryBound = "auto",
) -> StatelessSandbox | StatefulSandbox:
    """A sandbox in ``mode`` ('stateless' or 'stateful'), checked to start on this host.

    Stateless calls run on a fork-server when the isolation is bwrap (``forkserver=None``
    or ``True``); ``forkserver=False`` starts a fresh bwrap sandbox per call instead
    (optionally pre-started: ``pool_size``), which is also the fallback, with a warning in
    the log, when the fork-server cannot start here (``forkserver=True`` raises instead).
    Both give every call the same isolation.

    Raises ``IsolationUnavailableError`` when bwrap cannot run, unless the caller opted in to
    ``isolation='rlimits'`` (which warns, and reports itself through ``.isolation``).

    Each sandbox (each call, on the fork-server) is bounded in memory as a whole, all its
    processes together (``agent_gym.sandbox.memory``): by a cgroup where this host allows
    one (``memory_bound="auto"``; ``"cgroup"`` raises where it does not), else by a
    watcher thread (``"watcher"`` forces it); ``.memory_bound`` says which.
    """
    if mode not in ("stateless", "stateful"):
        raise ValueError(f"mode must be 'stateless' or 'stateful', got {mode!r}")
    if forkserver and (mode != "stateless" or isolation != "bwrap"):
        raise ValueError("forkserver=True needs mode='stateless' and isolation='bwrap'")
    launcher = Launcher(
        isolation=isolation,
        limits=limits,
        python=python,
        preload=preload,
        memory_bound=memory_bound,
    )
    launcher.probe()
    if mode == "stateless" and isolation == "bwrap" and forkserver is not False:
        server = ForkServer(launcher)
        try:
            server.start()
        except SandboxError as err:
            server.close()
            if forkserver:
                raise
            log.warning(
                "the sandbox fork-server cannot start here (%s); every stateless "
                "call starts a sandbox of its own instead",
                err,
            )
        else:
            return StatelessSandbox(launcher, forkserver=server)
    if mode == "stateful":
        if pool_size:
            raise ValueError("pool_size applies to the stateless mode only")
        return StatefulSandbox(launcher)
    return StatelessSandbox(launcher, pool_size=pool_size)
