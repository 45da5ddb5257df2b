"""A sandbox's memory is bounded as a whole, and a call ends only when its code has.

Every test runs under the mechanism this host allows (``auto``: a cgroup where it can make
one) and under the fallback forced on (``watcher``), on every engine: the fork-server, a
bwrap sandbox per call, and a notebook. Each checks that nothing is left afterwards: no
process of the sandbox user and none of this process's sandbox cgroups.
"""

from __future__ import annotations

import logging
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_gym.sandbox import (
    Limits,
    SandboxError,
    StatefulSandbox,
    StatelessSandbox,
    memory,
    open_sandbox,
)
from tests.helpers.procs import live_pids_of, marked, wait_until

CHILDREN, CHILD_BYTES = 6, 40 << 20
LIMITS = Limits(timeout=10.0, cpu_seconds=5, memory_bytes=96 << 20, tmp_bytes=4 << 20)
# The most any bound here allows: a cgroup's limit with a generous allowance for the warm
# fork-server's pages. Six children of 40 MB (240 MB) are far over it.
MOST = memory.sandbox_limit(LIMITS, warm=64 << 20)
assert CHILDREN * CHILD_BYTES > MOST

ENGINES = ["forkserver", "per-call", "stateful"]
BOUNDS = ["auto", "watcher"]

# Forks children that each fill 40 MB and keep it; prints how many filled theirs and how
# many are still alive once all have filled or died. If all are alive, nothing bounded
# them: it then keeps holding until the call's timeout.
HUNGRY_CHILDREN = f"""
import os, time
r, w = os.pipe()
pids = []
for _ in range({CHILDREN}):
    pid = os.fork()
    if pid == 0:
        os.close(r)
        held = b'x' * {CHILD_BYTES}
        os.write(w, b'+')
        os.close(w)
        time.sleep(60)
        os._exit(0)
    pids.append(pid)
os.close(w)
got = b''
while len(got) < {CHILDREN}:
    chunk = os.read(r, {CHILDREN})
    if not chunk:
        break
    got += chunk
alive = sum(os.waitpid(pid, os.WNOHANG)[0] == 0 for pid in pids)
print(got.count(b'+'), alive, flush=True)
if alive == {CHILDREN}:
    time.sleep(60)
"""


def _open(engine: str, bound: str, limits: Limits = LIMITS) -> StatelessSandbox | StatefulSandbox:
    if engine == "stateful":
        return open_sandbox("stateful", limits=limits, memory_bound=bound)
    return open_sandbox(
        "stateless", limits=limits, forkserver=engine == "forkserver", memory_bound=bound
    )


@pytest.fixture(autouse=True)
def nothing_left() -> Iterator[None]:
    before = live_pids_of(65534)
    yield
    assert wait_until(lambda: not live_pids_of(65534) - before), live_pids_of(65534) - before
    assert memory.leftover_cgroups() == []


