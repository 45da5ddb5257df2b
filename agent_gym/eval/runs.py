"""Reading eval run directories as ``agent-gym eval`` left them: the one reader that
``view``, ``compare`` and ``rescore`` share.

A run directory may come from a run that was killed (a half-written last line of
``episodes.jsonl``, no ``summary.json`` or an old one), resumed (a later attempt's lines
after an earlier attempt's), or made by a newer or older eval (config fields this code does
not know). Reading never changes the directory: a half-written line is left where it is (a
resume cuts it), an unreadable line is skipped and reported, and an episode number logged
twice keeps its first line, as the resume does. Every episode the log holds is read, even
one past the counts of ``config.json`` (an older eval shrank them when rerun with fewer
``--episodes``), and such a run says so in its notes. The figures are always recomputed from
the episodes with the eval's own ``summarize``, so a killed run's report is as current as its
log.

Episodes are keyed by ``(env_id, task_id, rollout)``, which is what makes two runs
comparable: episode ``i`` of two runs with different seeds plays different tasks, the same
``task_id`` is the same task. ``rollout`` is the record's own when it has one (runs with
several rollouts per task); otherwise a task's first episode is rollout 0, its next 1, and
so on, so a run with more episodes than tasks still keys every episode apart.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_gym.eval.config import EvalConfig
from agent_gym.eval.runlog import EPISODES_FILE, ERRORS_FILE, record_key
from agent_gym.eval.summary import Summary, summarize

CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
RESCORE_FILE = "rescore.json"

EpisodeKey = tuple[str, str, int]
# The fields of an episode line the figures are computed from, with their JSON types.
EPISODE_FIELDS: dict[str, tuple[type, ...]] = {
    "episode": (int,), "task_id": (str,), "reward": (int, float), "success": (bool,),
    "turns": (int,), "latency_s": (int, float), "completion_tokens": (int, type(None)),
}


class RunDirError(ValueError):
    """A run directory cannot be used as asked: it is not one (or holds none), or a file
    was to be written over one of its own."""


@dataclass(frozen=True)
class Run:
    """One run directory: its config, its finished episodes and what could not be read.

    ``config`` covers every episode of the log (``EvalConfig.covering``), as the eval's
    own summary does."""

    path: Path
    config: EvalConfig
    episodes: dict[EpisodeKey, dict[str, Any]]  # in episode-number order
    errors: list[dict[str, Any]]  # the last attempt's failed episodes (errors.jsonl)
    notes: list[str]  # what reading skipped: unreadable lines, duplicates, a cut last line
    # `agent-gym rescore`'s findings by (episode, rollout)
    rescored: dict[tuple[int, int], dict[str, Any]]

    @property
    def label(self) -> str:
        return f"{self.config.env_id.removeprefix('agent_gym/')} / {self.config.policy}"

    def summary(self) -> Summary:
        """The eval's summary of the episodes as they are now."""
        first = self.errors[0].get("error") if self.errors else None
        return summarize(self.config, list(self.episodes.values()), len(self.errors), first)


def find_runs(path: Path) -> list[Path]:
    """``path`` itself when it is a run directory, else every run directory below it (a
    suite's ``--out`` holds ENV/POLICY runs), in path order."""
    if not path.is_dir():
        raise RunDirError(f"{path} is not a directory (give an eval run's --out directory)")
    if (path / CONFIG_FILE).is_file():
        return [path]
    found = sorted(config.parent for config in path.rglob(CONFIG_FILE))
    if not found:
        raise RunDirError(f"{path} holds no eval run (no {CONFIG_FILE} in it or below it)")
    return found


