"""The program that runs inside the sandbox: a tiny notebook kernel on two pipes.

It is standard library only and is handed to the interpreter with ``-c`` (never imported by
the host process), so nothing from the project has to be visible inside the sandbox. It
applies the resource limits to itself before it reads any model code, which is why the host
needs no ``preexec_fn`` for them and why ``RLIMIT_NPROC`` counts only this sandbox's
processes (it is set inside bwrap's user namespace, not on bwrap).

Protocol on two inherited pipe fds. Host to worker: length-prefixed ``marshal`` blobs, first
the configuration, then one ``{"code": str}`` per cell. Worker to host: text lines,
``ready`` once, then ``ok`` or ``error <ExceptionName>`` per cell. Output goes to fds 1 and 2,
which the host points at capped in-memory files. A single-use worker exits after its one
cell; a persistent one keeps its globals between cells. Startup imports are kept to the
minimum because they are paid on every stateless call.

With ``"forkserver": true`` in the configuration the program is instead a fork-server (see
``_serve``): it imports the modules of ``preload_optional`` once (the standard library a
cell reaches for, and in one of the two servers the math stack), then forks one fully
isolated child per request received on a third fd, a unix socket.
"""

import _ast
import _frozen_importlib_external
import _signal
import builtins
import io
import marshal
import os
import resource
import sys

_MAX_REQUEST = 64 << 20
# Streams whose flush failed (output cap reached); kept alive so their stale buffer is never
# written into a later cell's output.
_broken_streams: list[object] = []


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks: list[bytes] = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _receive(fd: int) -> object:
    """One request from the host (trusted, so ``marshal`` is safe and imports nothing)."""
    header = _read_exact(fd, 4)
    if header is None:
        return None
    size = int.from_bytes(header, "big")
    if size > _MAX_REQUEST:
        return None
    body = _read_exact(fd, size)
    return None if body is None else marshal.loads(body)


def _send(fd: int, *words: str) -> None:
    """One reply line; the host parses it as untrusted text, never with marshal or pickle."""
    line = " ".join(w.replace("\n", " ")[:200] for w in words) + "\n"
    data = line.encode("utf-8", errors="replace")
    while data:
        data = data[os.write(fd, data) :]


class _SeedRandomOnImport:
    """Seeds ``random`` (or ``numpy.random``) with 0 when a cell first imports it, so
    replays print the same.

    Importing it up front to seed it cost 1-3 ms of every start (and, in the fork-server,
    ~0.8 ms of every fork: numpy.random's pages); this finder hands out the normal spec with
    a loader that seeds the module right after executing it.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = _frozen_importlib_external.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _SeedingLoader(spec.loader)
        return spec


class _SeedingLoader:
    def __init__(self, loader: object) -> None:
        self._loader = loader

    def create_module(self, spec: object) -> object:
        return self._loader.create_module(spec)

    def exec_module(self, module: object) -> None:
        self._loader.exec_module(module)
        module.seed(0)


def _new_streams() -> tuple:
    """Unused text streams on fds 1 and 2 (whatever files those fds are when written to)."""
    return tuple(
        io.TextIOWrapper(
            io.BufferedWriter(io.FileIO(fd, "w", closefd=False), 8192),
            encoding="utf-8",
            errors="backslashreplace",
        )
        for fd in (1, 2)
    )


def _use_streams(streams: tuple) -> None:
    for name, stream in zip(("stdout", "stderr"), streams, strict=True):
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _fresh_streams() -> None:
    _use_streams(_new_streams())


def _flush_streams() -> None:
    """Flush cell output; a stream that cannot flush (output cap reached) is replaced."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            stream.flush()
        except (OSError, ValueError):
            _broken_streams.append(stream)
            _fresh_streams()
            return


def _apply_limits(limits: dict) -> None:
    pairs = (
        (resource.RLIMIT_AS, limits["memory_bytes"]),
        (resource.RLIMIT_FSIZE, limits["file_bytes"]),
        (resource.RLIMIT_NOFILE, limits["open_files"]),
        (resource.RLIMIT_NPROC, limits["processes"]),
        (resource.RLIMIT_CORE, 0),
    )
    for which, value in pairs:
        resource.setrlimit(which, (value, value))
    if limits["single"]:
        cpu = limits["cpu_seconds"]
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))


