"""Memory bounded per sandbox: all of a sandbox's processes together, not each one.

``RLIMIT_AS`` (``Limits.memory_bytes``) caps one process's address space, so a cell that
forks could hold ``processes`` times that much. Every sandbox (on the fork-server, every
call) is therefore bounded as a whole too, by the first of two mechanisms this host allows,
chosen once per process and named by the sandboxes' ``memory_bound`` attribute and a log
line. Both count what the kernel charges a sandbox for, against one limit
(``sandbox_limit``): its processes' pages, the files in its ``/tmp`` and ``/dev/shm``, and
shared memory with no file name (``memfd_create``), whose pages are in no process's
resident set (docs/experiments/sandbox.md has what counting only those sets let through).

``cgroup-v1`` / ``cgroup-v2``
    A memory cgroup per sandbox, made under this process's own memory cgroup (so whatever
    bounds this process still bounds its sandboxes) and removed with it; the kernel's OOM
    killer enforces it. Needs write access to this process's cgroup (root, or a delegated
    one) and, under cgroup v2, the memory controller enabled for its children.

``watcher``
    Elsewhere, one thread adds up what each sandbox holds every ``WATCH_INTERVAL`` and
    kills the sandbox once the sum is over the limit (``_held``): its processes'
    proportional set sizes, the memfd files they hold open and the space used in its own
    ``/tmp`` and ``/dev/shm`` (each file once: a mapping of a file counted whole is left out
    of the sets). A sandbox can be over for up to one interval before it dies. Not seen: a
    memfd kept only through a mapping smaller than the file (its fd closed), whose size only
    ``/proc/PID/map_files`` tells, which needs ``CAP_SYS_ADMIN``.

A sandbox killed for its memory says so in its result (``Bound.exceeded``)."""
from __future__ import annotations

import errno
import functools
import logging
import os
import select
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import suppress
from typing import Literal, get_args

from agent_gym.sandbox.config import Limits, SandboxError

log = logging.getLogger(__name__)

MemoryBound = Literal["auto", "cgroup", "watcher"]  # what a caller asks for
MEMORY_BOUNDS: tuple[MemoryBound, ...] = get_args(MemoryBound)
Mechanism = Literal["cgroup-v1", "cgroup-v2", "watcher"]
WATCH_INTERVAL = 0.05
# What a sandbox's own machinery holds besides its code's memory (bwrap's two processes,
# the kernel's page tables): this much plus 1/64 of ``memory_bytes``.
_MACHINERY_BYTES = 8 << 20
_PREFIX = "agent-gym-"
_PAGE = os.sysconf("SC_PAGE_SIZE")


def held_limit(limits: Limits, warm: int = 0) -> int:
    """The most all of one sandbox's processes may hold together: what one may address
    (``memory_bytes``), the warm interpreter's pages a fork-server call may copy (``warm``)
    and the machinery's allowance. One process alone hits its own ``RLIMIT_AS`` (a
    ``MemoryError`` the code can handle) first."""
    return limits.memory_bytes + warm + limits.memory_bytes // 64 + _MACHINERY_BYTES


def sandbox_limit(limits: Limits, warm: int = 0) -> int:
    """The bound on one sandbox, a cgroup's or the watcher's: ``held_limit`` and its ``/tmp``
    and ``/dev/shm``, which both count as well."""
    return held_limit(limits, warm) + 2 * limits.tmp_bytes


def _limit_words(limit: int) -> str:
    return f"the sandbox's memory limit of {limit >> 20} MB (all its processes together)"


class Bound(ABC):
    """The memory bound of one sandbox (or one fork-server call)."""

    mechanism: Mechanism
    limit: int

    @abstractmethod
    def exceeded(self) -> bool:
        """Whether the bound killed one of the sandbox's processes for its memory."""

    def description(self) -> str:
        """Why the sandbox died, in words a model can act on."""
        return f"{_limit_words(self.limit)} was exceeded"

    @abstractmethod
    def close(self) -> None:
        """Stop bounding (the sandbox's processes are gone); idempotent."""