def read_run(path: Path) -> Run:
    """The run in ``path``; ``RunDirError`` when it has no readable config."""
    config = _read_config(path / CONFIG_FILE)
    notes: list[str] = []
    records = _read_jsonl(path / EPISODES_FILE, notes, required=EPISODE_FIELDS)
    by_number: dict[tuple[int, int], dict[str, Any]] = {}
    for record in records:
        number = record_key(record)
        if number in by_number:
            notes.append(f"episode {_named(number)} is logged twice; the first line is kept")
            continue
        by_number[number] = record
    covered = config.covering(by_number)
    if covered != config:
        beyond = sum(episode >= config.episodes or rollout >= config.rollouts_per_task
                     for episode, rollout in by_number)
        notes.append(f"{EPISODES_FILE} holds {beyond} episode{'s' * (beyond != 1)} beyond "
                     f"{CONFIG_FILE}'s {_extent(config)} (a rerun with fewer --episodes by "
                     "an older agent-gym shrank it); every episode is read")
        config = covered
    episodes: dict[EpisodeKey, dict[str, Any]] = {}
    seen: dict[tuple[str, str], int] = {}
    for number in sorted(by_number):
        record = by_number[number]
        task = (config.env_id, str(record["task_id"]))
        rollout = record.get("rollout")
        if not isinstance(rollout, int) or isinstance(rollout, bool):
            rollout = seen.get(task, 0)
        seen[task] = max(seen.get(task, 0), rollout + 1)
        key = (*task, rollout)
        if key in episodes:
            notes.append(f"episode {_named(number)} repeats task {task[1]!r} rollout "
                         f"{rollout}; skipped")
            continue
        episodes[key] = record
    errors = _read_jsonl(path / ERRORS_FILE, notes, required={"episode": (int,)})
    rescored = {
        record_key(item): item
        for item in _read_rescore(path / RESCORE_FILE, notes)
    }
    return Run(path, config, episodes, errors, notes, rescored)


def _extent(config: EvalConfig) -> str:
    rollouts = config.rollouts_per_task
    return f"{config.episodes} episodes" + (f" of {rollouts} rollouts" if rollouts > 1 else "")


def _named(key: tuple[int, int]) -> str:
    return f"{key[0]}" + (f" rollout {key[1]}" if key[1] else "")


def read_runs(paths: list[Path]) -> list[Run]:
    return [read_run(run) for path in paths for run in find_runs(path)]


def _read_config(path: Path) -> EvalConfig:
    if not path.is_file():
        raise RunDirError(f"{path.parent} is not an eval run directory (no {CONFIG_FILE})")
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RunDirError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(payload, dict):
        raise RunDirError(f"{path} must hold a JSON object")
    known = {f.name for f in dataclasses.fields(EvalConfig)}
    # A newer eval's settings (rollouts per task, context limits) are kept out of the
    # dataclass this code knows; they never change how the episodes are read.
    try:
        config = EvalConfig(**{k: v for k, v in payload.items() if k in known})
    except TypeError as err:
        raise RunDirError(f"{path} is not an eval config: {err}") from err
    if not isinstance(config.env_id, str) or not isinstance(config.episodes, int):
        raise RunDirError(f"{path} has no env_id string or episodes count")
    return config


def _read_jsonl(
    path: Path, notes: list[str], required: dict[str, tuple[type, ...]]
) -> list[dict[str, Any]]:
    """Each whole, parseable line of ``path`` that is an object with the ``required``
    fields of their types (a bool is not taken for a number, nor a number for a bool)."""
    if not path.exists():
        return []
    records = []
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.endswith(b"\n"):
                notes.append(f"{path.name}: the last line is cut off (a killed run); skipped")
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                notes.append(f"{path.name}: line {number} is not JSON; skipped")
                continue
            bad = [key for key, kinds in required.items()
                   if not isinstance(record, dict) or not _is(record.get(key, ...), kinds)]
            if bad:
                notes.append(f"{path.name}: line {number} has no valid {', '.join(bad)}; skipped")
                continue
            records.append(record)
    return records


def _is(value: Any, kinds: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in kinds
    return isinstance(value, kinds)


def _read_rescore(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
        return [item for item in payload["episodes"] if isinstance(item.get("episode"), int)]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        notes.append(f"{path.name} is not a rescore file agent-gym wrote; not shown")
        return []