def _cpu_budget_for_next_cell(seconds: int) -> None:
    """A persistent worker's CPU time accumulates, so each cell gets ``seconds`` more."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = int(usage.ru_utime + usage.ru_stime) + 1
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    soft = used + seconds
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _print_exception(exc: BaseException, name: str, code: str) -> None:
    """Print a traceback that starts in the cell and quotes its lines (imported lazily: the
    traceback machinery costs a few ms of every start, and most cells never need it).

    Printing must never kill the worker, or the cell's own error is lost: after a
    ``MemoryError`` the cell's data may still fill the address-space limit, so importing
    ``traceback`` can fail too, and a cell may have poisoned ``sys.modules``. Then a plain
    traceback is built from the frames by hand, with no import.
    """
    if isinstance(exc, MemoryError):
        _release_reserve()
    tb = exc.__traceback__
    if tb is not None:
        tb = tb.tb_next  # the worker's own frame (_run_cell)
    try:
        import contextlib
        import linecache
        import traceback

        linecache.cache[name] = (len(code), None, code.splitlines(True), name)
        with contextlib.suppress(Exception):  # stderr may be full; the status still tells
            traceback.print_exception(type(exc), exc, tb, file=sys.stderr)
    except BaseException:  # anything raised here would end the worker
        _print_bare_exception(exc, tb, name, code)


def _print_bare_exception(exc: BaseException, tb: object, name: str, code: str) -> None:
    """The traceback without the ``traceback`` module; if even this fails, the name alone."""
    try:
        lines = ["Traceback (most recent call last):\n"]
        while tb is not None:
            frame_code = tb.tb_frame.f_code
            where = f"line {tb.tb_lineno}, in {frame_code.co_name}"
            lines.append(f'  File "{frame_code.co_filename}", {where}\n')
            if frame_code.co_filename == name:
                source = code.splitlines()
                if 0 < tb.tb_lineno <= len(source):
                    lines.append(f"    {source[tb.tb_lineno - 1].strip()}\n")
            tb = tb.tb_next
        try:
            message = str(exc)
        except BaseException:  # a cell's own __str__ may raise
            message = ""
        lines.append(f"{type(exc).__name__}: {message}\n" if message else f"{type(exc).__name__}\n")
        sys.stderr.write("".join(lines))
        sys.stderr.flush()
    except BaseException:
        try:  # noqa: SIM105 (no contextlib here: its import may be what failed)
            os.write(2, type(exc).__name__.encode() + b"\n")
        except BaseException:  # stderr is gone; the status line still tells
            pass


def _run_cell(code: str, namespace: dict, index: int) -> tuple[str, str]:
    """Run one cell like a notebook does: the value of a final expression is echoed.

    ``_ast`` and ``compile(..., PyCF_ONLY_AST)`` stand in for the ``ast`` module, whose
    import alone took ~7 ms of every sandbox start.
    """
    name = f"<cell-{index}>"
    try:
        tree = compile(code, name, "exec", _ast.PyCF_ONLY_AST)
        last = None
        if tree.body and isinstance(tree.body[-1], _ast.Expr):
            last = _ast.Expression(tree.body.pop().value)
    except Exception as exc:  # a SyntaxError; a MemoryError when nested too deep or memory is full
        _print_exception(exc, name, code)
        return "error", type(exc).__name__
    try:
        exec(compile(tree, name, "exec"), namespace)
        if last is not None:
            value = eval(compile(last, name, "eval"), namespace)
            if value is not None:
                print(repr(value))
    except SystemExit as exc:
        print(f"SystemExit: {exc.code}", file=sys.stderr)
        return "error", "SystemExit"
    except BaseException as exc:
        _print_exception(exc, name, code)
        return "error", type(exc).__name__
    return "ok", ""


# A notebook's headroom, address space held back from its cells. A cell that fills the
# memory limit and keeps what it took (in a global) would otherwise leave no room to report
# its MemoryError or to compile the next cell, not even the ``del`` that frees it. An
# anonymous mapping counts against RLIMIT_AS without touching a page, and closing it gives
# exactly that much back.
_RESERVE_BYTES = 1 << 20
_reserve: list = []


def _take_reserve() -> None:
    """Take the headroom (again) once twice that much is free: taking it back when only that
    much is free would leave the next cell no room again."""
    if _reserve:
        return
    try:
        import mmap  # a cell may have replaced it in sys.modules: all it breaks is this

        mmap.mmap(-1, 2 * _RESERVE_BYTES).close()
        _reserve.append(mmap.mmap(-1, _RESERVE_BYTES))
    except Exception:
        pass  # still full; the next cell runs without headroom


def _release_reserve() -> None:
    while _reserve:
        _reserve.pop().close()


# ---------------------------------------------------------------- the fork-server
# It runs in a bwrap sandbox of its own (uid 65534, read-only file system with no writable
# directory at all, no network) that keeps CAP_SYS_ADMIN inside that sandbox's user
# namespace and nothing outside it. Model code never runs in the server: it keeps a few
# "spare" children forked ahead of time, each of which builds a sandbox of its own and drops
# every capability before it is handed any code (see ``_isolate``).
_NEWNS, _NEWIPC, _NEWUSER, _NEWPID, _NEWNET = 0x20000, 0x8000000, 0x10000000, 0x20000000, 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
_MS_RDONLY, _MS_REMOUNT, _MS_BIND, _MS_RELATIME, _MNT_DETACH = 0x1, 0x20, 0x1000, 0x200000, 0x2
# statvfs flags that are also mount flags, bit for bit (rdonly, nosuid, nodev, noexec,
# noatime, nodiratime); relatime has a bit of its own in each.
_KEPT_MOUNT_FLAGS, _ST_RELATIME = 0x1 | 0x2 | 0x4 | 0x8 | 0x400 | 0x800, 0x1000
_PR_SET_PDEATHSIG, _PR_SET_SECUREBITS, _PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT = 1, 28, 38, 47
_PR_CAP_AMBIENT_CLEAR_ALL, _CAPABILITY_VERSION_3, _SIGKILL = 4, 0x20080522, 9
# Securebits, each with its lock: no capabilities for uid 0 on exec (SECBIT_NOROOT), none
# raised into the ambient set, no keeping them across a uid change; the set-uid fixup
# (capabilities cleared when uids change) locked on.
_LOCKED_SECUREBITS = 0x1 | 0x2 | 0x8 | 0x20 | 0x40 | 0x80
# Landlock's syscalls have the same numbers on every architecture; ABI 6 added scopes.
_LANDLOCK_CREATE_RULESET, _LANDLOCK_RESTRICT_SELF, _LANDLOCK_VERSION = 444, 446, 1
_LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET, _LANDLOCK_SCOPE_SIGNAL = 1, 2
_MAX_STATUS = 512
# A SIGKILL after this share of the CPU limit is the limit's (see _exit_words).
_CPU_LIMIT_SHARE = 0.9
_MADV_COLLAPSE, _HUGE_PAGE = 25, 2 << 20
_REFILL_AT = 1  # spares left when the server forks a burst of them (see _Server.refill)


class _Kernel:
    """The libc calls the fork-server and its children make (``ctypes`` is imported in this
    mode only).

    Every function a child calls is looked up, and every argument that is the same for all
    calls is built, here in the server, once: a child that resolves a libc symbol or makes a
    ctypes array type itself pays for it on every call (~0.1 ms and dozens of copied pages
    each; the child's lookups die with it).
    """

    def __init__(self) -> None:
        import ctypes

        self.get_errno = ctypes.get_errno
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        self.prctl, self.unshare, self.setns = libc.prctl, libc.unshare, libc.setns
        self.mount, self.umount2, self.capset = libc.mount, libc.umount2, libc.capset
        self.syscall, self.madvise, self.malloc_trim = libc.syscall, libc.madvise, libc.malloc_trim
        abi = self.syscall(_LANDLOCK_CREATE_RULESET, None, 0, _LANDLOCK_VERSION)
        self.landlock_scopes = abi >= 6
        # capset(2)'s header and its three empty sets (permitted, effective, inheritable).
        self.no_capabilities = (
            (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0), (ctypes.c_uint32 * 6)()
        )
        scopes = _LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | _LANDLOCK_SCOPE_SIGNAL
        attr = (ctypes.c_uint64 * 3)(0, 0, scopes)
        self.scope_ruleset = (attr, ctypes.sizeof(attr))

    def check(self, result: int, what: str) -> None:
        if result != 0:
            errno = self.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    def drop_capabilities(self) -> None:
        """Empty every capability set and forbid regaining any.

        The bounding set is left as the new user namespace made it (full): it only caps
        what an exec adds from a file's capabilities (or, for uid 0, from nothing), and no
        exec here can add any. ``no_new_privs`` caps an exec's permitted set at the
        caller's, which is empty; every mount a call can exec from is ``nosuid`` (bwrap's
        binds and the child's own ``/tmp``, ``/dev/shm`` and ``/proc``), where the kernel
        ignores file capabilities and set-uid bits outright; the call's uid is never 0 and
        the locked ``SECBIT_NOROOT`` would give uid 0 nothing anyway; and a namespace of
        its own, whose bounding set would be full whatever this one is, is forbidden by
        ``max_user_namespaces``. Emptying it took 41 ``prctl`` calls (~0.1 ms of every
        call) and guarded nothing those do not."""
        prctl, check = self.prctl, self.check
        check(prctl(_PR_SET_SECUREBITS, _LOCKED_SECUREBITS, 0, 0, 0), "securebits")
        check(prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "ambient")
        check(self.capset(*self.no_capabilities), "capset")
        check(prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")

    def collapse_heap(self) -> None:
        """Back the warm heap with huge pages where the kernel can (``MADV_COLLAPSE``,
        Linux 6.1+; elsewhere a no-op). A fork copies one entry per 2 MiB of a huge page
        instead of 512, and an exit frees as few: with the math stack imported that is
        ~0.7 ms of every call. A page a child writes to is still copied alone (the kernel
        splits the huge mapping in that child)."""
        with open("/proc/self/maps") as handle:
            regions = [line.split() for line in handle]
        for fields in regions:
            low, high = (int(bound, 16) for bound in fields[0].split("-"))
            anonymous = len(fields) < 6 or fields[5] == "[heap]"
            start = (low + _HUGE_PAGE - 1) & -_HUGE_PAGE
            end = high & -_HUGE_PAGE
            if anonymous and fields[1].startswith("rw") and end > start:
                self.madvise(start, end - start, _MADV_COLLAPSE)  # best effort: errors ignored

    def scope(self) -> None:
        """A Landlock domain of its own: no connecting to abstract unix sockets, and no
        signals, outside it (the other calls and the server share its network namespace)."""
        fd = self.syscall(_LANDLOCK_CREATE_RULESET, *self.scope_ruleset, 0)
        if fd < 0:
            self.check(-1, "landlock_create_ruleset")
        try:
            self.check(self.syscall(_LANDLOCK_RESTRICT_SELF, fd, 0), "landlock_restrict_self")
        finally:
            os.close(fd)


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _isolate(kernel: _Kernel, config: dict, trees: list[str]) -> None:
    """Give a freshly forked child the isolation a fresh bwrap sandbox would have.

    The child is already pid 1 of a pid namespace of its own (the server unshared it before
    forking), so it sees no other call and not the server, and its death takes every
    process it started with it. Here it gets private mount and IPC namespaces (its own empty
    size-capped ``/tmp`` and ``/dev/shm``, which vanish with it, and no SysV or POSIX IPC
    objects shared with anything) and a ``/proc`` of its own pid namespace. Then a user
    namespace of its own: its processes are counted there, so ``RLIMIT_NPROC`` caps this
    call alone (a fork bomb cannot starve a neighbouring call or the server), and
    ``max_user_namespaces`` is 0 inside it, so model code can create no namespace (what
    bwrap's ``--disable-userns`` does). Its other namespaces belong to the server's user
    namespace, where the child holds no capability; it drops all it has in its own too.

    The network namespace is the server's, a fresh one it made for itself at start (its
    loopback interface is down and has no address): nothing is reachable from it. Abstract
    unix sockets are not addresses, so a Landlock scope keeps the child from connecting to
    any socket made outside its own domain (and from signalling outside it). On a kernel
    without Landlock scopes (before 6.12) the child gets a network namespace of its own
    instead, which costs ~0.6 ms more per call.
    """
    check, mount = kernel.check, kernel.mount
    uid, gid = os.getuid(), os.getgid()
    check(kernel.prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0), "pdeathsig")
    os.setsid()  # a session (and scheduler autogroup) of its own, as bwrap's --new-session
    private = _NEWNS | _NEWIPC | (0 if kernel.landlock_scopes else _NEWNET)
    check(kernel.unshare(private), "unshare")
    check(mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "private mounts")
    tmpfs = f"size={config['tmp_bytes']},mode=0755".encode()
    # The interpreter's own files can live under /tmp (a checkout or venv there, bound
    # read-only into the sandbox); the fresh /tmp would hide them, and every module not
    # imported yet would be gone. The server's /tmp is parked on /dev/shm, those trees are
    # bound back into the new /tmp and made read-only (a bind is writable whatever its
    # source: without the remount, model code could write into the host's venv), and the
    # park goes. (``trees`` are those mounts; the server reads them once.)
    if trees:
        check(mount(b"/tmp", b"/dev/shm", None, _MS_BIND | _MS_REC, None), "park /tmp")
    check(mount(b"tmpfs", b"/tmp", b"tmpfs", _MS_NOSUID | _MS_NODEV, tmpfs), "tmpfs")
    for tree in trees:
        os.makedirs(tree, exist_ok=True)
        parked = "/dev/shm" + tree.removeprefix("/tmp")
        check(mount(parked.encode(), tree.encode(), None, _MS_BIND | _MS_REC, None),
              "bind the interpreter back")
        kept = os.statvfs(parked).f_flag
        flags = (kept & _KEPT_MOUNT_FLAGS) | (_MS_RELATIME if kept & _ST_RELATIME else 0)
        check(mount(None, tree.encode(), None,
                         _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags, None),
              "make the interpreter read-only")
    if trees:
        check(kernel.umount2(b"/dev/shm", _MNT_DETACH), "unpark /tmp")
    check(mount(b"tmpfs", b"/dev/shm", b"tmpfs", _MS_NOSUID | _MS_NODEV, tmpfs), "tmpfs")
    proc_flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    check(mount(b"proc", b"/proc", b"proc", proc_flags, None), "mount /proc")
    check(kernel.unshare(_NEWUSER), "unshare user")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    _write("/proc/sys/user/max_user_namespaces", "0")
    kernel.drop_capabilities()
    if kernel.landlock_scopes:
        kernel.scope()
    os.chdir("/tmp")  # the new tmpfs, not the server's read-only directory beneath it


def _interpreter_trees_under_tmp() -> list[str]:
    """The outermost mounts under /tmp in this sandbox: what bwrap bound there (the venv or
    checkout the interpreter reads), to be seen by a child exactly as by the server."""
    with open("/proc/self/mountinfo", encoding="utf-8") as handle:
        points = sorted({line.split()[4] for line in handle})
    found: list[str] = []
    for point in points:
        inside = any(point.startswith(tree + "/") for tree in found)
        if point.startswith("/tmp/") and not inside:
            found.append(point)
    return found


def _child_limits(config: dict, baseline: int) -> None:
    """The limits of one call. The address-space cap comes on top of the warm interpreter's
    own mappings (``baseline``), so the code gets ``memory_bytes`` for itself; CPU time
    starts at zero in a forked child. Soft and hard CPU limits are equal: as pid 1 of its
    namespace the child ignores ``SIGXCPU``, and the server reports the ``SIGKILL`` at the
    hard limit as the CPU limit."""
    cpu = config["cpu_seconds"]
    pairs = (
        (resource.RLIMIT_AS, baseline + config["memory_bytes"]),
        (resource.RLIMIT_FSIZE, config["file_bytes"]),
        (resource.RLIMIT_NOFILE, config["open_files"]),
        (resource.RLIMIT_NPROC, config["processes"]),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_CPU, cpu),
    )
    for which, value in pairs:
        resource.setrlimit(which, (value, value))


def _prepare_fresh_state() -> tuple[tuple, tuple]:
    """Put the server, once, in the state a fresh interpreter starts a cell in, for every
    part of it the server itself never uses, so that each child inherits it instead of
    building it (~0.4 ms of every call): the default signal mask (the dispositions are
    set by ``_default_dispositions``), ``SIGXFSZ`` ignored (a full output file raises, not
    kills), a bare ``sys.argv``, and a seeding finder for each RNG not imported yet.

    Returns the call's two text streams, made here and never written to by the server
    (which writes with ``os.write`` only), so that each child starts with empty buffers,
    and the RNG modules already imported: ``random`` reseeds itself from the OS in every
    forked child (its ``register_at_fork`` hook), so a child seeds them itself
    (``_fresh_state``)."""
    _signal.pthread_sigmask(_signal.SIG_SETMASK, ())
    _signal.signal(_signal.SIGXFSZ, _signal.SIG_IGN)
    sys.argv[:] = ["-c"]
    seeded = []
    for name in ("random", "numpy.random"):
        if name in sys.modules:
            seeded.append(sys.modules[name])
        else:
            sys.meta_path.insert(0, _SeedRandomOnImport(name))
    return _new_streams(), tuple(seeded)


def _fresh_state(server: "_Server") -> None:
    """A child's part of a fresh interpreter's state (see ``_prepare_fresh_state``)."""
    _use_streams(server.streams)  # they write to whatever fds 1 and 2 become
    for module in server.seeded:
        module.seed(0)


def _read_all(fd: int) -> bytes:
    """The whole file, from its start whatever the shared file offset says. A read of its
    size and one byte more is short at the end of a regular file: one read, of the size
    needed (a fixed 1 MiB buffer cost two allocations of it per call)."""
    chunks: list[bytes] = []
    offset, want = 0, os.fstat(fd).st_size + 1
    while chunk := os.pread(fd, want, offset):
        chunks.append(chunk)
        offset += len(chunk)
        if len(chunk) < want:
            break
        want = 1 << 16
    return b"".join(chunks)


def _spare(server: "_Server", sock: object, status_w: int) -> None:
    """Runs in a forked child and never returns: isolate, wait for one call, run it, exit.

    Everything but the child's own socket and status pipe is closed first, so it holds
    nothing of the server's (the request socket, other calls' files). A setup fault is
    reported to the server on the status pipe, which is closed before any model code runs;
    the cell's outcome goes straight to the host on the call's own outcome pipe (model code
    can write there too, but a line that lies only misreports this very call).
    """
    reply = ("fault", "setup")
    outcome = status_w
    try:
        keep = sorted({0, 1, 2, sock.fileno(), status_w})
        for low, high in zip(keep, [*keep[1:], 1 << 20], strict=True):
            os.closerange(low + 1, high)
        try:
            _isolate(server.kernel, server.config, server.trees)
            _child_limits(server.config, server.baseline)
            _fresh_state(server)
            _, fds, _, _ = server.recv_fds(sock, 16, 5)
            if len(fds) not in (4, 5):  # the server is shutting down
                os._exit(0)
            code_fd, stdout_fd, stderr_fd, outcome_fd, *cgroup = fds
            for door in cgroup:
                # The call's memory cgroup, entered before the code is read: one thread
                # moving itself takes no global lock (a move by pid waits ~10 ms).
                os.write(door, b"0")
                os.close(door)
            os.dup2(stdout_fd, 1)
            os.dup2(stderr_fd, 2)
            sock.close()
            for fd in (stdout_fd, stderr_fd):
                os.close(fd)
            code = _read_all(code_fd).decode("utf-8", errors="surrogateescape")
            os.close(code_fd)
            os.close(status_w)
            outcome = outcome_fd
        except BaseException as exc:
            reply = ("fault", f"{type(exc).__name__}: {exc}")
            raise
        namespace = {"__name__": "__main__", "__builtins__": builtins}
        reply = _run_cell(code, namespace, 1)
        _flush_streams()
    finally:
        try:
            _send(outcome, *reply)
        finally:
            os._exit(0)


def _exit_words(status: int, usage: object, cpu_seconds: int) -> tuple:
    import signal

    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        cpu = usage.ru_utime + usage.ru_stime
        # The kernel enforces RLIMIT_CPU on tick-sampled CPU time, which counts a whole tick
        # to whoever runs at it; wait4 reports the exact run time. On a loaded host the first
        # runs ahead: a busy loop killed at its 2 s limit had under 1.95 s reported.
        if number == signal.SIGXCPU or (number == signal.SIGKILL
                                        and cpu >= _CPU_LIMIT_SHARE * cpu_seconds):
            return ("crashed", f"CPU time limit of {cpu_seconds} s exceeded")
        try:
            return ("crashed", f"killed by {signal.Signals(number).name}")
        except ValueError:
            return ("crashed", f"killed by signal {number}")
    code = os.waitstatus_to_exitcode(status)
    # A call's child exits 0 once it has written its outcome line (which the host reads).
    return ("exited",) if code == 0 else ("crashed", f"exit code {code}")


class _Child:
    """One forked child, idle (a spare) or running a call, as the server tracks it."""

    __slots__ = ("deadline", "killed", "pid", "pidfd", "reply_w", "sock", "status_r")

    def __init__(self, pid: int, status_r: int, sock: object) -> None:
        self.pid, self.status_r, self.sock = pid, status_r, sock
        self.pidfd = os.pidfd_open(pid)
        self.reply_w: int | None = None
        self.deadline: float | None = None
        self.killed = False


class _Server:
    """The fork-server's state and event handlers (one thread, driven by ``poll``)."""

    def __init__(
        self,
        kernel: _Kernel,
        config: dict,
        baseline: int,
        own_pidns: int,
        streams: tuple,
        seeded: tuple,
    ) -> None:
        import _socket
        import select
        import socket
        import time

        # Bound once: an ``import`` or a module attribute in the loop is pages the server
        # writes to, and every page it writes to after a fork is copied.
        self.monotonic, self.send_fds = time.monotonic, socket.send_fds
        self.recv_fds = socket.recv_fds
        self.socketpair = _socket.socketpair  # no Python-level socket objects to build
        self.seqpacket = (_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
        self.kernel, self.config, self.own_pidns = kernel, config, own_pidns
        # The call's streams, and the server's own: referenced here so that a child's
        # ``_use_streams`` does not finalize (flush and close) the server's on every call.
        self.streams, self.own_streams = streams, (sys.stdout, sys.stderr)
        self.baseline, self.seeded = baseline, seeded
        self.trees = _interpreter_trees_under_tmp()
        self.poller = select.poll()
        self.readable = select.POLLIN
        self.watched: dict[int, _Child] = {}
        self.spares: list[_Child] = []
        self.running: set[_Child] = set()  # the children with a call to answer

    def _watch(self, fd: int, child: _Child) -> None:
        self.watched[fd] = child
        self.poller.register(fd, self.readable)

    def _unwatch(self, fd: int) -> None:
        del self.watched[fd]
        self.poller.unregister(fd)
        os.close(fd)

    def fork(self) -> _Child:
        """Fork a spare child into a new pid namespace, as its pid 1."""
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        ours, theirs = self.socketpair(*self.seqpacket)
        self.kernel.check(self.kernel.unshare(_NEWPID), "unshare pid")
        try:
            pid = os.fork()
            if pid == 0:
                _spare(self, theirs, status_w)
        finally:
            # The server's own later children (the next spare included) start from here.
            self.kernel.check(self.kernel.setns(self.own_pidns, _NEWPID), "setns pid")
            os.close(status_w)
            theirs.close()
        child = _Child(pid, status_r, ours)
        self._watch(child.pidfd, child)  # the status pipe is read when the child has ended
        return child

    def refill(self) -> None:
        """Keep spare children forked and isolated ahead of calls, forked in bursts.

        Every page the server writes to after a fork is copied, since the new child shares
        it: forking the spares back to back and then serving that many calls copies the
        pages of the server's loop once per burst instead of once per call (~50 of the
        ~140 pages it copied per call). So nothing is forked while more than
        ``_REFILL_AT`` spares are left, and then the spares are refilled at once, whether
        calls run or not (a call never waits for its own child's fork and isolation
        unless more calls than spares arrive together).
        """
        if len(self.spares) > _REFILL_AT:
            return
        while len(self.spares) < self.config["spares"]:
            self.spares.append(self.fork())

    def dispatch(self, body: bytes, fds: list) -> None:
        """Hand one request's files to a spare (forked now if none is left) and time it.

        The files are the code, stdout, stderr and outcome files, the verdict pipe, and,
        when memory is bounded by cgroup, the door of the call's cgroup (``_spare``)."""
        verdict_w = fds.pop(4)  # the rest are the child's
        try:
            child = self.spares.pop(0) if self.spares else self.fork()
        except OSError as exc:  # e.g. no more processes: this call fails, not the server
            _send(verdict_w, "fault", f"cannot start the call: {exc}")
            for fd in [*fds, verdict_w]:
                os.close(fd)
            return
        child.reply_w = verdict_w
        self.running.add(child)
        child.deadline = self.monotonic() + float(marshal.loads(body)["timeout"])
        if self.config["announce"]:
            _send(verdict_w, "pid", str(child.pid))
        try:
            self.send_fds(child.sock, [b"run"], fds)
        except OSError:
            pass  # the spare died while idle; its exit answers this call
        finally:
            child.sock.close()
            child.sock = None
            for fd in fds:
                os.close(fd)

    def _answer(self, child: _Child, reply: tuple) -> None:
        """Tell the host, once, how the call's child ended (when it exited by itself, the
        host takes ok or error from the child's own outcome line)."""
        if child.reply_w is None:
            return
        try:  # noqa: SIM105 (contextlib would be one more import per call)
            _send(child.reply_w, *reply)
        except OSError:
            pass  # the host has its answer or gave up
        os.close(child.reply_w)
        child.reply_w = None
        self.running.discard(child)

    def _read_status(self, child: _Child) -> tuple | None:
        """What an ended child left on its status pipe: a setup fault, if any. (Not watched
        while the child lives: its exit comes right after a fault, and a wake-up for the
        pipe's end in every call cost the server more than the read here.)"""
        os.set_blocking(child.status_r, False)
        try:
            data = os.read(child.status_r, _MAX_STATUS).decode("utf-8", errors="replace")
        except BlockingIOError:  # a writer left, which no process of a call should hold
            data = ""
        os.close(child.status_r)
        words = data.split("\n")[0].split(" ", 1) if data.endswith("\n") else []
        # A call's child closes this pipe before model code runs, so a "fault" (a setup step
        # that failed: its isolation, entering its cgroup) cannot be forged to blame the
        # sandbox.
        if words and words[0] == "fault":
            return tuple(words)
        return None

    def on_exit(self, child: _Child) -> None:
        """Reap a child (pid 1 of its namespace: its whole tree is gone) and say how it ended."""
        fault = self._read_status(child)
        _, status, usage = os.wait4(child.pid, 0)
        if child.killed:
            reply: tuple = ("timeout",)
        elif fault is not None:
            reply = fault
        else:  # the code ended the interpreter (os._exit, a signal, the CPU limit)
            reply = _exit_words(status, usage, self.config["cpu_seconds"])
        self._answer(child, reply)
        self._unwatch(child.pidfd)
        if child in self.spares:
            self.spares.remove(child)
        if child.sock is not None:
            child.sock.close()
            child.sock = None

    def expire(self, now: float) -> float | None:
        """Kill the calls past their deadline; the next deadline, if any."""
        nearest = None
        for child in self.running:
            if child.deadline is None or child.killed:
                continue
            if child.deadline <= now:
                child.killed = True
                _signal.pidfd_send_signal(child.pidfd, _SIGKILL)
            elif nearest is None or child.deadline < nearest:
                nearest = child.deadline
        return nearest


def _serve(config: dict, ctl_out: int, requests_fd: int) -> None:
    """Warm up, then run one call per request in a spare child until the host hangs up.

    A request is one ``SOCK_SEQPACKET`` message: ``marshal({"timeout": s})`` with five fds:
    the code, stdout and stderr files, and the write ends of the call's outcome pipe (for
    the child's "ok" / "error <name>" line, straight to the host) and its verdict pipe (for
    the server's word on how the child ended, written once it has reaped the child: the
    host ends the call on that alone); a sixth, when the host bounds memory by cgroup, is
    the door of the call's cgroup, which the child enters. With ``announce`` the verdict
    pipe first names the child (``pid N``) for the host's memory watcher. The server
    enforces the timeout itself: SIGKILL to the child, pid 1 of its namespace, takes its
    whole tree down.
    """
    import gc
    import socket
    import time

    os.environ.pop("LD_BIND_NOW", None)  # it did its work when the interpreter started
    kernel = _Kernel()
    for module in config["preload_optional"]:
        try:
            __import__(module)
        except ImportError:
            continue  # not installed for this interpreter
    streams, seeded = _prepare_fresh_state()
    # One cell of the server's own, compiled and run here: the type-attribute cache entries
    # of a cell's path are then in the image each child starts from (~20 copied pages
    # less per call than when every child fills them for itself).
    _run_cell("x = 1 + 1\nNone", {"__name__": "__main__", "__builtins__": builtins}, 0)
    gc.collect()
    gc.freeze()  # a child's collections never touch (and so never copy) the warm heap
    kernel.malloc_trim(0)  # fewer mapped pages: every fork copies their page tables
    kernel.collapse_heap()
    if len(os.listdir("/proc/self/task")) != 1:
        raise SystemExit("the fork-server must be single-threaded to fork safely")
    with open("/proc/self/status") as f:
        vm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    if kernel.landlock_scopes:
        # bwrap brought loopback up; a fresh network namespace has nothing up at all.
        kernel.check(kernel.unshare(_NEWNET), "unshare net")
    kernel.check(kernel.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "ambient")
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    server = _Server(kernel, config, vm_kb << 10, own_pidns, streams, seeded)
    sock = socket.socket(fileno=requests_fd)
    server.poller.register(requests_fd, server.readable)
    server.refill()
    _send(ctl_out, "ready")
    wait = None
    monotonic, poll, watched = time.monotonic, server.poller.poll, server.watched
    while True:
        timeout = None if wait is None else max(0.0, wait - monotonic()) * 1000 + 1
        for fd, _ in poll(timeout):
            if fd == requests_fd:
                body, fds, flags, _ = socket.recv_fds(sock, 4096, 6)
                if not body and not fds:
                    return  # the host closed its end; the children die with this process
                if len(fds) in (5, 6) and not flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                    server.dispatch(body, fds)
                else:
                    for extra in fds:
                        os.close(extra)
            elif fd in watched:
                server.on_exit(watched[fd])
        wait = server.expire(monotonic())
        server.refill()


def _default_dispositions() -> None:
    """SIGINT and SIGQUIT as an interpreter started normally has them. A host started in the
    background of a script (``cmd &``) ignores both, and every worker, fork-server and call
    would inherit that."""
    _signal.signal(_signal.SIGINT, _signal.default_int_handler)
    _signal.signal(_signal.SIGQUIT, _signal.SIG_DFL)


def main() -> None:
    _default_dispositions()
    ctl_in, ctl_out = int(sys.argv[1]), int(sys.argv[2])
    requests = [int(fd) for fd in sys.argv[3:4]]  # the fork-server's request socket
    keep = sorted({0, 1, 2, ctl_in, ctl_out, *requests})
    for low, high in zip(keep, [*keep[1:], 1 << 20], strict=True):
        os.closerange(low + 1, high)
    config = _receive(ctl_in)
    if not isinstance(config, dict):
        return
    sys.path.extend(config["path"])
    for module in config["preload"]:
        __import__(module)
    if config.get("forkserver"):
        os.close(ctl_in)
        _serve(config, ctl_out, requests[0])
        return
    _apply_limits(config)
    _signal.signal(_signal.SIGXFSZ, _signal.SIG_IGN)  # a full output file raises, not kills
    sys.meta_path.insert(0, _SeedRandomOnImport("random"))
    _fresh_streams()
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    if not config["single"]:
        _take_reserve()
    _send(ctl_out, "ready")
    index = 0
    while True:
        request = _receive(ctl_in)
        if not isinstance(request, dict):
            return
        if not config["single"]:
            _cpu_budget_for_next_cell(config["cpu_seconds"])
        index += 1
        status, error = _run_cell(request["code"], namespace, index)
        _flush_streams()
        _send(ctl_out, status, error)
        if config["single"]:
            # At once: the host ends the call when this process has exited (a reply alone
            # could be the cell's), and nothing the cell registered runs after it.
            os._exit(0)
        _take_reserve()


if __name__ == "__main__":
    main()
