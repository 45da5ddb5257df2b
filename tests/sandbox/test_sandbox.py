"""The sandbox's execution modes: stateless, pooled, stateful, and the rlimits fallback."""

from __future__ import annotations

import os
import random
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_gym.sandbox import (
    STATE_LOST,
    IsolationUnavailableError,
    Limits,
    SandboxError,
    StatefulSandbox,
    StatelessSandbox,
    launch,
    open_sandbox,
)
from tests.helpers.procs import statuses, uid
from tests.helpers.sandbox_code import FILL_MEMORY

LIMITS = Limits(timeout=3.0, cpu_seconds=2, memory_bytes=256 << 20, output_bytes=2048)


@pytest.fixture(scope="module")
def stateless() -> Iterator[StatelessSandbox]:
    box = open_sandbox("stateless", limits=LIMITS)
    assert isinstance(box, StatelessSandbox)
    yield box
    box.close()


@pytest.fixture
def notebook() -> Iterator[StatefulSandbox]:
    box = open_sandbox("stateful", limits=LIMITS)
    assert isinstance(box, StatefulSandbox)
    yield box
    box.close()


def test_output_echo_and_errors(stateless: StatelessSandbox) -> None:
    result = stateless.run("import sys\nprint('out')\nprint('err', file=sys.stderr)\n6 * 7")
    assert (result.status, result.stdout, result.stderr) == ("ok", "out\n42\n", "err\n")
    assert result.observation() == "out\n42\nerr"
    assert stateless.run("x = 1").observation() == "(no output)"
    assert stateless.run("None").stdout == ""


def test_tracebacks_start_in_the_cell_and_quote_it(stateless: StatelessSandbox) -> None:
    result = stateless.run("def f(n):\n    return 1 / n\nf(0)")
    assert (result.status, result.error) == ("error", "ZeroDivisionError")
    assert 'File "<cell-1>", line 3' in result.stderr and "return 1 / n" in result.stderr
    assert "_worker" not in result.stderr and "exec(" not in result.stderr
    syntax = stateless.run("def broken(:\n    pass")
    assert syntax.error == "SyntaxError" and "def broken(:" in syntax.stderr
    assert "_run_cell" not in syntax.stderr and "Traceback" not in syntax.stderr
    assert stateless.run("raise SystemExit(3)").observation() == "SystemExit: 3"


def test_stateless_calls_share_nothing_and_replay_identically(stateless: StatelessSandbox) -> None:
    state = "import os, tempfile\npath = os.path.join(tempfile.gettempdir(), 'state')\n"
    stateless.run(state + "secret = 41\nopen(path, 'w').write('x')")
    assert stateless.run("secret").error == "NameError"
    assert stateless.run(state + "os.path.exists(path)").stdout == "False\n"
    code = "import random\nprint(random.random(), {'b', 'a', 'c'}, hash('agent'))"
    first = stateless.run(code).stdout
    assert first == stateless.run(code).stdout
    assert first.startswith(f"{random.Random(0).random()} ")  # seeded on first import


