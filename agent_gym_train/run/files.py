"""The files of a run (``--out``), read and written here and nowhere else.

``metrics.jsonl``: one line per step, fsynced before the checkpoint that counts the step as
done. ``checkpoint.json``: the latest checkpoint's backend path, its step, the arguments
and, for TEMPO, its store file, written atomically last, so a run killed at any point
continues, when its command runs again into the same ``--out``, from a whole checkpoint and
redoes at most the steps after it, with the metrics lines of those steps dropped.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from agent_gym.durable import append_lines, open_append, open_regular, read_jsonl, replace_file

CHECKPOINT_FILE = "checkpoint.json"
METRICS_FILE = "metrics.jsonl"

# One metrics line: numbers, None (not measured this step), the phase, counts by end reason.
Metrics = dict[str, float | int | str | dict[str, int] | None]


class RunConfigError(ValueError):
    """The arguments cannot run: a user error, reported in one line by ``agent-gym train``."""



@dataclass(frozen=True)
class Checkpoint:
    """``checkpoint.json``: the step it completes, the backend's checkpoint path, the run's
    arguments, (TEMPO) the store file saved with it and, for a run whose rollouts may be
    sampled on older weights (``--max-staleness``), the paths of the checkpoints of those
    older weights by step, so a continued run samples on what an uninterrupted one did."""

    step: int
    path: str
    args: dict[str, object]
    store: str | None = None
    earlier: dict[int, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        record: dict[str, object] = {"step": self.step, "path": self.path, "args": self.args}
        return (record | ({"store": self.store} if self.store is not None else {})
                | ({"earlier": {str(k): v for k, v in self.earlier.items()}}
                   if self.earlier else {}))

    @classmethod
    def read(cls, path: Path) -> Checkpoint:
        saved = json.loads(path.read_text(encoding="utf-8"))
        earlier = {int(k): str(v) for k, v in dict(saved.get("earlier", {})).items()}
        return cls(saved["step"], saved["path"], saved["args"], saved.get("store"), earlier)


def write_text(path: Path, text: str) -> None:
    """``path`` replaced whole (``agent_gym.durable.replace_file``): a kill never leaves half
    a file, and a checkpoint record is on disk once this returns."""
    replace_file(path, text)


def append_metrics(path: Path, row: Metrics) -> None:
    """One line per step, on disk before the checkpoint that counts the step as done: a run
    killed between the two redoes the step instead of losing its line."""
    fd = open_append(path)
    try:
        append_lines(fd, (json.dumps(row) + "\n").encode("utf-8"))
    finally:
        os.close(fd)


def read_metrics(path: Path) -> list[Metrics]:
    """The metrics lines of a run, in order; a line that does not read is a
    ``RunConfigError`` naming it."""
    with open_regular(path) as handle:
        rows = []
        for line in read_jsonl(handle):
            if line.problem is not None or not isinstance(line.value, dict):
                raise RunConfigError(f"{path}: line {line.number} "
                                     f"{line.problem or 'is not a JSON object'}")
            rows.append(line.value)
    return rows


def keep_metrics_before(path: Path, step: int) -> list[Metrics]:
    """Drop metric lines a killed run wrote after its last checkpoint; returns the lines
    kept (what a continued run rebuilds its state from)."""
    if not path.is_file():
        return []
    kept = [row for row in read_metrics(path) if row["step"] < step]
    write_text(path, "".join(json.dumps(row) + "\n" for row in kept))
    return kept


def checkpoint_path(spec: str) -> str:
    """The backend path a checkpoint spec names, wherever one is taken (``--init-from``, a
    ``local:MODEL@CHECKPOINT`` policy or teacher): a run directory or its
    ``checkpoint.json`` stands for the run's latest checkpoint; anything else is a backend
    path already. A ``RunConfigError`` starts with ``spec``, for the caller to prefix."""
    local = Path(spec)
    record = local / CHECKPOINT_FILE if local.is_dir() else local
    if record.name == CHECKPOINT_FILE and record.is_file():
        try:
            return Checkpoint.read(record).path
        except (ValueError, KeyError, OSError) as err:
            raise RunConfigError(f"{spec}: {record} is not a readable checkpoint record "
                                 f"({type(err).__name__}: {err})") from err
    if local.is_dir() and not any(local.iterdir()):
        raise RunConfigError(f"{spec}: an empty directory, not a run or checkpoint")
    return spec
