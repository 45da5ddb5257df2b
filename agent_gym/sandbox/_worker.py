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
    """Seeds ``random`` with 0 when a cell first imports it, so replays print the same.

    Importing ``random`` up front to seed it cost 1-3 ms of every start; this finder hands
    out the normal spec with a loader that seeds the module right after executing it.
    """

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name != "random":
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


def _fresh_streams() -> None:
    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(
            io.BufferedWriter(raw, 8192), encoding="utf-8", errors="backslashreplace"
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


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


def _print_exception(exc: BaseException, name: str, code: str, skip_frame: bool) -> None:
    """Print a traceback that starts in the cell and quotes its lines (imported lazily: the
    traceback machinery costs a few ms of every start, and most cells never need it)."""
    import contextlib
    import linecache
    import traceback

    linecache.cache[name] = (len(code), None, code.splitlines(True), name)
    tb = exc.__traceback__
    if skip_frame and tb is not None:
        tb = tb.tb_next  # the worker's own exec() frame
    with contextlib.suppress(Exception):  # stderr may be full; the status still tells
        traceback.print_exception(type(exc), exc, tb, file=sys.stderr)


def _run_cell(code: str, namespace: dict, index: int) -> tuple[str, str]:
    """Run one cell like a notebook does: the value of a final expression is echoed.

    ``_ast`` and ``compile(..., PyCF_ONLY_AST)`` stand in for the ``ast`` module, whose
    import alone took ~7 ms of every sandbox start.
    """
    name = f"<cell-{index}>"
    try:
        tree = compile(code, name, "exec", _ast.PyCF_ONLY_AST)
    except (SyntaxError, ValueError) as exc:
        _print_exception(exc, name, code, skip_frame=False)
        return "error", type(exc).__name__
    last = None
    if tree.body and isinstance(tree.body[-1], _ast.Expr):
        last = _ast.Expression(tree.body.pop().value)
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
        _print_exception(exc, name, code, skip_frame=True)
        return "error", type(exc).__name__
    return "ok", ""


def main() -> None:
    ctl_in, ctl_out = int(sys.argv[1]), int(sys.argv[2])
    keep = sorted({0, 1, 2, ctl_in, ctl_out})
    for low, high in zip(keep, [*keep[1:], 1 << 20], strict=True):
        os.closerange(low + 1, high)
    config = _receive(ctl_in)
    if not isinstance(config, dict):
        return
    sys.path.extend(config["path"])
    for module in config["preload"]:
        __import__(module)
    _apply_limits(config)
    _signal.signal(_signal.SIGXFSZ, _signal.SIG_IGN)  # a full output file raises, not kills
    sys.meta_path.insert(0, _SeedRandomOnImport())
    _fresh_streams()
    namespace = {"__name__": "__main__", "__builtins__": builtins}
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
            return


if __name__ == "__main__":
    main()
