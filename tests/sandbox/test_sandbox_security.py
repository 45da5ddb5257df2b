"""What model code must not be able to do from inside the bwrap sandbox.

Each test runs hostile code and checks three things: it was contained (the code saw the
block), the host is unchanged, and no process of the sandbox is left afterwards. The
stateless tests run against both engines: the fork-server (the default) and a fresh bwrap
sandbox per call. Timeouts are kept small so the whole suite takes seconds.
"""

from __future__ import annotations

import ast
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent_gym.sandbox import Limits, StatelessSandbox, open_sandbox, process
from agent_gym.sandbox.config import FORKSERVER_SPARES, SANDBOX_ENV
from tests.helpers.procs import live_pids_of, marked, wait_until
from tests.helpers.sandbox_code import FILL_MEMORY

LIMITS = Limits(
    timeout=3.0,
    cpu_seconds=2,
    memory_bytes=256 << 20,
    file_bytes=1 << 20,
    output_bytes=4096,
    processes=32,
)
SECRET = "agent-gym-fake-secret-7f3a9c"


# Stateless sandboxes open in this module whose fork-server is expected to stay running.
_OPEN: list[StatelessSandbox] = []


def _children(pid: int) -> set[int]:
    try:
        return {int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except OSError:
        return set()


def _forkserver_processes() -> set[int]:
    """The open fork-servers' own processes: bwrap, the server and its idle spares.

    A call's leftovers are never the server's direct children (they live inside the call's
    own pid namespace), so they are still counted. A call's child that outlived its answer
    would be one: while the server has more children than spares, none is excluded.
    """
    own: set[int] = set()
    for box in _OPEN:
        servers = box.forkserver._servers.values() if box.forkserver else ()
        for server in filter(None, servers):
            children = _children(server.pid)
            bwrap = server.worker.popen.pid
            own |= {bwrap, *_children(bwrap), server.pid}
            if len(children) <= FORKSERVER_SPARES:
                own |= children
    return own


def _sandbox_pids() -> set[int]:
    """Live (non-zombie) processes of uid 65534, but the fork-servers' own."""
    return live_pids_of(65534) - _forkserver_processes()


def _wait_gone(predicate: Callable[[], object], seconds: float = 5.0) -> bool:
    return wait_until(lambda: not predicate(), seconds)


@pytest.fixture(scope="module", params=["forkserver", "per-call"])
def sandbox(request: pytest.FixtureRequest) -> Iterator[StatelessSandbox]:
    os.environ["AGENT_GYM_TEST_SECRET"] = SECRET  # in the parent before any sandbox starts
    box = open_sandbox("stateless", limits=LIMITS, forkserver=request.param == "forkserver")
    assert isinstance(box, StatelessSandbox) and box.engine == request.param
    _OPEN.append(box)
    yield box
    _OPEN.remove(box)
    box.close()
    os.environ.pop("AGENT_GYM_TEST_SECRET", None)


@pytest.fixture(autouse=True)
def no_process_left() -> Iterator[None]:
    before = _sandbox_pids()
    yield
    assert _wait_gone(lambda: _sandbox_pids() - before), (
        f"sandbox processes left behind: {_sandbox_pids() - before}"
    )


def test_sandbox_runs_as_nobody_without_capabilities(sandbox: StatelessSandbox) -> None:
    result = sandbox.run(
        "import os\nprint(os.getuid(), os.getgid(), os.getgroups())\n"
        "print(open('/proc/self/status').read())"
    )
    assert result.ok, result.observation()
    assert result.stdout.splitlines()[0] == "65534 65534 []"
    caps = {
        k: v
        for k, v in (
            line.split(":\t") for line in result.stdout.splitlines()[1:] if line.startswith("Cap")
        )
    }
    assert caps["CapEff"].strip("0\n") == "" and caps["CapPrm"].strip("0\n") == ""


def test_loopback_to_a_port_the_host_opened_is_unreachable(sandbox: StatelessSandbox) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.3)
        port = server.getsockname()[1]
        result = sandbox.run(
            "import socket\n"
            f"socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "print('CONNECTED')"
        )
        with pytest.raises(TimeoutError):
            server.accept()
    assert "CONNECTED" not in result.stdout
    assert result.error in {"ConnectionRefusedError", "OSError", "TimeoutError"}


def test_dns_and_external_addresses_are_unreachable(sandbox: StatelessSandbox) -> None:
    dns = sandbox.run("import socket\nprint(socket.getaddrinfo('pypi.org', 443))")
    assert dns.error == "gaierror", dns.observation()
    external = sandbox.run(
        "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\nprint('OUT')"
    )
    assert "OUT" not in external.stdout
    assert "Network is unreachable" in external.stderr, external.observation()


