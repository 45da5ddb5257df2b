"""Files of a training run that must survive a kill: atomic writes and metric trimming."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def keep_metrics_before(path: Path, step: int) -> None:
    """Drop metric lines a killed run wrote after its last checkpoint."""
    if not path.is_file():
        return
    kept = [
        line for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip() and json.loads(line)["step"] < step
    ]
    write_text(path, "".join(line + "\n" for line in kept))


def write_json(path: Path, value: Any) -> None:
    write_text(path, json.dumps(value, indent=1))


def write_text(path: Path, text: str) -> None:
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)  # atomic: a kill never leaves half a file


def append_metrics(path: Path, row: dict[str, Any]) -> None:
    """One line per step, on disk before the checkpoint that counts the step as done: a run
    killed between the two redoes the step instead of losing its line."""
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(row) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
