"""Reading eval run directories as ``agent-gym eval`` left them: the one reader that
``view``, ``compare`` and ``rescore`` share, and the check that none of them writes over
what it read.

A run directory may come from a run that was killed (a half-written last line of
``episodes.jsonl``, no ``summary.json`` or an old one), resumed (a later attempt's lines
after an earlier attempt's), or made by a newer or older eval (config fields this code does
not know), or be crafted. Every file is read through ``agent_gym.eval.runfiles``' readers,
as untrusted input (schema-checked, finite numbers, bounded sizes). Reading never changes
the directory: a half-written or unreadable line is left where it is (a resume
quarantines it), skipped and reported, and an episode number logged twice keeps its first
line, as the resume does. Every episode the log holds is read, even
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

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_gym.eval.config import MAX_EPISODES, MAX_ROLLOUTS_PER_TASK, EvalConfig
from agent_gym.eval.runfiles import (
    CONFIG_FILE,
    EPISODE_SCHEMA,
    EPISODES_FILE,
    ERROR_SCHEMA,
    ERRORS_FILE,
    QUARANTINE_FILE,
    RESCORE_FILE,
    RUN_FILES,
    RunDirError,
    Schema,
    count,
    figure,
    list_of,
    optional,
    read_config,
    read_json_file,
    read_log,
    record_key,
    schema_problem,
    text,
)
from agent_gym.eval.summary import Summary, summarize

EpisodeKey = tuple[str, str, int]
# What ``view`` takes from each episode of a ``rescore.json``.
RESCORED_SCHEMA: Schema = {
    "episode": (count(MAX_EPISODES - 1), True),
    "rollout": (count(MAX_ROLLOUTS_PER_TASK - 1), False),
    "step_rewards": (optional(list_of(figure)), False),
    "error": (optional(text), False),
}
MAX_RESCORE_BYTES = 2**30


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
    if not (path / CONFIG_FILE).is_file():
        raise RunDirError(f"{path} is not an eval run directory (no {CONFIG_FILE})")
    config, _ = read_config(path / CONFIG_FILE)
    lines = read_log(path / EPISODES_FILE, EPISODE_SCHEMA)
    notes = lines.notes()
    if (path / QUARANTINE_FILE).is_file():
        notes.append(f"{QUARANTINE_FILE} holds lines of {EPISODES_FILE} a resume could not "
                     "read and set aside; they are not shown")
    by_number, again = lines.by_episode()
    notes += [f"episode {_named(number)} is logged twice; the first line is kept"
              for number in again]
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
        task = (config.env_id, record["task_id"])
        rollout = record.get("rollout")
        if rollout is None:
            rollout = seen.get(task, 0)
        seen[task] = max(seen.get(task, 0), rollout + 1)
        key = (*task, rollout)
        if key in episodes:
            notes.append(f"episode {_named(number)} repeats task {task[1]!r} rollout "
                         f"{rollout}; skipped")
            continue
        episodes[key] = record
    errors = read_log(path / ERRORS_FILE, ERROR_SCHEMA)
    notes += errors.notes()
    rescored = {record_key(item): item for item in _read_rescore(path / RESCORE_FILE, notes)}
    return Run(path, config, episodes, [record for _, record in errors.records], notes, rescored)


def _extent(config: EvalConfig) -> str:
    rollouts = config.rollouts_per_task
    return f"{config.episodes} episodes" + (f" of {rollouts} rollouts" if rollouts > 1 else "")


def _named(key: tuple[int, int]) -> str:
    return f"{key[0]}" + (f" rollout {key[1]}" if key[1] else "")


def read_runs(paths: list[Path]) -> list[Run]:
    return [read_run(run) for path in paths for run in find_runs(path)]


def _read_rescore(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    """The episodes of a ``rescore.json`` that fit ``RESCORED_SCHEMA``; a file that is not
    one is left out with a note, as is each episode that does not fit."""
    if not path.is_file():
        return []
    try:
        payload = read_json_file(path, MAX_RESCORE_BYTES)
    except RunDirError as err:
        notes.append(f"{path.name} is not shown: {err}")
        return []
    items = payload.get("episodes") if isinstance(payload, dict) else None
    if not isinstance(items, list):
        notes.append(f"{path.name} is not a rescore file agent-gym wrote; not shown")
        return []
    kept = [item for item in items if schema_problem(item, RESCORED_SCHEMA) is None]
    if len(kept) < len(items):
        notes.append(f"{path.name}: {len(items) - len(kept)} of its episodes are not "
                     "readable; not shown")
    return kept


def check_output(out: Path, runs: Sequence[Run], allowed: str | None = None) -> None:
    """Refuse ``out`` as the file a command writes when it is a directory or would land on
    a file of a run the command reads (``RUN_FILES``, but ``allowed``): by its path, through
    any symlink, or as another name (a hard link) of one. ``view --out RUN/episodes.jsonl``
    wrote a report over the very log it showed. A device or FIFO is refused too, before
    the work: the file is replaced whole, which would leave a file where the node was
    (``durable.replace_file`` refuses it again, should one appear in the meantime)."""
    if out.is_dir():
        raise RunDirError(f"{out} is a directory; give the file to write, such as "
                          f"{out / 'report.html'}")
    if out.exists() and not out.is_file():  # through links: the file written is the target
        raise RunDirError(f"{out} is not a regular file (a device, FIFO or socket), which a "
                          "report would replace; give the path of a file to write")
    try:
        target = out.resolve()
    except (OSError, RuntimeError) as err:  # a symlink loop
        raise RunDirError(f"cannot write {out}: {err}") from err
    for run in runs:
        for name in RUN_FILES:
            own = run.path / name
            if name != allowed and (target == own.resolve()
                                    or (own.exists() and out.exists()
                                        and os.path.samefile(out, own))):
                raise RunDirError(f"{out} would overwrite {own}, a file of a run being "
                                  "read; write to another file")
