"""What the sandbox tests read of this machine's processes: ``/proc`` scanned once per
question, with processes that vanish mid-scan skipped."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path


def statuses() -> Iterator[tuple[int, dict[str, str]]]:
    """``(pid, fields of /proc/PID/status)`` for every process still there."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        yield int(entry.name), dict(
            line.split(":\t", 1) for line in status.splitlines() if ":\t" in line
        )


def uid(fields: dict[str, str]) -> int:
    return int(fields.get("Uid", "-1").split("\t")[0])


def live_pids_of(user: int) -> set[int]:
    """Processes of ``user`` that are not zombies, but those another pytest-xdist worker
    started: the workers share the machine's sandbox user, so one worker's live sandboxes
    are not another's leftovers. An orphan (reparented past every worker) still counts."""
    parents = {pid: int(fields.get("PPid", "0")) for pid, fields in statuses()}
    workers_parent, me = os.getppid(), os.getpid()

    def a_sibling_workers(pid: int) -> bool:
        seen: set[int] = set()
        while pid > 1 and pid not in seen:
            seen.add(pid)
            if pid == me:
                return False
            if parents.get(pid) == workers_parent:
                return "PYTEST_XDIST_WORKER" in os.environ
            pid = parents.get(pid, 0)
        return False

    return {pid for pid, fields in statuses()
            if uid(fields) == user and not fields.get("State", "").startswith("Z")
            and not a_sibling_workers(pid)}


def marked(marker: str) -> list[int]:
    """Processes whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline:
                found.append(int(entry.name))
    return found


def wait_until(predicate: Callable[[], object], seconds: float = 10.0) -> bool:
    """Poll ``predicate`` until it holds or ``seconds`` pass; whether it held."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False
