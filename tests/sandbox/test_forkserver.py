"""The fork-server: no call leaves anything for the next, and a broken server is replaced.

Every stateless call is a child forked from a warm sandboxed interpreter (a lean one, or one
with the math stack imported for code that names it), so these tests change everything a
call could change on either and check that the next call sees none of it; run calls side by
side and check they cannot reach each other; and kill, stop and trace the server from the
host to check it is replaced.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_gym.sandbox import (
    ExecResult,
    Limits,
    SandboxError,
    StatelessSandbox,
    open_sandbox,
    runner,
)
from agent_gym.sandbox.config import SANDBOX_TMP
from agent_gym.sandbox.forkserver import ForkServer, Warmth, warmth
from tests.helpers.procs import live_pids_of, marked, wait_until

LIMITS = Limits(timeout=10.0, cpu_seconds=5, memory_bytes=256 << 20, output_bytes=8192)


@pytest.fixture(scope="module", autouse=True)
def nothing_left_when_done() -> Iterator[None]:
    before = live_pids_of(65534)
    yield
    assert wait_until(lambda: not live_pids_of(65534) - before), live_pids_of(65534) - before


@pytest.fixture(scope="module")
def box() -> Iterator[StatelessSandbox]:
    sandbox = open_sandbox("stateless", limits=LIMITS, forkserver=True)
    assert isinstance(sandbox, StatelessSandbox) and sandbox.engine == "forkserver"
    yield sandbox
    sandbox.close()


def _ok(box: StatelessSandbox, code: str) -> str:
    result = box.run(textwrap.dedent(code))
    assert result.ok, result.observation()
    return result.stdout


LEAVE_TRACES = """
    import builtins, gc, json, math, os, random, resource, signal, subprocess, sys, threading
    import time, types
    open('@TMP@/left', 'w').write('x')
    open('/dev/shm/left', 'w').write('x')
    os.mkdir('@TMP@/dir')
    os.environ['LEFT'] = '1'
    os.putenv('LEFT_TOO', '1')
    math.sqrt = lambda x: 42
    json.dumps = None
    builtins.left = 1
    sys.modules['left_module'] = types.ModuleType('left_module')
    sys.path.append('/left')
    signal.signal(signal.SIGTERM, lambda *a: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    signal.alarm(100)
    os.chdir('/')
    os.umask(0o777)
    resource.setrlimit(resource.RLIMIT_NOFILE, (20, 20))
    random.seed(5)
    gc.disable()
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
    subprocess.Popen(['sleep', '73.1234'], start_new_session=True)
    if os.fork() == 0:
        os.setsid()
        os.execvp('sleep', ['sleep', '73.1234'])
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    print('shm', libc.shmget(0x4747, 4096, 0o1666))
    print('done')
"""

FIND_TRACES = """
    import builtins, gc, json, math, os, random, resource, signal, sys, threading
    found = []
    found += [p for p in ('@TMP@/left', '/dev/shm/left', '@TMP@/dir') if os.path.exists(p)]
    found += [k for k in ('LEFT', 'LEFT_TOO') if k in os.environ]
    if math.sqrt(4) != 2.0 or json.dumps is None:
        found.append('monkeypatched module')
    if hasattr(builtins, 'left') or 'left_module' in sys.modules or '/left' in sys.path:
        found.append('interpreter state')
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        found.append('SIGTERM handler')
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        found.append('SIGINT handler')
    if signal.pthread_sigmask(signal.SIG_BLOCK, ()):
        found.append('blocked signals')
    if signal.alarm(0):
        found.append('pending alarm')
    if os.getcwd() != '@TMP@':
        found.append('cwd ' + os.getcwd())
    if os.umask(0o022) != 0o022:
        found.append('umask')
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] == 20:
        found.append('rlimit')
    if random.random() != random.Random(0).random():
        found.append('random state')
    if not gc.isenabled():
        found.append('gc disabled')
    if threading.active_count() != 1:
        found.append('threads')
    pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
    if pids != [1]:
        found.append(f'processes {pids}')
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.shmget(0x4747, 0, 0) != -1 or open('/proc/sysvipc/shm').read().count('\\n') > 1:
        found.append('SysV shared memory')
    print(found)
