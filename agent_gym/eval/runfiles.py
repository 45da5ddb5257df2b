"""What a run directory holds, and the one reader of its files.

Every file of a run directory is untrusted input to whoever reads it next: another version
wrote it, a crash cut it, a disk corrupted it, a hand edited it. So every reader (a resume,
``view``, ``compare``, ``rescore``, a suite's overall row) goes through ``read_log`` and
``read_config``: JSON of bounded depth and line length, finite numbers in sane ranges, each
record checked against its schema. What cannot be read is never deleted: readers skip it
and say so (a resume then moves it aside: ``agent_gym.eval.runlog``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from agent_gym.durable import (
    MAX_LINE_BYTES,
    JSONLine,
    NotRegularFileError,
    open_regular,
    read_jsonl,
)
from agent_gym.eval.config import MAX_EPISODES, MAX_ROLLOUTS_PER_TASK, EvalConfig, Key
from agent_gym.untrusted import UntrustedJSONError, loads

CONFIG_FILE = "config.json"
EPISODES_FILE = "episodes.jsonl"
ERRORS_FILE = "errors.jsonl"
SUMMARY_FILE = "summary.json"
RESCORE_FILE = "rescore.json"
QUARANTINE_FILE = "episodes.jsonl.quarantined"
LOCK_FILE = "eval.lock"
# What a run directory holds that its readers read or its writer keeps: no command's output
# may land on one of them (``agent_gym.eval.runs.check_output``).
RUN_FILES = (CONFIG_FILE, EPISODES_FILE, ERRORS_FILE, SUMMARY_FILE, RESCORE_FILE,
             QUARANTINE_FILE, LOCK_FILE)

# Bounds on what a reader takes in, each far past anything an eval writes: a line (an
# episode with its whole transcript: ``MAX_LINE_BYTES``), a JSON file read whole, and the
# figures of a record.
MAX_CONFIG_BYTES = 2**20
MAX_COUNT = 10**9  # turns, tokens, invalid actions
MAX_FIGURE = 1e12  # |reward|, seconds: sums and means of many stay finite
MAX_NOTED_LINES = 10  # unreadable lines named one by one; the rest are counted


class RunDirError(ValueError):
    """A run directory cannot be used as asked: it is not one (or holds none), a file of it
    cannot be read or written, or a file was to be written over one of its own."""


# ------------------------------------------------------------------------------ schemas
Check = Callable[[Any], bool]
# A record's fields: name -> (check of its value, required).
Schema = Mapping[str, tuple[Check, bool]]


def count(limit: int) -> Check:
    """An integer (not a bool) from 0 to ``limit``."""
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= limit


def figure(value: Any) -> bool:
    """A finite number of magnitude at most ``MAX_FIGURE`` (JSON's ``1e999`` parses as
    infinity, so finiteness is checked here, not only by the parser)."""
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and abs(value) <= MAX_FIGURE)


def text(value: Any) -> bool:
    return isinstance(value, str)


def optional(check: Check) -> Check:
    return lambda v: v is None or check(v)


def list_of(check: Check) -> Check:
    return lambda v: isinstance(v, list) and all(check(item) for item in v)


def _reply(value: Any) -> bool:
    return (isinstance(value, dict) and figure(value.get("latency_s"))
            and optional(text)(value.get("finish_reason")))


# Everything a reader of a run computes from or shows of an episode line.
EPISODE_SCHEMA: Schema = {
    "episode": (count(MAX_EPISODES - 1), True),
    "rollout": (count(MAX_ROLLOUTS_PER_TASK - 1), False),
    "task_id": (text, True),
    "reward": (figure, True),
    "success": (lambda v: isinstance(v, bool), True),
    "turns": (count(MAX_COUNT), True),
    "latency_s": (figure, True),
    "completion_tokens": (optional(count(MAX_COUNT)), True),
    "prompt_tokens": (optional(count(MAX_COUNT)), False),
    "invalid_actions": (count(MAX_COUNT), False),
    "end_reason": (text, False),
    "seed": (lambda v: isinstance(v, int) and not isinstance(v, bool), False),
    "replies": (list_of(_reply), False),
    "transcript": (lambda v: isinstance(v, list), False),
    "step_rewards": (list_of(figure), False),
}
# An episode line read for its final saved state (``replay --episode``, SFT on a run): what
# those readers use, and no more, so a line whose figures are damaged still gives its state.
FINAL_STATE_SCHEMA: Schema = {
    "episode": EPISODE_SCHEMA["episode"],
    "rollout": EPISODE_SCHEMA["rollout"],
    "success": EPISODE_SCHEMA["success"],
    "final_state": (lambda v: isinstance(v, dict), True),
}
ERROR_SCHEMA: Schema = {
    "episode": (count(MAX_EPISODES - 1), True),
    "rollout": (count(MAX_ROLLOUTS_PER_TASK - 1), False),
    "error": (text, True),
}


def schema_problem(record: Any, schema: Schema) -> str | None:
    """Why ``record`` does not fit ``schema`` (phrased to follow "line N"), or None."""
    if not isinstance(record, dict):
        return "is not a JSON object"
    bad = [name for name, (check, required) in schema.items()
           if (name in record or required) and not check(record.get(name))]
    return f"has no valid {', '.join(bad)}" if bad else None


def record_key(record: Mapping[str, Any]) -> Key:
    """An episode line's (episode, rollout); lines written before rollouts existed are
    rollout 0."""
    return int(record["episode"]), int(record.get("rollout", 0))


# ------------------------------------------------------------------------------ reading
@dataclass(frozen=True)
class LogLines:
    """What a JSONL file of a run holds: each record that fits its schema, with its line
    number, in file order, and every line that does not."""

    name: str
    records: list[tuple[int, dict[str, Any]]]
    unreadable: list[JSONLine]  # each with its problem

    def by_episode(self) -> tuple[dict[Key, dict[str, Any]], list[Key]]:
        """The records by (episode, rollout), the first line of each kept, and the keys
        logged again after it (an episode is logged once; a second line is never read)."""
        first: dict[Key, dict[str, Any]] = {}
        again: list[Key] = []
        for _, record in self.records:
            key = record_key(record)
            if key in first:
                again.append(key)
            else:
                first[key] = record
        return first, again

    def notes(self) -> list[str]:
        """What a reader skipped, one note per line for the first few, then a count."""
        notes = [f"{self.name}: line {bad.number} {bad.problem}; skipped"
                 for bad in self.unreadable[:MAX_NOTED_LINES]]
        rest = len(self.unreadable) - MAX_NOTED_LINES
        if rest > 0:
            notes.append(f"{self.name}: {rest} more unreadable line{'s' * (rest != 1)} skipped")
        return notes


def read_log(path: Path, schema: Schema) -> LogLines:
    """Every line of ``path`` (none when it does not exist), read and never changed.

    A line is taken when it is whole (a kill can cut the last one), at most
    ``MAX_LINE_BYTES`` long, UTF-8 JSON of bounded depth with finite numbers, and fits
    ``schema``; blank lines are passed over; everything else is ``unreadable``.
    """
    records: list[tuple[int, dict[str, Any]]] = []
    unreadable: list[JSONLine] = []
    try:
        with _open_run_file(path) as handle:
            for line in read_jsonl(handle, max_line_bytes=MAX_LINE_BYTES):
                problem = line.problem or schema_problem(line.value, schema)
                if problem is None:
                    records.append((line.number, line.value))
                else:
                    unreadable.append(dataclasses.replace(line, problem=problem))
    except FileNotFoundError:
        pass
    except OSError as err:
        raise RunDirError(f"cannot read {path}: {err.strerror or err}") from err
    return LogLines(path.name, records, unreadable)


def _open_run_file(path: Path) -> BinaryIO:
    """``durable.open_regular``, refusing a FIFO or a device in a crafted run in one line."""
    try:
        return open_regular(path)
    except NotRegularFileError:
        raise RunDirError(f"{path} is not a regular file; a run's files are") from None


def read_json_file(path: Path, limit: int) -> Any:
    """A whole JSON file of a run, at most ``limit`` bytes; ``RunDirError`` (one line)
    when it cannot be read, is larger, or is not JSON this code accepts."""
    try:
        with _open_run_file(path) as handle:
            data = handle.read(limit + 1)
    except OSError as err:
        raise RunDirError(f"cannot read {path}: {err.strerror or err}") from err
    if len(data) > limit:
        raise RunDirError(f"{path} is larger than {limit:,} bytes; no run writes one that big")
    try:
        return loads(data)
    except UntrustedJSONError as err:
        raise RunDirError(f"{path} {err}") from err


def read_config(path: Path) -> tuple[EvalConfig, dict[str, Any]]:
    """The run ``config.json`` describes, and the file's settings as recorded (for
    ``EvalConfig.differences``); ``RunDirError`` when it is not one."""
    recorded = read_json_file(path, MAX_CONFIG_BYTES)
    try:
        return EvalConfig.from_recorded(recorded), recorded
    except (TypeError, ValueError) as err:
        raise RunDirError(f"{path} is not an eval config: {err}") from err

