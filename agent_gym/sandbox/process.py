"""One running sandboxed worker: its pipes, its output files, waiting on it and killing it.

Waiting uses a pidfd and ``poll`` (polling ``Popen.wait(timeout)`` cost ~13 ms a call).
Killing takes the whole tree down: the sandbox's pid-namespace init first, whose death
kills every process in the namespace (including ones that called ``setsid`` or
double-forked), then bwrap's process group. If this process itself dies, the nursery pid
namespace takes every sandbox it started with it.
"""

from __future__ import annotations

import ctypes
import fcntl
import marshal
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import suppress
from pathlib import Path
from typing import Any, Literal

from agent_gym.sandbox.config import Isolation, Limits
from agent_gym.sandbox.memory import Bound

_MAX_REPLY = 4096


# ---------------------------------------------------------------- long-lived helper threads
class _DaemonThread:
    """One daemon thread that lives as long as the process and runs what it is given.

    Every ``Popen`` runs on the ``spawner`` thread: bwrap's ``--die-with-parent`` is
    ``PR_SET_PDEATHSIG``, which fires when the *thread* that forked bwrap exits. Forking
    from a short-lived thread (an executor thread, a pool's refill callback) would kill
    healthy sandboxes; forking from this thread ties every sandbox to the life of the
    process, and to nothing shorter. The ``reaper`` thread tears used workers down off the
    caller's critical path.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            fn, future = self._queue.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        if threading.current_thread() is self._thread:
            future.set_result(fn())
        else:
            self._queue.put((fn, future))
        return future


_threads: dict[str, _DaemonThread] = {}
_threads_lock = threading.Lock()


def _reset_after_fork() -> None:
    # Threads do not survive fork; a child (e.g. a vector-env worker) starts its own
    # spawner thread and its own nursery.
    global _threads, _threads_lock, _nursery
    _threads, _threads_lock, _nursery = {}, threading.Lock(), None


os.register_at_fork(after_in_child=_reset_after_fork)


def _daemon(name: str) -> _DaemonThread:
    with _threads_lock:
        if name not in _threads:
            _threads[name] = _DaemonThread(f"sandbox-{name}")
        return _threads[name]


def spawner() -> _DaemonThread:
    return _daemon("spawner")


# ---------------------------------------------------------------- the nursery pid namespace
_CLONE_NEWPID = 0x20000000
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)
# pid 1 of the nursery: reaps whatever is orphaned inside it, and ends (taking the whole
# namespace with it) once the process it belongs to is gone. PR_SET_PDEATHSIG is not enough
# on its own: a nursery of a forked worker was found alive under the test run's subreaper
# after the worker had died. argv[1] is a pidfd of the owner, readable once it has exited;
# SIGCHLD wakes the same select through the wakeup fd, so the init never polls.
_NURSERY_INIT = """
import os, select, signal, sys
owner = int(sys.argv[1])
wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
signal.set_wakeup_fd(wake_w)
signal.signal(signal.SIGCHLD, lambda *_: None)
while True:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
    if owner in select.select([owner, wake_r], [], [])[0]:
        os._exit(0)
    try:
        os.read(wake_r, 512)
    except BlockingIOError:
        pass