def test_pool_serves_each_worker_once_and_refills(tmp_path: Path) -> None:
    box = open_sandbox("stateless", limits=LIMITS, pool_size=2, forkserver=False)
    assert isinstance(box, StatelessSandbox) and box.engine == "per-call"
    try:
        pids = set()
        for _ in range(4):
            result = box.run("import os\nprint(os.getpid(), globals().get('seen'))\nseen = 1")
            assert result.ok and result.stdout.split()[1] == "None"
            pids.add(result.stdout.split()[0])
        deadline = time.monotonic() + 10
        while len(box._idle) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(box._idle) == 2
        results: list[str] = []
        threads = [
            threading.Thread(target=lambda i=i: results.append(box.run(f"print({i} ** 2)").stdout))
            for i in range(6)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(results) == sorted(f"{i**2}\n" for i in range(6))
    finally:
        box.close()
    assert not box._idle
    with pytest.raises(SandboxError, match="closed"):
        box.run("1")


def test_notebook_keeps_state_and_survives_memory_error(notebook: StatefulSandbox) -> None:
    assert notebook.run("import math\ntotal = 40").ok
    assert notebook.run("total += 2\ntotal").stdout == "42\n"
    hog = notebook.run("big = bytearray(1 << 30)")
    assert hog.error == "MemoryError" and not hog.state_lost
    assert notebook.run("math.isqrt(total * total)").stdout == "42\n"
    printed = notebook.run("print('only this cell')")
    assert printed.stdout == "only this cell\n"  # earlier cells' output is not repeated


def test_notebook_reports_a_memory_error_while_its_globals_still_fill_memory(
    notebook: StatefulSandbox,
) -> None:
    """The hog's chunks stay in the notebook's globals, so the error is reported with memory
    full to within 4 KB; the notebook keeps its state and works again once they are freed."""
    assert notebook.run("kept = 7").ok
    hog = notebook.run(FILL_MEMORY + "while True:\n    chunks.append(bytearray(4096))")
    assert hog.error == "MemoryError" and not hog.state_lost, hog.observation()
    assert "chunks.append(bytearray(4096))" in hog.stderr  # the full traceback, quoting the cell
    assert notebook.run("del chunks\nkept * 6").stdout == "42\n"


def test_code_nested_too_deep_to_compile_is_an_error_not_a_crash(
    notebook: StatefulSandbox,
) -> None:
    """CPython's parser answers deep nesting with a MemoryError from ``compile``; the
    notebook reports it as the cell's error and keeps its state."""
    assert notebook.run("kept = 7").ok
    for code in ("-" * 200_000 + "1", "1 if 1 else " * 50_000 + "1"):
        nested = notebook.run(code)
        assert (nested.status, nested.error, nested.state_lost) == ("error", "MemoryError", False)
    assert notebook.run("kept * 6").stdout == "42\n"


def test_notebook_timeout_and_crash_lose_state_and_say_so(notebook: StatefulSandbox) -> None:
    notebook.run("kept = 1")
    timed_out = notebook.run("import time\ntime.sleep(30)", timeout=0.5)
    assert (timed_out.status, timed_out.state_lost) == ("timeout", True)
    assert STATE_LOST in timed_out.observation()
    assert notebook.run("kept").error == "NameError"
    notebook.run("kept = 2")
    crashed = notebook.run("import os\nos._exit(7)")
    assert (crashed.status, crashed.state_lost, crashed.error) == ("crashed", True, "exit code 7")
    assert "exit code 7" in crashed.observation() and STATE_LOST in crashed.observation()
    assert notebook.run("kept").error == "NameError"
    notebook.run("kept = 3")
    notebook.reset()
    assert notebook.run("kept").error == "NameError"


def test_a_notebook_that_failed_to_start_starts_afresh_on_the_next_call(
    notebook: StatefulSandbox,
) -> None:
    python, notebook.launcher.python = notebook.launcher.python, "/usr/bin/false"
    notebook.reset()  # this interpreter exits at once
    notebook.launcher.python = python
    with pytest.raises(SandboxError, match="did not start"):
        notebook.run("1")
    assert notebook.run("6 * 7").stdout == "42\n"  # not the dead worker again


def test_notebook_cpu_budget_is_per_cell() -> None:
    limits = Limits(timeout=5.0, cpu_seconds=1, memory_bytes=256 << 20)
    with open_sandbox("stateful", limits=limits) as box:
        burn = (
            "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end:\n pass"
        )
        for _ in range(3):  # 1.8 s of CPU in total, 0.6 s per cell
            result = box.run(burn)
            assert result.ok, result.observation()


def test_bad_arguments_are_refused_clearly(stateless: StatelessSandbox) -> None:
    with pytest.raises(ValueError, match="timeout"):
        Limits(timeout=0)
    with pytest.raises(ValueError, match="processes"):
        Limits(processes=2)
    with pytest.raises(ValueError, match="mode"):
        open_sandbox("notebook")
    with pytest.raises(ValueError, match="isolation"):
        open_sandbox(isolation="docker")
    with pytest.raises(ValueError, match="timeout"):
        stateless.run("1", timeout=-1)
    with pytest.raises(TypeError, match="str"):
        stateless.run(b"1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pool_size"):
        open_sandbox("stateful", pool_size=2)


def test_missing_bwrap_refuses_and_names_the_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "find_bwrap", lambda: None)
    with pytest.raises(IsolationUnavailableError, match="isolation='rlimits'"):
        open_sandbox("stateless")


def test_bwrap_that_cannot_create_namespaces_is_reported(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tmp_path.chmod(0o755)  # its ancestors stay 0700: the launcher must re-expose them
    fake = tmp_path / "bwrap"
    fake.write_text(
        "#!/bin/sh\necho 'bwrap: No permissions to create a new namespace' >&2\nexit 1\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    monkeypatch.setattr(launch, "find_bwrap", lambda: str(fake))
    with pytest.raises(IsolationUnavailableError, match="No permissions to create") as caught:
        open_sandbox("stateless", limits=Limits(memory_bytes=300 << 20))
    assert "isolation='rlimits'" in str(caught.value)


def test_rlimits_mode_is_an_explicit_loud_opt_in() -> None:
    with pytest.warns(RuntimeWarning, match="WITHOUT namespaces"):
        box = open_sandbox("stateful", isolation="rlimits", limits=LIMITS)
    try:
        assert box.isolation == "rlimits"
        assert box.launcher.warning is not None
        result = box.run("import os\nx = 5\nprint(os.getuid(), os.getcwd())")
        assert result.ok, result.observation()
        uid, cwd = result.stdout.split()
        assert uid == ("65534" if os.geteuid() == 0 else str(os.geteuid()))
        assert "agent-gym-sandbox-" in cwd
        assert box.run("x * 2").stdout == "10\n"
        assert box.run("bytearray(1 << 30)").error == "MemoryError"
    finally:
        box.close()
    assert not os.path.exists(cwd)


def _orphaned_sandbox_zombies() -> set[int]:
    """Dead sandbox processes handed to the host's init: what a careless kill leaves."""
    return {pid for pid, fields in statuses()
            if fields.get("State", "").startswith("Z") and fields.get("PPid") == "1"
            and uid(fields) == launch.NOBODY}


def test_teardown_kills_the_namespace_init_first_even_mid_start() -> None:
    before = _orphaned_sandbox_zombies()
    launcher = launch.Launcher(limits=LIMITS)
    for delay in range(12):  # killed at various points while bwrap is still setting up
        worker = launcher.spawn(single=True)
        time.sleep(delay / 1000)
        worker.close()
    with open_sandbox("stateful", limits=LIMITS) as box:
        box.run("x = 1")
        for _ in range(3):  # replaced without ever being used, as check_env's resets do
            time.sleep(0.05)
            box.reset()
    assert _orphaned_sandbox_zombies() - before == set()