def test_secrets_on_disk_are_not_visible(sandbox: StatelessSandbox, tmp_path: Path) -> None:
    host_file = tmp_path / "host-only.txt"
    host_file.write_text("host data")
    host_file.chmod(0o644)
    result = sandbox.run(
        "import os\n"
        "print(sorted(os.listdir('/')), sorted(os.listdir('/etc')))\n"
        "for path in ['/etc/shadow', '/etc/passwd', " + repr(str(host_file)) + "]:\n"
        "    print(path, os.path.exists(path))\n"
        "print(open('/etc/shadow').read())"
    )
    assert result.error in {"FileNotFoundError", "PermissionError"}
    assert "True" not in result.stdout
    assert "root:" not in result.observation()
    top, etc = (
        ast.literal_eval(part + "]") for part in result.stdout.splitlines()[0][:-1].split("] ")
    )
    runtime_tops = {Path(p).parts[1] for p in (sys.prefix, sys.base_prefix)}
    system = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "proc", "dev", "tmp"}
    assert set(top) <= system | runtime_tops
    assert "shadow" not in etc and "passwd" not in etc


def test_parent_environment_is_not_visible(sandbox: StatelessSandbox) -> None:
    assert os.environ["AGENT_GYM_TEST_SECRET"] == SECRET
    code = textwrap.dedent(f"""
        import os, glob
        print(sorted(os.environ))
        print(os.environ.get('AGENT_GYM_TEST_SECRET'))
        for path in glob.glob('/proc/*/environ') + ['/proc/{os.getpid()}/environ']:
            try:
                data = open(path, 'rb').read()
            except OSError as exc:
                print(path, type(exc).__name__)
            else:
                print(path, {SECRET.encode()!r} in data, len(data))
    """)
    result = sandbox.run(code)
    assert result.ok, result.observation()
    assert SECRET not in result.stdout
    assert "True" not in result.stdout
    visible = set(ast.literal_eval(result.stdout.splitlines()[0]))
    assert visible <= {*SANDBOX_ENV, "PWD"}, visible - {*SANDBOX_ENV, "PWD"}


def test_writes_outside_the_private_tmp_fail_and_tmp_is_private(
    sandbox: StatelessSandbox, tmp_path: Path
) -> None:
    marker = f"agent-gym-escape-{os.getpid()}"
    targets = [
        "/",
        "/usr",
        "/etc",
        "/dev",
        "/proc",
        "/home",
        sys.prefix,
        sys.base_prefix,
        str(tmp_path),
    ]
    code = textwrap.dedent(f"""
        import os
        for directory in {targets!r}:
            try:
                with open(os.path.join(directory, {marker!r}), 'w') as f:
                    f.write('x')
                print('WROTE', directory)
            except OSError as exc:
                print('blocked', directory, type(exc).__name__)
        with open('/tmp/{marker}', 'w') as f:
            f.write('inside')
        print(open('/tmp/{marker}').read())
    """)
    result = sandbox.run(code)
    assert result.ok, result.observation()
    assert "WROTE" not in result.stdout
    assert result.stdout.rstrip().endswith("inside")
    for directory in [*targets, "/tmp"]:
        assert not os.path.exists(os.path.join(directory, marker))
    # The private /tmp does not outlive its call.
    again = sandbox.run(f"import os\nprint(os.path.exists('/tmp/{marker}'))")
    assert again.stdout.strip() == "False"


def test_fork_bomb_is_contained_and_other_sandboxes_keep_working(
    sandbox: StatelessSandbox,
) -> None:
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    results = {}
    thread = threading.Thread(target=lambda: results.update(bomb=sandbox.run(bomb, timeout=1.5)))
    thread.start()
    time.sleep(0.7)
    neighbour = sandbox.run("print('still fine')")
    thread.join()
    assert results["bomb"].status == "timeout"
    assert neighbour.ok and neighbour.stdout == "still fine\n"


@pytest.mark.parametrize("chunk", [20 << 20, 4 << 10], ids=["20MiB", "4KiB"])
def test_memory_hog_gets_memory_error(sandbox: StatelessSandbox, chunk: int) -> None:
    """With memory full to within 4 KB the error's report must be printed without importing
    anything (the per-call worker has no traceback module yet)."""
    result = sandbox.run(FILL_MEMORY + f"while True:\n    chunks.append(bytearray({chunk}))")
    assert result.error == "MemoryError", result.observation()


def test_an_error_is_reported_when_its_traceback_cannot_be_printed(
    sandbox: StatelessSandbox,
) -> None:
    """The traceback module may be out of reach (memory full, or poisoned as here): the
    worker must survive to report the cell's own error, with the failing line quoted."""
    code = "import sys\nsys.modules['traceback'] = None\nraise ValueError('the cell failed')"
    result = sandbox.run(code)
    assert result.error == "ValueError", result.observation()
    assert "ValueError: the cell failed" in result.stderr
    assert "raise ValueError('the cell failed')" in result.stderr