"""
_nursery: subprocess.Popen[bytes] | None = None


def _tie_to(parent_pidfd: int) -> Callable[[], None]:
    def preexec() -> None:
        if _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os._exit(1)
        if select.select([parent_pidfd], [], [], 0)[0]:  # the parent died before prctl
            os._exit(1)

    return preexec


def enter_nursery() -> None:
    """Make the spawner thread fork into a pid namespace that dies with this process.

    bwrap's own ``--die-with-parent`` leaves a window: if the harness dies while bwrap is
    setting up (measured here: a kill within ~2 ms of a spawn often hit it), bwrap's setup
    child waits forever on an eventfd. So, when root, the spawner thread forks every sandbox
    into one pid namespace whose init is tied to this process by ``PR_SET_PDEATHSIG``; when
    the process dies the kernel kills everything in that namespace, nested sandbox
    namespaces and half-built ones included. Runs on the spawner thread (``unshare`` of a
    pid namespace only changes where the *calling thread's* children go). Without root
    there is no nursery and bwrap's ``--die-with-parent`` is the only tie.
    """
    global _nursery
    if os.geteuid() != 0 or (_nursery is not None and _nursery.poll() is None):
        return
    if _libc.unshare(_CLONE_NEWPID) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"unshare(CLONE_NEWPID): {os.strerror(errno)}")
    me = os.pidfd_open(os.getpid())
    try:
        _nursery = subprocess.Popen(
            [sys.executable, "-S", "-c", _NURSERY_INIT, str(me)],
            stdin=subprocess.DEVNULL,
            env={},
            pass_fds=[me],
            start_new_session=True,
            preexec_fn=_tie_to(me),
        )
    finally:
        os.close(me)


def nursery_pid() -> int | None:
    """The pid of this process's live nursery (the init of its sandboxes' pid namespace),
    if it has one: a process-leak check must not count it, it lives as long as we do."""
    return _nursery.pid if _nursery is not None and _nursery.poll() is None else None


def reaper() -> _DaemonThread:
    return _daemon("reaper")


# ---------------------------------------------------------------- one running worker
def output_file(name: str) -> int:
    """An anonymous in-memory file for one stream; ``RLIMIT_FSIZE`` caps what the code writes.

    ``O_APPEND`` makes the worker's writes land at the end, so after the host truncates the
    file between cells the next cell's output starts at offset 0.
    """
    fd = os.memfd_create(f"sandbox-{name}", os.MFD_CLOEXEC)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
    return fd


def read_tail(fd: int, limits: Limits) -> tuple[str, int]:
    """The last ``limits.output_bytes`` of an output file and how many bytes came before."""
    size = os.fstat(fd).st_size
    start = max(0, size - limits.output_bytes)
    data = os.pread(fd, size - start, start)
    return data.decode("utf-8", errors="replace"), start


TIMEOUT = object()


def _signal_name(number: int) -> str:
    with suppress(ValueError):
        return signal.Signals(number).name
    return f"signal {number}"


class WorkerProcess:
    """One sandboxed interpreter running ``_worker.py``, with the host's ends of its pipes.

    Not thread-safe: one caller drives it at a time (a pool hands each worker to one call).
    """

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        *,
        ctl_w: int,
        ctl_r: int,
        info_r: int | None,
        stdout: int,
        stderr: int,
        workdir: str | None,
        isolation: Isolation,
        limits: Limits,
        requests: socket.socket | None = None,
        memory: Bound | None = None,
    ) -> None:
        self.popen = popen
        self.memory = memory
        self.requests = requests
        self.pidfd = os.pidfd_open(popen.pid)
        self.isolation = isolation
        self.limits = limits
        self.ready = False
        self._ctl_w, self._ctl_r, self._info_r = ctl_w, ctl_r, info_r
        self._stdout, self._stderr = stdout, stderr
        self._workdir = workdir
        self._buffer = bytearray()
        self._eof = False
        self._info = b""
        self._info_done = False
        self._inner_pidfd: int | None = None
        self.inner_pid: int | None = None
        self._killed = False
        self._closed = False
        self._teardown = threading.Lock()

    # -- requests and replies
    def send(self, message: dict[str, Any], deadline: float) -> bool:
        """Write one request; False if the worker is gone or does not read it in time."""
        body = marshal.dumps(message)
        data = memoryview(len(body).to_bytes(4, "big") + body)
        poller = select.poll()
        poller.register(self._ctl_w, select.POLLOUT)
        while data:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                return False
            try:
                data = data[os.write(self._ctl_w, data) :]
            except BlockingIOError:
                continue
            except OSError:  # EPIPE: the worker is gone
                return False
        return True

    def receive(self, deadline: float) -> str | object | None:
        """The next reply line, ``None`` if the worker died first, ``TIMEOUT`` at the deadline.

        Replies come from the sandbox, so they are parsed as bounded plain text only.
        """
        poller = select.poll()
        poller.register(self._ctl_r, select.POLLIN)
        poller.register(self.pidfd, select.POLLIN)
        while True:
            line = self._next_line()
            if line is not None:
                return line
            if self._eof:
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return TIMEOUT
            events = dict(poller.poll(remaining * 1000))
            if events.get(self.pidfd):
                self._drain()
                return self._next_line()
            if events.get(self._ctl_r):
                self._drain()

    def _drain(self) -> None:
        while len(self._buffer) <= _MAX_REPLY:
            try:
                chunk = os.read(self._ctl_r, 4096)
            except BlockingIOError:
                return
            if not chunk:
                self._eof = True
                return
            self._buffer += chunk

    def _next_line(self) -> str | None:
        end = self._buffer.find(b"\n")
        if end < 0:
            if len(self._buffer) > _MAX_REPLY:
                self._eof = True  # no worker of ours writes this: treat the channel as broken
            return None
        line = self._buffer[:end].decode("utf-8", errors="replace")
        del self._buffer[: end + 1]
        return line

    def mark_ready(self) -> None:
        """Remember the namespace's init pid now, while it surely exists, to kill it later."""
        self.ready = True
        self._open_inner_pidfd()

    def _open_inner_pidfd(self) -> None:
        """bwrap writes ``{"child-pid": N, ...}`` to its info fd (in several writes) once it
        has cloned the sandbox's pid-namespace init, its only child."""
        if self._info_r is None or self._inner_pidfd is not None:
            return
        with suppress(BlockingIOError):
            while chunk := os.read(self._info_r, 4096):
                self._info += chunk
            self._info_done = True  # bwrap closed the fd: it wrote all it will write
        if b"child-pid" not in self._info:
            return
        # The pid bwrap reports is in its own pid namespace (the nursery's); the host pid of
        # its one child is in /proc.
        pid = self.popen.pid
        with suppress(OSError):
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            if children:
                self._inner_pidfd = os.pidfd_open(int(children[0]))
                self.inner_pid = int(children[0])

    def _await_inner_pidfd(self, timeout: float) -> None:
        """A worker killed while still starting: wait (briefly) until bwrap says which pid
        is the namespace's init, so it can be killed first rather than orphaned."""
        deadline = time.monotonic() + timeout
        while self._info_r is not None and self._inner_pidfd is None and not self._info_done:
            self._open_inner_pidfd()
            remaining = deadline - time.monotonic()
            if self._inner_pidfd is not None or remaining <= 0 or self.popen.poll() is not None:
                return
            select.select([self._info_r, self.pidfd], [], [], remaining)

    # -- output
    def clear_output(self) -> None:
        for fd in (self._stdout, self._stderr):
            os.ftruncate(fd, 0)

    @property
    def output_files(self) -> tuple[int, int]:
        return self._stdout, self._stderr

    def read_output(self, which: Literal["stdout", "stderr"]) -> tuple[str, int]:
        """The tail of one stream and how many bytes before it were dropped."""
        return read_tail(self._stdout if which == "stdout" else self._stderr, self.limits)

    def exit_description(self) -> str:
        """Why a worker died, in words a model can act on.

        Its memory bound kills with SIGKILL, and says so before the kill (which may still
        be under way: no exit status yet); an earlier kill of one of a notebook's other
        processes does not explain another death."""
        code = self.popen.poll()
        if code is None:
            number = 0
        elif code < 0:
            number = -code
        else:  # bwrap reports a signal as 128 + its number
            number = code - 128 if self.isolation == "bwrap" else 0
        killed = code is None or number == signal.SIGKILL
        if killed and self.memory is not None and self.memory.exceeded():
            return self.memory.description()
        if code is None:
            return "it stopped answering"
        if number == signal.SIGXCPU:
            return f"CPU time limit of {self.limits.cpu_seconds} s exceeded"
        if number > 0:
            return f"killed by {_signal_name(number)}"
        return f"exit code {code}"

    # -- teardown
    @property
    def alive(self) -> bool:
        return not self._killed and self.popen.poll() is None

    def wait_exit(self, timeout: float) -> int | None:
        """The exit status once the process has ended by itself within ``timeout``."""
        if self.popen.poll() is None:
            select.select([self.pidfd], [], [], timeout)
        return self.popen.poll()

    def wait_gone(self, timeout: float) -> bool:
        """Whether the sandbox ended by itself within ``timeout``, every process of it.

        bwrap exits as soon as its namespace's init reports the worker's exit; the init (and
        with it everything left in the namespace, which the kernel kills when it dies) is
        gone only later, so that is waited for too. Without a namespace (``rlimits``) it is
        the worker alone.
        """
        deadline = time.monotonic() + timeout
        if self.wait_exit(timeout) is None:
            return False
        if self._inner_pidfd is None:
            return True
        remaining = max(0.0, deadline - time.monotonic())
        return bool(select.select([self._inner_pidfd], [], [], remaining)[0])

    def terminate(self) -> None:
        """Kill the whole tree and wait until every process of it is gone; idempotent.

        With bwrap the namespace's init is killed first: its death takes every process in
        the pid namespace with it (escapees that called ``setsid`` or double-forked
        included), and bwrap, its parent, reaps it and exits, so no orphan is left for the
        host's init to reap. bwrap's process group is killed after that in any case. The
        output files stay readable until ``close``.
        """
        with self._teardown:
            self._terminate()

    def kill(self) -> None:
        """SIGKILL the whole tree, without waiting or releasing anything: for another thread
        (the memory watcher) while the owner may be reading the worker's pipes. Closing
        them under the owner would fail its read, or worse, let the descriptor be reused
        by another file; the owner sees the worker die and tears it down (``terminate``)
        as after any death. Under the teardown lock, so no descriptor it signals through
        can have been closed."""
        with self._teardown:
            if self._killed:
                return
            if self._inner_pidfd is not None:
                with suppress(ProcessLookupError):
                    signal.pidfd_send_signal(self._inner_pidfd, signal.SIGKILL)
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            with suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def _terminate(self) -> None:
        if self._killed:
            return
        self._killed = True
        self._await_inner_pidfd(1.0)
        if self._inner_pidfd is not None:
            with suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._inner_pidfd, signal.SIGKILL)
            # The namespace init exits only after every process in its namespace is gone.
            select.select([self._inner_pidfd], [], [], 10.0)
            self.wait_exit(1.0)
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        self.popen.wait()
        if self.memory is not None:
            self.memory.close()  # every process of the sandbox is gone
        for fd in (self.pidfd, self._ctl_w, self._ctl_r, self._info_r, self._inner_pidfd):
            if fd is not None:
                os.close(fd)
        if self.requests is not None:
            self.requests.close()

    def close(self) -> None:
        """Terminate the worker and release its files; idempotent and thread-safe."""
        with self._teardown:
            self._terminate()
            if self._closed:
                return
            self._closed = True
            self._release()

    def _release(self) -> None:
        os.close(self._stdout)
        os.close(self._stderr)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