@pytest.fixture(params=BOUNDS)
def bound(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.parametrize("engine", ENGINES)
def test_forked_children_cannot_hold_more_than_the_limit_together(engine: str, bound: str) -> None:
    with _open(engine, bound) as box:
        assert box.memory_bound in ("cgroup-v1", "cgroup-v2", "watcher")
        if bound == "watcher":
            assert box.memory_bound == "watcher"
        result = box.run(HUNGRY_CHILDREN)
    if result.status == "ok":  # a cgroup: the kernel killed children as they filled it
        assert box.memory_bound != "watcher"
        alive = int(result.stdout.split()[1])
        assert alive * CHILD_BYTES <= MOST, result.stdout
    else:  # the watcher (or a cgroup that killed the cell itself) ended the whole sandbox
        assert result.status == "crashed", result.observation()
        assert "memory limit" in (result.error or ""), result.observation()
        assert "all its processes together" in result.observation()


@pytest.mark.parametrize("engine", ENGINES)
def test_one_process_still_gets_a_memory_error_the_code_can_handle(engine: str, bound: str) -> None:
    """The bound on the whole sandbox leaves one process its own limit: it is never killed
    for memory it may address, and a notebook keeps its state."""
    with _open(engine, bound) as box:
        fill = box.run(
            "kept = b'x' * (48 << 20)\n"
            "try:\n    more = bytearray(64 << 20)\nexcept MemoryError:\n    print('refused')\n"
            "print(len(kept) >> 20)"
        )
        assert fill.ok and fill.stdout.split() == ["refused", "48"], fill.observation()
        if isinstance(box, StatefulSandbox):
            assert box.run("print(len(kept) >> 20)").stdout == "48\n"


def test_the_mechanism_is_named_in_the_log(caplog: pytest.LogCaptureFixture, bound: str) -> None:
    with (
        caplog.at_level(logging.INFO, logger="agent_gym.sandbox.launch"),
        _open("per-call", bound) as box,
    ):
        line = next(r.getMessage() for r in caplog.records if "sandbox memory" in r.getMessage())
        assert ("watcher" in line) == (box.memory_bound == "watcher"), line


def test_without_cgroups_auto_falls_back_and_cgroup_refuses(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_cgroup() -> tuple[int, str]:
        raise PermissionError(13, "Permission denied: /sys/fs/cgroup/memory/x")

    monkeypatch.setattr(memory, "_own_memory_cgroup", no_cgroup)
    monkeypatch.setattr(memory, "_trees", {})
    with pytest.raises(SandboxError, match=r"no memory cgroup can be made.*memory_bound='watcher'"):
        _open("per-call", "cgroup")
    with (
        caplog.at_level(logging.INFO, logger="agent_gym.sandbox.launch"),
        _open("per-call", "auto") as box,
    ):
        assert box.memory_bound == "watcher"
        assert box.run("print(1)").stdout == "1\n"
    assert any("Permission denied" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="memory_bound must be one of"):
        _open("per-call", "swap")


@pytest.mark.skipif(memory.SandboxMemory().mechanism == "watcher", reason="no cgroup here")
def test_cgroups_a_dead_process_left_are_removed() -> None:
    own = memory._own_memory_cgroup()[1]
    gone = subprocess.Popen(["true"])
    gone.wait()
    left = Path(own) / f"agent-gym-{gone.pid}"
    (left / "s1").mkdir(parents=True)
    try:
        with _open("per-call", "auto") as box:
            assert box.run("print(1)").ok
        assert not left.exists()
    finally:
        if (left / "s1").exists():
            (left / "s1").rmdir()
        if left.exists():
            left.rmdir()


# ---------------------------------------------------------------- item 11: early return
# Writes a completion line to every descriptor it has (the result pipe among them), then
# keeps running: itself, holding 20 MB, and a child found by the marker in its command line.
FORGED = """
import os, subprocess, time
subprocess.Popen(['sleep', '{marker}'])
held = b'x' * (20 << 20)
for fd in range(3, 64):
    try:
        os.write(fd, b'ok\\n')
    except OSError:
        pass
time.sleep(60)
"""


@pytest.mark.parametrize("engine", ["forkserver", "per-call"])
def test_a_forged_completion_line_does_not_end_the_call(engine: str) -> None:
    marker = "73.1190472" if engine == "forkserver" else "73.1190473"
    with _open(engine, "auto") as box:
        result = box.run(FORGED.format(marker=marker), timeout=1.0)
        assert result.status == "timeout", result.observation()
        assert marked(marker) == [], "a process of the call outlived it"
        # The engine still answers truthfully afterwards.
        assert box.run("print('next')").stdout == "next\n"


@pytest.mark.parametrize("engine", ["forkserver", "per-call"])
def test_nothing_of_a_call_is_running_once_it_returns(engine: str) -> None:
    marker = "73.1190474" if engine == "forkserver" else "73.1190475"
    code = textwrap.dedent(f"""
        import subprocess
        subprocess.Popen(['sleep', '{marker}'])
        print('started')
    """)
    with _open(engine, "auto") as box:
        for _ in range(3):
            result = box.run(code)
            assert result.ok and result.stdout == "started\n", result.observation()
            assert marked(marker) == [], "the call returned with its process still running"


def test_forged_lines_before_the_real_one_do_not_change_the_outcome() -> None:
    """The last line the call's child writes is its own: earlier ones the code wrote
    (a claimed error here) are not the outcome."""
    with _open("forkserver", "auto") as box:
        result = box.run(
            "import os\nfor fd in range(3, 64):\n"
            "    try: os.write(fd, b'error Forged\\n')\n    except OSError: pass\nprint('done')"
        )
        assert result.ok and result.stdout == "done\n", result.observation()
        ended = box.run("import os\nos._exit(0)")
        assert ended.status == "crashed" and ended.error == "exit code 0"


# Memory no process maps: 60 memfd files of 16 MB, written and held open (960 MB), under a
# bound of about 150 MB. No resident set holds these pages; the kernel charges them.
MEMFDS = """
import os, time
fds = []
for i in range(60):
    fd = os.memfd_create(f"m{i}")
    for _ in range(16):
        os.write(fd, bytes(1 << 20))
    fds.append(fd)
print(len(fds) * 16, "MB held", flush=True)
time.sleep(30)
"""
# 64 MB of memfd files, each mapped and touched with its fd still open: counted once, it
# fits the bound; counted as a file and as resident pages, it would not.
MAPPED_MEMFDS = """
import mmap, os
maps = []
for i in range(4):
    fd = os.memfd_create(f"m{i}")
    os.write(fd, bytes(16 << 20))
    maps.append(mmap.mmap(fd, 16 << 20))
    maps[-1][::4096] = b"y" * 4096  # a byte in every page
print(sum(len(m) for m in maps) >> 20, flush=True)
"""
MEMFD_LIMITS = Limits(timeout=40.0, cpu_seconds=20, memory_bytes=128 << 20, tmp_bytes=4 << 20,
                      open_files=128)


@pytest.mark.parametrize("engine", ENGINES)
def test_memfd_pages_count_against_the_bound(engine: str, bound: str) -> None:
    with _open(engine, bound, MEMFD_LIMITS) as box:
        held = box.run(MEMFDS)
        shared = box.run(MAPPED_MEMFDS)
    assert held.status == "crashed", held.observation()
    assert "memory limit" in (held.error or ""), held.observation()
    assert held.duration < 10, held.duration
    assert shared.ok and shared.stdout == "64\n", shared.observation()
