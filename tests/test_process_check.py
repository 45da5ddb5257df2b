"""The end-of-run check in `tests/conftest.py`: a sandbox process that outlives the run fails
it by name; processes the run does not own, or still legitimately holds, do not."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent_gym.sandbox import IsolationUnavailableError, open_sandbox
from tests.conftest import LEFTOVER_GRACE, NOBODY, descendants, leftover_processes, read_process

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="starting uid-65534 processes needs root")

# Orphans a uid-65534 `sleep`, as a nursery whose parent died is orphaned.
ORPHAN = (
    "import subprocess\n"
    f"print(subprocess.Popen(['sleep', '{{seconds}}'], user={NOBODY}, start_new_session=True, "
    "stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)\n"
)


def orphan(seconds: int) -> int:
    done = subprocess.run([sys.executable, "-c", ORPHAN.format(seconds=seconds)],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


def gone(pid: int) -> bool:
    process = read_process(pid)
    return process is None or process.state == "Z"


def test_an_orphaned_uid_65534_process_is_found_by_pid_and_command() -> None:
    pid = orphan(60)
    try:
        found = {p.pid: p for p in leftover_processes()}
        assert pid in found, "the orphan was not reparented to this run, or not recognised"
        assert found[pid].ppid == os.getpid()  # this session is the subreaper
        assert f"pid {pid}" in found[pid].describe() and "sleep 60" in found[pid].describe()
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)  # it is this process's child now
    assert pid not in {p.pid for p in leftover_processes()}


def test_a_closed_sandbox_leaves_only_its_nursery_which_is_no_leftover() -> None:
    """The nursery lives as long as this process by design: it must not fail the run.

    Compared with what was there before, so that earlier tests of the session cannot
    decide it (the session reaps their adopted orphans only at its end).
    """
    before = {p.pid for p in leftover_processes()}
    try:
        box = open_sandbox("stateful")
    except IsolationUnavailableError as err:
        pytest.skip(f"no bwrap here: {err}")
    try:
        assert box.run("6 * 7").ok
        running = [p for p in leftover_processes() if p.pid not in before]
        assert any(NOBODY in p.uids for p in running), running  # a live sandbox is found
    finally:
        box.close()
    deadline = time.monotonic() + LEFTOVER_GRACE  # teardown finishes in the background
    while {p.pid for p in leftover_processes()} - before and time.monotonic() < deadline:
        time.sleep(0.05)
    left = {p.pid for p in leftover_processes()}
    assert left <= before
    nurseries = [p for p in descendants(os.getpid())
                 if p.namespace_init and p.cmdline and p.ppid == os.getpid()]
    assert nurseries and not {p.pid for p in nurseries} & left


def run_inner_session(tmp_path: Path, test_source: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_inner.py").write_text(test_source)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
         "test_inner.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )


def test_a_run_that_leaves_a_sandbox_process_fails_and_names_it(tmp_path: Path) -> None:
    inner = run_inner_session(tmp_path, (
        "import subprocess, sys\n"
        "def test_leaks():\n"
        f"    code = {ORPHAN.format(seconds=300)!r}\n"
        "    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)\n"
        "    open('leaked.pid', 'w').write(out.stdout)\n"
    ))
    pid = int((tmp_path / "leaked.pid").read_text())
    assert inner.returncode == 1, inner.stdout[-3000:]
    assert "1 passed" in inner.stdout and "sandbox processes left behind" in inner.stdout
    assert f"pid {pid} [sleep] (uid {NOBODY}" in inner.stdout and "sleep 300" in inner.stdout
    deadline = time.monotonic() + 10
    while not gone(pid) and time.monotonic() < deadline:  # killed by the check
        time.sleep(0.05)
    assert gone(pid)


def test_processes_of_other_runs_are_not_this_runs_leftovers(tmp_path: Path) -> None:
    """Engineers share machines: a uid-65534 process this (outer) run holds is alive while
    the inner run ends, and the inner run must still pass."""
    pid = orphan(60)
    try:
        inner = run_inner_session(tmp_path, "def test_clean():\n    pass\n")
        assert inner.returncode == 0, inner.stdout[-3000:]
        assert "left behind" not in inner.stdout
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def test_a_killed_harness_leaves_nothing_once_the_run_reaps_what_it_adopted(
    tmp_path: Path,
) -> None:
    """A harness killed mid-episode orphans its sandboxes to the session, whose nursery can
    finish dying only once they are reaped: the run must reap them, and then pass."""
    try:
        open_sandbox("stateless").close()
    except IsolationUnavailableError as err:
        pytest.skip(f"no bwrap here: {err}")
    inner = run_inner_session(tmp_path, (
        "import subprocess, sys\n"
        "HARNESS = ('from agent_gym.sandbox import open_sandbox\\n'\n"
        "           'box = open_sandbox(\"stateful\")\\n'\n"
        "           'assert box.run(\"1\").ok\\n'\n"
        "           'print(\"ready\", flush=True)\\n'\n"
        "           'import time; time.sleep(600)\\n')\n"
        "def test_kills_its_harness():\n"
        "    harness = subprocess.Popen([sys.executable, '-c', HARNESS], stdout=subprocess.PIPE,\n"
        "                               text=True)\n"
        "    assert harness.stdout.readline().strip() == 'ready'\n"
        "    harness.kill()\n"
        "    harness.wait()\n"
    ))
    assert inner.returncode == 0, inner.stdout[-3000:]
    assert "left behind" not in inner.stdout