"""
# The traces land in the sandbox's private writable directory, wherever it is.
LEAVE_TRACES = LEAVE_TRACES.replace("@TMP@", SANDBOX_TMP)
FIND_TRACES = FIND_TRACES.replace("@TMP@", SANDBOX_TMP)


@pytest.mark.parametrize("kind", ["lean", "math"])
def test_a_call_leaves_nothing_for_the_next(box: StatelessSandbox, kind: Warmth) -> None:
    # On the math server numpy's module state is one more thing a call could leave behind.
    leave, find = textwrap.dedent(LEAVE_TRACES), textwrap.dedent(FIND_TRACES)
    if kind == "math":
        leave = "import numpy\nnumpy.random.seed(5)\nnumpy.pi = 3\n" + leave
        find = find.replace("found = []", textwrap.dedent("""\
            import numpy
            found = [] if numpy.pi > 3 else ['numpy patched']
            if numpy.random.randint(10**9) != numpy.random.RandomState(0).randint(10**9):
                found.append('numpy random state')"""))
    assert warmth(leave) == warmth(find) == kind
    before = _ok(box, find)
    assert before == "[]\n"  # the check itself finds nothing on a clean call
    traces = _ok(box, leave)
    assert "done" in traces and "shm -1" not in traces, traces
    for _ in range(3):  # whichever spare serves the next calls
        assert _ok(box, find) == "[]\n"
    assert wait_until(lambda: not marked("73.1234")), "background processes outlived the call"


def test_calls_get_default_signal_handlers_whatever_the_host_ignores() -> None:
    """A host started with ``cmd &`` from a script ignores SIGINT and SIGQUIT; its calls
    (forked or in a notebook) must still see what a fresh interpreter has."""
    host = textwrap.dedent("""\
        from agent_gym.sandbox import open_sandbox
        check = ("import signal\\nprint(signal.getsignal(signal.SIGINT) is "
                 "signal.default_int_handler, signal.getsignal(signal.SIGQUIT) == signal.SIG_DFL)")
        for box in (open_sandbox("stateless", forkserver=True), open_sandbox("stateful")):
            print(box.run(check).stdout.strip())
            box.close()""")

    def ignore() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGQUIT, signal.SIG_IGN)

    done = subprocess.run([sys.executable, "-c", host], capture_output=True, text=True,
                          preexec_fn=ignore, timeout=60, check=True)
    assert done.stdout.split("\n")[:2] == ["True True"] * 2, done.stderr[-2000:]


def test_code_that_names_the_math_stack_runs_where_it_is_warm() -> None:
    assert warmth("import sympy as sp") == warmth("from numpy.linalg import inv") == "math"
    assert warmth("x = mpmath.mpf(1)  # any mention, even in a comment") == "math"
    assert warmth("import numpyro, mysympy\nprint(1)") == warmth("print('hi')") == "lean"
    assert warmth("a" * 200_000 + " numpy") == "math"  # one linear scan, however long


def test_the_lean_server_still_imports_anything(box: StatelessSandbox) -> None:
    code = "m = __import__('num' + 'py')\nprint(m.arange(3).sum())"
    assert warmth(code) == "lean"
    assert _ok(box, code) == "3\n"  # an import from disk, as a fresh interpreter does it


def test_the_check_for_traces_can_fail(box: StatelessSandbox) -> None:
    """Within one call the traces are all there: the check above is not vacuous."""
    both = textwrap.dedent(LEAVE_TRACES) + textwrap.dedent(FIND_TRACES)
    found = box.run(both)
    assert found.ok, found.observation()
    for trace in (f"{SANDBOX_TMP}/left", "LEFT", "monkeypatched", "SIGTERM", "blocked", "alarm", "umask"):
        assert trace in found.stdout, (trace, found.stdout)


def test_side_by_side_calls_cannot_reach_each_other(box: StatelessSandbox) -> None:
    listener = """
        import socket, time
        s = socket.socket(socket.AF_UNIX)
        s.bind('\\0agent-gym-side-by-side')
        s.listen()
        open('@TMP@/mine', 'w').write('a')
        time.sleep(6)
    """.replace("@TMP@", SANDBOX_TMP)
    results = {}
    thread = threading.Thread(target=lambda: results.update(a=box.run(textwrap.dedent(listener))))
    thread.start()
    probe = """
        import errno, os, signal, socket, time
        seen = 'nothing'
        end = time.monotonic() + 5
        while time.monotonic() < end and seen == 'nothing':
            try:
                socket.socket(socket.AF_UNIX).connect('\\0agent-gym-side-by-side')
                seen = 'CONNECTED'
            except PermissionError:
                seen = 'blocked'
            except ConnectionRefusedError:
                time.sleep(0.05)
        print(seen, sorted(p for p in os.listdir('/proc') if p.isdigit()))
        print(os.path.exists('@TMP@/mine'))
        try:
            os.kill(-1, signal.SIGKILL)  # all it may signal: nothing, outside its own tree
        except ProcessLookupError:
            print('nothing to kill')
    """.replace("@TMP@", SANDBOX_TMP)
    seen = _ok(box, probe).splitlines()
    thread.join()
    assert seen[0] == "blocked ['1']", seen
    assert seen[1:] == ["False", "nothing to kill"]
    assert results["a"].ok, results["a"].observation()  # the kill(-1) did not reach it
    assert box.forkserver is not None and box.forkserver.restarts == 0


def test_a_call_holds_no_privilege_and_cannot_create_namespaces(box: StatelessSandbox) -> None:
    out = _ok(
        box,
        """
        import ctypes, os
        status = dict(l.split(':\\t') for l in open('/proc/self/status').read().splitlines())
        caps = {status[f'Cap{s}'].strip() for s in ('Inh', 'Prm', 'Eff', 'Amb')}
        libc = ctypes.CDLL(None, use_errno=True)
        print(caps, status['NoNewPrivs'].strip(), hex(libc.prctl(27, 0, 0, 0, 0)))
        # What leaves the bounding set moot: no mount to exec a file's capabilities from.
        print(all('nosuid' in l.split()[5].split(',') for l in open('/proc/self/mountinfo')))
        for flag in (0x10000000, 0x20000, 0x40000000):  # user, mount, network
            print(libc.unshare(flag), ctypes.get_errno() != 0)
        print(os.getuid(), os.getgid(), os.getsid(0) == os.getpid())
        for path in ('/proc/sys/user/max_user_namespaces', '/proc/sys/kernel/hostname',
                     '/proc/sys/net/core/somaxconn', '/proc/sysrq-trigger'):
            try:
                open(path, 'w').write('1')
                print('WROTE', path)
            except OSError as exc:
                print(type(exc).__name__)
        """,
    )
    lines = out.splitlines()
    assert lines[0] == "{'0000000000000000'} 1 0xeb", lines  # securebits set and locked
    assert lines[1] == "True", lines
    assert lines[2:5] == ["-1 True"] * 3, lines
    assert lines[5] == "65534 65534 True"
    assert not [line for line in lines[6:] if line.startswith("WROTE")], lines


def test_output_a_call_left_unflushed_never_reaches_the_next(box: StatelessSandbox) -> None:
    """Every call writes through text streams the server made once and never used: a
    call's unflushed buffer dies with its child."""
    box.run("import os, sys\nsys.stdout.write('stale')\nsys.stderr.write('stale')\nos._exit(0)")
    result = box.run("import sys\nprint('fresh')\nprint('fresh too', file=sys.stderr)")
    assert (result.stdout, result.stderr) == ("fresh\n", "fresh too\n"), result.observation()


