"""The files of a run (``--out``), read and written here and nowhere else.

``metrics.jsonl``: one line per step, fsynced before the checkpoint that counts the step as
done. ``checkpoint.json``: the latest checkpoint's backend path, its step, the arguments
and, for TEMPO, its store file, written atomically last, so a run killed at any point
continues, when its command runs again into the same ``--out``, from a whole checkpoint and
redoes at most the steps after it, with the metrics lines of those steps dropped.

Both are read as untrusted (another version, a crash or a hand wrote them). A
``checkpoint.json`` that does not read, or a ``metrics.jsonl`` with a line that does not
(but a cut last one: the line a kill interrupted, of a step no checkpoint counts, dropped
as any line after the checkpoint is), is a ``RunConfigError`` of one line, and the file is
moved aside (``NAME.damaged``), never deleted, so that the next run into ``--out`` can
start.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from agent_gym import durable, untrusted
from agent_gym.durable import append_lines, open_append, open_regular, read_jsonl, replace_file

CHECKPOINT_FILE = "checkpoint.json"
METRICS_FILE = "metrics.jsonl"
MAX_CHECKPOINT_BYTES = 16 * 2**20  # the arguments and a few paths

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
    def read(cls, path: Path, *, set_aside_damaged: bool = True) -> Checkpoint:
        """The record at ``path``, schema-checked; a ``RunConfigError`` when it does not
        read, with the file moved aside first (``set_aside_damaged``: a run's own record,
        never another run's named by ``--init-from``)."""
        try:
            with open_regular(path) as handle:
                saved = untrusted.loads(handle.read(MAX_CHECKPOINT_BYTES + 1))
            return cls._from_json(saved)
        except (OSError, ValueError, TypeError, KeyError) as err:
            problem = f"{type(err).__name__}: {err}"
            if not set_aside_damaged or isinstance(err, FileNotFoundError):
                raise RunConfigError(f"{path} is not a readable checkpoint record "
                                     f"({problem})") from err
            aside = durable.set_aside(path)
            raise RunConfigError(
                f"{path} is not a readable checkpoint record ({problem}); moved to "
                f"{aside.name}: restore it to continue the run, or run again to start it "
                "afresh in this --out") from err

    @classmethod
    def _from_json(cls, saved: object) -> Checkpoint:
        if not isinstance(saved, dict):
            raise TypeError("not a JSON object")
        step, path, args, store = (saved["step"], saved["path"], saved["args"],
                                   saved.get("store"))
        earlier = saved.get("earlier", {})
        if not (type(step) is int and step >= 0 and isinstance(path, str)
                and isinstance(args, dict) and (store is None or isinstance(store, str))
                and isinstance(earlier, dict)
                and all(isinstance(v, str) for v in earlier.values())):
            raise TypeError("a field of another type than agent-gym writes")
        return cls(step, path, args, store, {int(k): v for k, v in earlier.items()})


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
    """Drop metric lines a killed run wrote after its last checkpoint (a cut last line
    among them); returns the lines kept (what a continued run rebuilds its state from).
    Any other line that does not read: the file is moved aside and a ``RunConfigError``
    says so."""
    if not path.is_file():
        return []
    kept = []
    with open_regular(path) as handle:
        for line in read_jsonl(handle):
            value = line.value
            if line.problem == durable.CUT_LINE:
                break  # the last line: a kill cut it before its checkpoint was written
            if line.problem is not None or not isinstance(value, dict) \
                    or type(value.get("step")) is not int:
                problem = line.problem or "is not a metrics line agent-gym wrote"
                aside = durable.set_aside(path)
                raise RunConfigError(
                    f"{path}: line {line.number} {problem}; moved to {aside.name} (the run "
                    "continues from its checkpoint without the earlier lines if run again)")
            if value["step"] < step:
                kept.append(value)
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
            return Checkpoint.read(record, set_aside_damaged=False).path
        except RunConfigError as err:
            raise RunConfigError(f"{spec}: {err}") from err
    if local.is_dir() and not any(local.iterdir()):
        raise RunConfigError(f"{spec}: an empty directory, not a run or checkpoint")
    return spec
