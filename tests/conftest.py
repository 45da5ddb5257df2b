"""Shared test setup: every test imports agent_gym so the envs are registered, and the run
fails when a sandbox process outlives it.

A clean `make test` once left the sandbox's pid-namespace init (the "nursery") running with
parent 1, fifty minutes after pytest had exited. So the session makes itself a *child
subreaper*: whatever the run orphans is reparented to pytest instead of to pid 1, and at the
end the run's own descendants -- and only those: other runs on the same machine are none of
its business -- are searched for sandbox processes (bwrap, pid-namespace inits, anything
running as uid 65534). Processes the run still legitimately holds are not leftovers: the
pytest process's own nursery, which by design lives exactly as long as pytest does, and
workers still being torn down (killed sandboxes are reaped in the background), which get a
grace period to disappear. Like init, the session reaps the orphans it adopts (see
`reap_adopted_orphans`). Leftovers are named, killed, and fail the run.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import agent_gym  # noqa: F401
from agent_gym.hoststore import STORE_PATH_ENV
from agent_gym.sandbox.process import nursery_pid

# One torch thread per test process (`make test` runs one pytest worker per core): the local
# backend's default takes the free cores, and on a loaded 2-core machine two threads ran up
# to 13x slower than one.
os.environ.setdefault("AGENT_GYM_THREADS", "1")
# The host store defaults to a file in the user's cache: each session (each xdist worker)
# has its own instead, new at the start and removed at exit, so tests neither read what a
# host computed before nor leave anything there. Subprocesses inherit it.
_HOST_STORE_DIR = tempfile.TemporaryDirectory(prefix="agent-gym-test-host-store-")
os.environ[STORE_PATH_ENV] = str(Path(_HOST_STORE_DIR.name) / "host_store.sqlite")

NOBODY = 65534  # the uid sandboxes run as when the host is root
LEFTOVER_GRACE = 10.0  # seconds for torn-down sandboxes to finish exiting
_PR_SET_CHILD_SUBREAPER = 36
_LEFTOVER_KEY = "leftover process"


@dataclass(frozen=True)
class Process:
    """What the check needs to know of one process, read from ``/proc``."""

    pid: int
    name: str  # the kernel's command name, kept when the command line is gone (exiting)
    ppid: int
    uids: tuple[int, ...]  # real, effective, saved, filesystem
    state: str
    pid_ns: str  # the ``ns/pid`` link, e.g. "pid:[4026532281]"
    namespace_init: bool  # pid 1 of a pid namespace nested in the host's
    cmdline: str

    @property
    def is_sandbox(self) -> bool:
        argv0 = self.cmdline.split(" ", 1)[0]
        return NOBODY in self.uids or Path(argv0).name == "bwrap" or self.namespace_init

    def describe(self) -> str:
        command = self.cmdline if len(self.cmdline) <= 300 else self.cmdline[:300] + "..."
        return (f"pid {self.pid} [{self.name}] (uid {self.uids[1]}, parent {self.ppid}, "
                f"state {self.state}): {command!r}")


def read_process(pid: int) -> Process | None:
    """The process ``pid``, or None if it is gone (or was never readable)."""
    base = Path("/proc") / str(pid)
    try:
        stat = (base / "stat").read_text()
        status = (base / "status").read_text()
        cmdline = (base / "cmdline").read_bytes()
        pid_ns = os.readlink(base / "ns" / "pid")
    except OSError:
        return None
    name = stat[stat.index("(") + 1 : stat.rindex(")")]  # it may hold spaces and ")"
    fields = stat[stat.rindex(")") + 2 :].split()
    lines = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    nspids = lines.get("NSpid", "").split()
    return Process(
        pid=pid,
        name=name,
        ppid=int(fields[1]),
        uids=tuple(int(u) for u in lines["Uid"].split()),
        state=fields[0],
        pid_ns=pid_ns,
        namespace_init=len(nspids) > 1 and nspids[-1] == "1",
        cmdline=cmdline.replace(b"\0", b" ").decode(errors="replace").strip(),
    )


def descendants(root: int) -> Iterator[Process]:
    """Every process below ``root`` in the host's process tree."""
    processes = [p for p in map(read_process, _pids()) if p is not None]
    children: dict[int, list[Process]] = {}
    for process in processes:
        children.setdefault(process.ppid, []).append(process)
    stack = list(children.get(root, []))
    while stack:
        process = stack.pop()
        yield process
        stack.extend(children.get(process.pid, []))


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _own_nursery_namespaces() -> set[str]:
    """The pid namespaces this process's threads fork into: their init is its nursery.

    The thread that made the nursery may have ended (a worker thread of a pool), so the
    nursery the sandbox module holds is asked for its namespace too."""
    namespaces = set()
    pid = nursery_pid()
    if pid is not None:
        with contextlib.suppress(OSError):  # it ended meanwhile
            namespaces.add(os.readlink(f"/proc/{pid}/ns/pid"))
    for tid in os.listdir("/proc/self/task"):
        try:
            namespaces.add(os.readlink(f"/proc/self/task/{tid}/ns/pid_for_children"))
        except OSError:  # the thread ended meanwhile
            continue
    return namespaces


def reap_adopted_orphans() -> None:
    """Reap the zombies this process adopted, as subreaper, from other pid namespaces.

    A subreaper stands in for init, and init reaps: a test that kills a harness leaves the
    harness's sandboxes dead but unreaped, and their nursery, the init of their namespace,
    cannot finish dying until every process of the namespace is reaped (it would wait in
    exit, with no command line, for as long as the run lasts). Only zombies of *other*
    namespaces are reaped: a zombie of this process's own namespaces may belong to a
    ``Popen`` that will still wait for it.
    """
    ours = {os.readlink("/proc/self/ns/pid"), *_own_nursery_namespaces()}
    for process in map(read_process, _pids()):
        if (process is not None and process.ppid == os.getpid() and process.state == "Z"
                and process.pid_ns not in ours):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(process.pid, os.WNOHANG)


def leftover_processes(root: int | None = None) -> list[Process]:
    """Live sandbox processes descending from ``root`` (this process), its nursery aside."""
    root = os.getpid() if root is None else root
    own = _own_nursery_namespaces() if root == os.getpid() else set()
    return [
        p for p in descendants(root)
        if p.state != "Z" and p.is_sandbox and not (p.namespace_init and p.pid_ns in own)
    ]


def pytest_configure(config: pytest.Config) -> None:
    """Become the child subreaper, before any test starts a process (see the module doc)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the ``slow`` tests first. Each takes one to two minutes (fresh venvs and pip,
    every ALFWorld walkthrough); started last, they leave the other worker idle until they
    end, while started first the short tests fill the cores around them."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run, naming them, if sandbox processes outlive the grace period."""
    if not sys.platform.startswith("linux"):
        return
    deadline = time.monotonic() + LEFTOVER_GRACE
    reap_adopted_orphans()
    left = leftover_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        reap_adopted_orphans()
        left = leftover_processes()
    if not left:
        return
    for process in left:  # named below; killed so they cannot linger for an hour
        try:
            os.kill(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        for process in left:
            print(f"leftover sandbox process: {process.describe()}", file=sys.stderr)
    else:
        reporter.stats.setdefault(_LEFTOVER_KEY, []).extend(left)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    left = terminalreporter.stats.get(_LEFTOVER_KEY)
    if left:
        terminalreporter.write_sep("=", "sandbox processes left behind by the run", red=True)
        for process in left:
            terminalreporter.write_line(process.describe())
        terminalreporter.write_line(
            "they were killed; a test or fixture did not close an env, pool or sandbox"
        )