def test_endless_output_is_capped_and_the_tail_kept(sandbox: StatelessSandbox) -> None:
    result = sandbox.run("i = 0\nwhile True:\n    print('line', i)\n    i += 1")
    assert result.output_capped
    assert result.stdout_omitted > 0
    assert len(result.stdout.encode()) <= LIMITS.output_bytes
    assert "output size limit" in result.observation()
    big = sandbox.run("import os, tempfile\n"
                      "open(os.path.join(tempfile.gettempdir(), 'big'), 'wb').write(b'x' * (2 << 20))")
    assert big.error == "OSError" and "File too large" in big.stderr


def test_endless_loop_hits_the_cpu_limit_and_sleep_hits_the_timeout(
    sandbox: StatelessSandbox,
) -> None:
    # A wall-time limit far beyond the CPU limit: on a loaded host 2 s of CPU take longer.
    loop = sandbox.run("while True:\n    pass", timeout=60)
    assert loop.status == "crashed" and "CPU time limit" in (loop.error or "")
    start = time.monotonic()
    sleeper = sandbox.run("import time\ntime.sleep(60)", timeout=0.5)
    assert sleeper.status == "timeout"
    assert "ran longer than 0.5 s" in sleeper.observation()
    assert time.monotonic() - start < 3


def test_setsid_and_double_fork_escapees_die_with_the_sandbox(sandbox: StatelessSandbox) -> None:
    marker = "91.8273645"
    code = textwrap.dedent(f"""
        import os, subprocess
        subprocess.Popen(['sleep', '{marker}'], start_new_session=True)
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execvp('sleep', ['sleep', '{marker}'])
            os._exit(0)
        print('escaped?')
    """)
    result = sandbox.run(code)
    assert result.ok, result.observation()
    assert _wait_gone(lambda: marked(marker)), marked(marker)
    with open_sandbox("stateful", limits=LIMITS) as notebook:
        kept = notebook.run(code)
        assert kept.ok, kept.observation()
        assert wait_until(lambda: len(marked(marker)) == 2), "they live as long as the notebook"
    assert _wait_gone(lambda: marked(marker)), marked(marker)


def test_killing_the_harness_kills_every_sandbox_process(tmp_path: Path) -> None:
    marker = "82.7364519"
    harness = tmp_path / "harness.py"
    harness.write_text(
        textwrap.dedent(f"""
        import os, sys, time
        from agent_gym.sandbox import open_sandbox
        notebook = open_sandbox("stateful")
        code = ("import os, subprocess\\n"
                "subprocess.Popen(['sleep', '{marker}'], start_new_session=True)\\n"
                "if os.fork() == 0:\\n"
                "    os.setsid()\\n"
                "    os.execvp('sleep', ['sleep', '{marker}'])\\n")
        assert notebook.run(code).ok
        forked = open_sandbox("stateless")  # a fork-server, its spares waiting for calls
        assert forked.run("print(1)").ok
        pool = open_sandbox("stateless", pool_size=2, forkserver=False)
        while len(pool._idle) < 2:
            time.sleep(0.01)
        for worker in list(pool._idle):  # pre-started and idle, waiting for code
            pool.launcher.wait_ready(worker)
        print("ready", flush=True)
        time.sleep(600)
    """)
    )
    process = subprocess.Popen([sys.executable, str(harness)], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ready"
        assert wait_until(lambda: len(marked(marker)) == 2), marked(marker)
        process.send_signal(signal.SIGKILL)
        process.wait()
    finally:
        process.kill()
    assert _wait_gone(lambda: marked(marker)), marked(marker)


def test_killing_the_harness_mid_spawn_leaves_nothing(tmp_path: Path) -> None:
    """bwrap alone leaks a setup child stuck on an eventfd when its parent dies mid-setup
    (here a kill within ~2 ms of a spawn often did); the nursery pid namespace must not."""
    harness = tmp_path / "spawner.py"
    harness.write_text(textwrap.dedent("""
        from agent_gym.sandbox import Launcher
        launcher = Launcher()
        print("ready", flush=True)
        while True:
            launcher.spawn(single=True)
    """))
    for delay in (0.0, 0.002, 0.005, 0.01, 0.03, 0.08):
        process = subprocess.Popen([sys.executable, str(harness)], stdout=subprocess.PIPE)
        assert process.stdout is not None and process.stdout.readline().strip() == b"ready"
        time.sleep(delay)
        process.kill()
        process.wait()


def test_a_nursery_ends_once_its_owner_is_gone_even_without_a_signal() -> None:
    """The kernel's parent-death signal alone once let a dead worker's nursery live on: the
    init watches its owner itself. Run here without that signal and outside any namespace,
    so only the watch can end it."""
    owner = subprocess.Popen(["sleep", "0.5"])
    pidfd = os.pidfd_open(owner.pid)
    try:
        init = subprocess.Popen([sys.executable, "-S", "-c", process._NURSERY_INIT, str(pidfd)],
                                pass_fds=[pidfd])
    finally:
        os.close(pidfd)
    try:
        time.sleep(0.2)
        assert init.poll() is None  # it lives as long as its owner
        owner.wait()
        assert init.wait(timeout=10) == 0
    finally:
        init.kill()
        init.wait()
