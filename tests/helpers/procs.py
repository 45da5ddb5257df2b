"""What the sandbox tests read of this machine's processes: ``/proc`` scanned once per
question, with processes that vanish mid-scan skipped."""

from __future__ import annotations

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
    """Processes of ``user`` that are not zombies."""
    return {pid for pid, fields in statuses()
            if uid(fields) == user and not fields.get("State", "").startswith("Z")}


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