# ---------------------------------------------------------------- cgroups
class Cgroup(Bound):
    """One sandbox's memory cgroup, with its door open: the file a process writes ``0`` to
    in order to enter it (``join``), by itself, right after its fork. A cgroup v1 move of
    one thread (``tasks``) skips the global lock that moving a pid (``cgroup.procs``, all
    v2 has) takes for an RCU grace period; the kernel checks a write against the opener's
    credentials, so a fork-server's child (uid 65534, namespaces of its own) enters through
    a copy passed to it. The next call reuses the cgroup once the last one's processes are
    gone (``rearm``)."""

    def __init__(self, tree: _Tree, path: str, limit: int) -> None:
        self.mechanism = tree.mechanism
        self.limit = limit
        self.path = path
        self._tree = tree
        self._kills_before = 0
        self._exceeded = False
        self._closed = False
        memory, swap = tree.limit_files(limit)
        try:
            _write(f"{path}/{memory[0]}", memory[1])
            if os.path.exists(f"{path}/{swap[0]}"):  # swap accounting is on
                _write(f"{path}/{swap[0]}", swap[1])
            self._events = os.open(f"{path}/{tree.events_file}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                self.door = os.open(f"{path}/{tree.door_file}", os.O_WRONLY | os.O_CLOEXEC)
            except BaseException:
                os.close(self._events)
                raise
        except BaseException:
            tree.remove(path)
            raise

    def join(self) -> None:
        """Enter it (a spawned child, single-threaded, before it execs)."""
        os.write(self.door, b"0")

    def _kills(self) -> int:
        text = os.pread(self._events, 4096, 0).decode()
        return next(
            (int(line.split()[1]) for line in text.splitlines() if line.startswith("oom_kill ")), 0
        )

    def exceeded(self) -> bool:
        if not self._closed:
            self._exceeded = self._kills() > self._kills_before
        return self._exceeded

    def rearm(self) -> None:
        """Start counting afresh for the next call (its processes are all gone)."""
        self._kills_before = self._kills()

    def close(self) -> None:
        """Remove the cgroup (its processes are gone); ``exceeded`` keeps its answer."""
        if self._closed:
            return
        self.exceeded()
        self._closed = True
        os.close(self.door)
        os.close(self._events)
        self._tree.remove(self.path)


def _write(path: str, value: str) -> None:
    with open(path, "wb", buffering=0) as handle:  # one write(2), as a cgroup file wants
        handle.write(value.encode())


def _unescape(field: str) -> str:
    """A path from ``/proc/self/mountinfo``, where space, tab, newline and backslash are octal."""
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field


def _own_memory_cgroup() -> tuple[int, str]:
    """The cgroup version and directory of this process's memory cgroup, or OSError."""
    v1_path = v2_path = None
    with open("/proc/self/cgroup") as handle:
        for line in handle:
            hierarchy, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                v1_path = path
            elif hierarchy == "0" and not controllers:
                v2_path = path
    mounts: dict[str, tuple[str, str]] = {}
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            fields, _, tail = line.partition(" - ")
            fstype, _source, options = [*tail.split(), "", ""][:3]
            root, point = (_unescape(f) for f in fields.split()[3:5])
            if fstype == "cgroup" and "memory" in options.split(","):
                mounts["v1"] = (root, point)
            elif fstype == "cgroup2":
                mounts.setdefault("v2", (root, point))
    for version, path in ((1, v1_path), (2, v2_path)):
        key = f"v{version}"
        if path is None or key not in mounts:
            continue
        root, point = mounts[key]
        if path != root and not path.startswith(root.rstrip("/") + "/"):
            continue  # a cgroup outside what is mounted here (another cgroup namespace)
        directory = os.path.normpath(os.path.join(point, os.path.relpath(path, root)))
        if version == 1 or "memory" in _read(f"{directory}/cgroup.controllers").split():
            return version, directory
    raise OSError(errno.ENOENT, "no memory cgroup controller is mounted for this process")


def _read(path: str) -> str:
    with open(path) as handle:
        return handle.read()


class _Tree:
    """This process's sandbox cgroups: ``<own cgroup>/agent-gym-<pid>/s<n>``.

    The directory is made at the first sandbox and removed with the last. The ones a process
    that died left behind (its sandboxes died with it) are removed then too (``reclaim``)."""

    def __init__(self, version: int, own: str) -> None:
        self.version = version
        self.mechanism: Mechanism = "cgroup-v1" if version == 1 else "cgroup-v2"
        self.events_file = "memory.oom_control" if version == 1 else "memory.events"
        self.door_file = "tasks" if version == 1 else "cgroup.procs"
        self.own = own
        self.base = f"{own}/{_PREFIX}{os.getpid()}"
        self._lock = threading.Lock()
        self._live = 0
        self._count = 0

    def limit_files(self, limit: int) -> tuple[tuple[str, str], tuple[str, str]]:
        """The file and value that set the limit, and those that bound swap (memory and swap
        together under v1, no swap at all under v2)."""
        if self.version == 1:
            limit_v1 = ("memory.limit_in_bytes", str(limit))
            return limit_v1, ("memory.memsw.limit_in_bytes", str(limit))
        return ("memory.max", str(limit)), ("memory.swap.max", "0")

    def create(self, limit: int) -> Cgroup:
        with self._lock:
            try:
                if self._live == 0:
                    reclaim(self.own)
                    with suppress(FileExistsError):
                        os.mkdir(self.base, 0o755)
                    if self.version == 2:
                        _write(f"{self.base}/cgroup.subtree_control", "+memory")
                self._count += 1
                path = f"{self.base}/s{self._count}"
                os.mkdir(path, 0o755)
            except OSError:
                if self._live == 0:
                    self._drop_base()
                raise
            self._live += 1
        return Cgroup(self, path, limit)

    def remove(self, path: str) -> None:
        """Remove one sandbox's cgroup, and the directory with the last one."""
        try:
            _rmdir(path)
        except OSError as err:
            log.warning("could not remove the sandbox cgroup %s: %s", path, err)
        with self._lock:
            self._live -= 1
            if self._live == 0:
                self._drop_base()
                reclaim(self.own)

    def _drop_base(self) -> None:
        with suppress(OSError):
            os.rmdir(self.base)


def _rmdir(path: str, patience: float = 2.0) -> None:
    """Remove an empty cgroup. Its last processes may still be leaving it (an exiting
    process is in its cgroup until the kernel has torn it down), hence the short wait."""
    deadline = time.monotonic() + patience
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as err:
            if err.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def reclaim(own: str | None = None) -> list[str]:
    """Remove (and return) the sandbox cgroups of processes that died without removing them."""
    if own is None:
        try:
            own = _own_memory_cgroup()[1]
        except OSError:
            return []
    removed = []
    with suppress(OSError), os.scandir(own) as entries:
        for entry in entries:
            pid = entry.name.removeprefix(_PREFIX)
            if entry.name == pid or not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
                continue
            with suppress(OSError), os.scandir(entry.path) as cgroups:
                for cgroup in cgroups:
                    if cgroup.is_dir():
                        with suppress(OSError):  # still emptying: the next time
                            _rmdir(cgroup.path, patience=0)
            with suppress(OSError):
                os.rmdir(entry.path)
                removed.append(entry.path)
    return removed


def leftover_cgroups() -> list[str]:
    """This process's sandbox cgroups that still exist (none once every sandbox is closed)."""
    try:
        own = _own_memory_cgroup()[1]
    except OSError:
        return []
    base = f"{own}/{_PREFIX}{os.getpid()}"
    return [base] if os.path.isdir(base) else []


# ---------------------------------------------------------------- the watcher
class Watch(Bound):
    """One sandbox (a process tree) as the watcher sees it: registered with ``start``."""

    mechanism: Mechanism = "watcher"

    def __init__(self, watcher: _Watcher, limit: int) -> None:
        self.limit = limit
        self._watcher = watcher
        self._pidfd: int | None = None
        self.root = 0
        self._kill: Callable[[], None] = lambda: None
        self._exceeded = False

    def start(self, pid: int, kill: Callable[[], None] | None = None) -> None:
        """Watch the tree under ``pid``; ``kill`` (by default SIGKILL to ``pid``) ends it."""
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return  # already gone
        self.root = pid
        pidfd = self._pidfd
        self._kill = kill or (lambda: signal.pidfd_send_signal(pidfd, signal.SIGKILL))
        self._watcher.add(self)

    def alive(self) -> bool:
        return self._pidfd is not None and not select.select([self._pidfd], [], [], 0)[0]

    def over(self) -> None:
        """Called by the watcher when the tree holds more than the limit."""
        self._exceeded = True
        with suppress(ProcessLookupError):
            self._kill()

    def exceeded(self) -> bool:
        return self._exceeded

    def close(self) -> None:
        self._watcher.remove(self)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def _children(pid: int) -> list[int]:
    found: list[int] = []
    with suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as handle:
                found += (int(p) for p in handle.read().split())
    return found


def _tree(root: int) -> list[int]:
    """Every process under ``root`` (an orphan in a sandbox's pid namespace is its init's)."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += _children(pid)
    return found


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as handle:
            return int(handle.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


Inode = tuple[int, int]  # (st_dev, st_ino)


def _memfds(pids: list[int]) -> dict[Inode, int]:
    """The memfd files the processes hold open, each once, with the bytes it holds."""
    found: dict[Inode, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            path = f"/proc/{pid}/fd/{fd}"
            try:
                if os.readlink(path).startswith("/memfd:"):
                    st = os.stat(path)
                    found[st.st_dev, st.st_ino] = st.st_blocks * 512
            except OSError:
                continue  # closed meanwhile
    return found


@functools.cache
def _host_tmpfs() -> frozenset[int]:
    """The devices of this process's ``/tmp`` and ``/dev/shm``, which a sandbox process
    that sees them (bwrap's outer one, an ``rlimits`` worker) does not own."""
    found = set()
    for path in ("/tmp", "/dev/shm"):
        with suppress(OSError):
            found.add(os.stat(path).st_dev)
    return frozenset(found)


def _tmpfs(pids: list[int]) -> dict[int, int]:
    """The bytes used in the sandbox's own ``/tmp`` and ``/dev/shm``, by device (through each
    process's root: a fork-server call mounts its own)."""
    found: dict[int, int] = {}
    host = _host_tmpfs()
    for pid in pids:
        for name in ("tmp", "dev/shm"):
            path = f"/proc/{pid}/root/{name}"
            try:
                device = os.stat(path).st_dev
                if device not in host and device not in found:
                    fs = os.statvfs(path)
                    found[device] = (fs.f_blocks - fs.f_bfree) * fs.f_frsize
            except OSError:
                continue
    return found


def _pss(pid: int, files: dict[Inode, int], devices: dict[int, int]) -> int:
    """The proportional set size of ``pid``, less its mappings of files counted whole (an
    open memfd, a file in the sandbox's tmpfs). With none of those, the kernel's sum."""
    if not files and not any(devices.values()):
        with suppress(OSError, IndexError, ValueError), open(f"/proc/{pid}/smaps_rollup") as f:
            return next((int(line.split()[1]) << 10 for line in f if line.startswith("Pss:")), 0)
        return 0
    total, counted = 0, False
    with suppress(OSError, IndexError, ValueError), open(f"/proc/{pid}/smaps") as handle:
        for line in handle:
            first, _, rest = line.partition(" ")
            if first == "Pss:":
                total += 0 if counted else int(rest.split()[0]) << 10
            elif not first.endswith(":"):  # a mapping's header: range perms offset dev inode
                major, minor = rest.split()[2].split(":")
                device = os.makedev(int(major, 16), int(minor, 16))
                inode = int(rest.split()[3])
                counted = (device, inode) in files or device in devices
    return total


def _held(pids: list[int], limit: int) -> int:
    """What the processes hold together, as far as it decides whether they are over
    ``limit``: files whole, then resident sets (cheap, but a shared page counts once per
    sharer); only when those add up to more, the proportional sets (every page table)."""
    files, devices = _memfds(pids), _tmpfs(pids)
    whole = sum(files.values()) + sum(devices.values())
    held = whole + sum(map(_rss, pids))
    if held <= limit:
        return held
    return whole + sum(_pss(pid, files, devices) for pid in pids)


class _Watcher:
    """One daemon thread that checks every watched sandbox each ``WATCH_INTERVAL``.

    A pass holds the lock, so once ``remove`` returns no check of that watch is under way
    (its pidfd may be closed)."""

    def __init__(self) -> None:
        self._watches: set[Watch] = set()
        self._lock = threading.Condition(threading.RLock())
        self._thread = threading.Thread(target=self._loop, name="sandbox-memory", daemon=True)
        self._thread.start()

    def add(self, watch: Watch) -> None:
        with self._lock:
            self._watches.add(watch)
            self._lock.notify()

    def remove(self, watch: Watch) -> None:
        with self._lock:
            self._watches.discard(watch)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._watches:
                    self._lock.wait()
                for watch in list(self._watches):
                    self.check(watch)
            time.sleep(WATCH_INTERVAL)

    def check(self, watch: Watch) -> None:
        """Kill a sandbox that holds more than its limit."""
        if not watch.alive():
            return
        if _held(_tree(watch.root), watch.limit) > watch.limit:
            self.remove(watch)
            watch.over()


_watcher: _Watcher | None = None
_lock = threading.Lock()
# This process's cgroup tree, or why it has none; by process id: a forked child (a vector
# env's worker) checks for itself, and makes its own.
_trees: dict[int, _Tree | OSError] = {}


def _the_watcher() -> _Watcher:
    global _watcher
    with _lock:
        if _watcher is None:
            _watcher = _Watcher()
        return _watcher


# ---------------------------------------------------------------- choosing
def _cgroups() -> _Tree:
    """This process's cgroup tree, checked once by making and removing one cgroup."""
    with _lock:
        known = _trees.get(os.getpid())
        if known is None:
            try:
                tree = _Tree(*_own_memory_cgroup())
                tree.create(sandbox_limit(Limits())).close()
                known = tree
            except OSError as err:
                known = err
            _trees[os.getpid()] = known
    if isinstance(known, OSError):
        raise known
    return known


def _reset_after_fork() -> None:
    global _watcher, _lock
    _watcher, _lock = None, threading.Lock()  # threads and held locks do not survive fork


os.register_at_fork(after_in_child=_reset_after_fork)


class SandboxMemory:
    """How this process bounds each sandbox's memory (see the module docstring).

    ``requested``: ``"auto"`` (a cgroup where this host allows one, else the watcher),
    ``"cgroup"`` (raise where none can be made) or ``"watcher"`` (forced: the fallback).
    """

    def __init__(self, requested: MemoryBound = "auto") -> None:
        if requested not in MEMORY_BOUNDS:
            raise ValueError(f"memory_bound must be one of {MEMORY_BOUNDS}, got {requested!r}")
        self._tree: _Tree | None = None
        reason = ""
        if requested != "watcher":
            try:
                self._tree = _cgroups()
            except OSError as err:
                reason = str(err)
                if requested == "cgroup":
                    raise SandboxError(
                        f"no memory cgroup can be made for the sandbox here ({reason}); "
                        "memory_bound='watcher' bounds it without one"
                    ) from None
        self.mechanism: Mechanism = self._tree.mechanism if self._tree else "watcher"
        self.reason = reason

    def bound(self, limits: Limits, warm: int = 0) -> Bound:
        """A fresh bound for one sandbox: a cgroup ready to be joined, or a watch to start."""
        if self._tree is None:
            return Watch(_the_watcher(), sandbox_limit(limits, warm))
        try:
            return self._tree.create(sandbox_limit(limits, warm))
        except OSError as err:
            raise SandboxError(f"could not make the sandbox's memory cgroup: {err}") from err

    def describe(self, limits: Limits) -> str:
        """One line for the log: the mechanism and the limit it enforces."""
        if self._tree is not None:
            return (
                f"a memory cgroup per sandbox ({self.mechanism}) under {self._tree.own}: "
                f"{sandbox_limit(limits) >> 20} MB for its processes and files together"
            )
        why = f" (no cgroup: {self.reason})" if self.reason else ""
        return (
            f"the memory watcher{why}: a sandbox whose processes and files hold more than "
            f"{sandbox_limit(limits) >> 20} MB together is killed within "
            f"{WATCH_INTERVAL * 1000:g} ms"
        )