def test_code_cannot_forge_a_sandbox_fault(box: StatelessSandbox) -> None:
    forged = box.run(
        "import os\nfor fd in range(3, 64):\n    try: os.write(fd, b'fault x\\n')\n    except OSError: pass"
    )
    assert forged.status in ("ok", "crashed"), forged  # its own outcome, never a SandboxError


def test_the_math_stack_is_warm_and_memory_is_the_codes_own(box: StatelessSandbox) -> None:
    out = _ok(
        box,
        """
        import time
        start = time.perf_counter()
        import numpy, sympy
        print(time.perf_counter() - start < 0.05, numpy.random.rand() == numpy.random.rand())
        keep = bytearray(200 << 20)
        print(sympy.factorint(2**32 + 1))
        """,
    )
    assert out.splitlines() == ["True False", "{641: 1, 6700417: 1}"], out
    assert box.run("x = bytearray(300 << 20)").error == "MemoryError"
    replay = "import numpy\nprint(numpy.random.randint(10**9))"
    assert box.run(replay).stdout == box.run(replay).stdout  # seeded like random


def _server_pid(box: StatelessSandbox, kind: Warmth = "lean") -> int:
    """The host pid of a kind's server (started by a call of that kind if need be)."""
    assert box.forkserver is not None
    if box.forkserver._servers[kind] is None:
        _ok(box, "import numpy" if kind == "math" else "pass")
    server = box.forkserver._servers[kind]
    assert server is not None
    return server.pid


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return ""


