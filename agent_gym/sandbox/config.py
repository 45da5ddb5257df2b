"""Sandbox limits, errors and the fixed environment every sandboxed interpreter gets."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

Isolation = Literal["bwrap", "rlimits"]
ISOLATIONS: tuple[str, ...] = ("bwrap", "rlimits")
NOBODY = 65534
MAX_CODE_BYTES = 8 << 20

# The sandbox's private writable directory, a fresh tmpfs per sandbox (per call in the
# fork-server). Inside the sandbox it shadows the host's directory of the same name.
SANDBOX_TMP = "/tmp"

SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": SANDBOX_TMP,
    "TMPDIR": SANDBOX_TMP,
    "USER": "sandbox",
    "LANG": "C.UTF-8",
    "PYTHONHASHSEED": "0",  # set and dict-of-str orders must replay identically
    "PYTHONDONTWRITEBYTECODE": "1",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
# What a fork-server imports once so that no call pays for it: the standard library a
# math cell reaches for and the traceback machinery. Every page the server has written
# costs each fork (its page table entry is copied and torn down, and a page either side
# writes to is copied), so rarely used parts stay out: numpy.random alone cost ~0.8 ms a
# call (it is seeded on import).
FORKSERVER_PRELOAD = (
    "array", "bisect", "cmath", "collections", "contextlib", "datetime", "decimal",
    "fractions", "functools", "heapq", "itertools", "json", "linecache", "math", "operator",
    "random", "re", "statistics", "string", "time", "traceback", "typing",
)  # fmt: skip
# The math packages, where installed, are warm in a second fork-server that serves the calls
# whose code names one of them. Their ~40 MB of heap cost every fork ~1.5 ms of CPU, which
# code that never touches them should not pay (see forkserver.ForkServer).
FORKSERVER_MATH_STACK = ("numpy", "mpmath", "sympy")
# Children each fork-server keeps forked and isolated ahead of calls (enough for four
# concurrent callers to find one ready; each costs little more than its page tables).
FORKSERVER_SPARES = 4
RLIMITS_WARNING = (
    "agent_gym sandbox is running with isolation='rlimits': model code runs WITHOUT "
    "namespaces. Its network, the host file system (as uid 65534 when root) and processes "
    "that escape with setsid are NOT contained; only resource limits apply."
)


class SandboxError(RuntimeError):
    """The sandbox machinery failed (could not start, broke its protocol); not the code's fault."""


class IsolationUnavailableError(SandboxError):
    """bubblewrap is missing or cannot create its namespaces on this host."""


@dataclass(frozen=True)
class Limits:
    """Resource limits for one sandboxed interpreter.

    ``timeout`` is wall time per call and is the limit that always holds; ``cpu_seconds`` is
    per call as well (a persistent worker gets that much more CPU time for every cell).
    ``memory_bytes`` is ``RLIMIT_AS`` per process (one that asks for more gets a
    ``MemoryError``) and, with a small allowance, the bound on all of a sandbox's processes
    together, with their ``/tmp`` and ``/dev/shm`` files and memfd files: a cgroup's limit or
    the watcher's (``memory.sandbox_limit``). ``processes`` caps their number.
    (A fork-server child gets ``memory_bytes`` on top of the warm interpreter's own
    mappings, which it shares. A persistent worker keeps 1 MB of it unused, given back
    when a cell runs out of memory, so that the error is reported and the next cell can
    free what the last one kept.)
    ``file_bytes`` caps every file the code writes, including its captured stdout and
    stderr; ``output_bytes`` is the tail of each stream that is read back.
    """

    timeout: float = 10.0
    cpu_seconds: int = 10
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    open_files: int = 64
    processes: int = 32
    tmp_bytes: int = 64 << 20
    output_bytes: int = 64 << 10
    startup_timeout: float = 30.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Limits.{name} must be a positive number, got {value!r}")
        if self.processes < 4:
            raise ValueError("Limits.processes must be at least 4 (bwrap and the worker)")
        if self.open_files < 16:
            raise ValueError("Limits.open_files must be at least 16 (the interpreter needs them)")


def encode_code(code: str) -> bytes:
    """A cell's source as bytes for the sandbox; not a str or too long is refused."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    data = code.encode("utf-8", errors="surrogatepass")
    if len(data) > MAX_CODE_BYTES:
        raise ValueError(f"code is longer than {MAX_CODE_BYTES} bytes")
    return data