@pytest.mark.parametrize("kind", ["lean", "math"])
def test_a_server_that_dies_is_replaced(box: StatelessSandbox, kind: Warmth) -> None:
    assert box.forkserver is not None
    prefix = "import numpy\n" if kind == "math" else ""
    dead = _server_pid(box, kind)
    restarts = box.forkserver.restarts
    os.kill(dead, signal.SIGKILL)
    assert wait_until(lambda: "\nState:\tZ" in _status(dead) or not _status(dead))
    assert _ok(box, prefix + "print('after')") == "after\n"
    assert box.forkserver.restarts == restarts + 1 and _server_pid(box, kind) != dead
    # A server that dies under a running call: the call runs again on a fresh server.
    results = {}
    code = prefix + "import os, time\ntime.sleep(3)\nprint(os.getpid())"
    thread = threading.Thread(target=lambda: results.update(r=box.run(code)))
    thread.start()
    time.sleep(1.0)
    os.kill(_server_pid(box, kind), signal.SIGKILL)
    thread.join()
    assert results["r"].ok and results["r"].stdout == "1\n", results["r"].observation()
    assert box.forkserver.restarts == restarts + 2


def test_a_stopped_or_traced_server_is_replaced(box: StatelessSandbox) -> None:
    assert box.forkserver is not None
    restarts = box.forkserver.restarts
    stopped = _server_pid(box)
    os.kill(stopped, signal.SIGSTOP)
    assert wait_until(lambda: "(stopped)" in _status(stopped))
    assert _ok(box, "print(1)") == "1\n"
    assert box.forkserver.restarts == restarts + 1 and _server_pid(box) != stopped
    libc = ctypes.CDLL(None, use_errno=True)
    traced = _server_pid(box)
    ptrace_seize, wait_all = 0x4206, 0x40000000
    assert libc.ptrace(ptrace_seize, traced, None, None) == 0, ctypes.get_errno()
    assert _ok(box, "print(2)") == "2\n"
    assert box.forkserver.restarts == restarts + 2 and _server_pid(box) != traced
    # As its tracer, this process must reap the killed server, or its sandbox cannot end.
    deadline = time.monotonic() + 10
    while os.waitpid(traced, os.WNOHANG | wait_all)[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_lean_call_does_not_wait_for_the_math_server_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The math server's start (~1 s of imports) holds up only the calls that need it."""
    entered, release = threading.Event(), threading.Event()
    spawn = ForkServer._spawn

    def gated(self: ForkServer, kind: Warmth) -> object:
        if kind == "math":
            entered.set()
            release.wait(60)
        return spawn(self, kind)

    monkeypatch.setattr(ForkServer, "_spawn", gated)
    with open_sandbox("stateless", limits=LIMITS, forkserver=True) as sandbox:
        results: dict[str, ExecResult] = {}
        math_call = threading.Thread(
            target=lambda: results.update(math=sandbox.run("import numpy\nprint(numpy.e > 2)"))
        )
        lean_call = threading.Thread(target=lambda: results.update(lean=sandbox.run("print(7)")))
        math_call.start()
        try:
            assert entered.wait(60)
            lean_call.start()
            lean_call.join(60)
            assert not lean_call.is_alive(), "a lean call waited for the math server's start"
        finally:
            release.set()
            math_call.join()
            lean_call.join()
        assert [results[k].stdout for k in ("lean", "math")] == ["7\n", "True\n"]


def test_a_closed_forkserver_refuses_calls() -> None:
    with open_sandbox("stateless", limits=LIMITS) as sandbox:
        assert isinstance(sandbox, StatelessSandbox) and sandbox.engine == "forkserver"
    with pytest.raises(SandboxError, match="closed"):
        sandbox.run("1")


def test_without_a_forkserver_stateless_calls_still_run_isolated(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(self: ForkServer) -> None:
        raise SandboxError("no fork-server on this host")

    monkeypatch.setattr(ForkServer, "start", refuse)
    with open_sandbox("stateless", limits=LIMITS) as sandbox:
        assert isinstance(sandbox, StatelessSandbox) and sandbox.engine == "per-call"
        assert sandbox.run("import os\nprint(os.getuid())").stdout == "65534\n"
    assert "cannot start here" in caplog.text
    with pytest.raises(SandboxError, match="no fork-server"):
        open_sandbox("stateless", limits=LIMITS, forkserver=True)
    with pytest.raises(ValueError, match="forkserver=True"):
        runner.open_sandbox("stateful", forkserver=True)
