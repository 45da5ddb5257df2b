"""The run directory's files: ``config.json``, ``episodes.jsonl`` and ``errors.jsonl``.

``episodes.jsonl`` gets one line per finished episode, counted as done only once fsynced,
so a run killed at any moment (even SIGKILL) resumes where it stopped: finished episodes
are kept, a half-written last line is cut off, and only the missing (episode, rollout)
pairs run again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import threading
from collections.abc import Awaitable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from agent_gym.eval.config import EvalConfig, Key

EPISODES_FILE = "episodes.jsonl"
ERRORS_FILE = "errors.jsonl"


class RunMismatchError(ValueError):
    """A run directory already holds a run of something else."""


class RunLog:
    """The run directory: config, finished episodes, errors; durable line by line.

    ``config`` is the run the directory holds: the one asked for, grown to what it held
    before (``EvalConfig.covering``), and written back to ``config.json``; ``found`` is how
    many episodes were already there.
    """

    def __init__(self, out_dir: Path, config: EvalConfig) -> None:
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        config_path = out_dir / "config.json"
        recorded = None
        if config_path.exists():
            recorded = json.loads(config_path.read_text(encoding="utf-8"))
            differences = config.differences(recorded)
            if differences:
                raise RunMismatchError(
                    f"{out_dir} holds another run: {'; '.join(differences)}. Rerun with the "
                    "recorded settings to resume it. Use another --out directory for a new run."
                )
        self.episodes_path = out_dir / EPISODES_FILE
        self.records = self._recover(self.episodes_path)
        self.found = len(self.records)
        self.config = config.covering(self.records, recorded)
        write_atomically(config_path, json.dumps(asdict(self.config), indent=2))
        self._errors_path = out_dir / ERRORS_FILE
        self._errors_path.unlink(missing_ok=True)  # errored episodes are retried on resume
        self.errors = 0
        self.first_error: str | None = None
        self._episodes = _GroupCommitFile(self.episodes_path)
        self._errors: _GroupCommitFile | None = None  # opened at the first error

    @staticmethod
    def _recover(path: Path) -> dict[Key, dict[str, Any]]:
        """Finished episodes; cuts off a last line a kill left half-written."""
        if not path.exists():
            return {}
        records: dict[Key, dict[str, Any]] = {}
        good_bytes = 0
        with path.open("rb") as handle:
            for line in handle:
                if not line.endswith(b"\n"):
                    break
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    break
                records.setdefault(record_key(record), record)
                good_bytes += len(line)
        if good_bytes != path.stat().st_size:
            with path.open("r+b") as handle:
                handle.truncate(good_bytes)
        return records

    def finished(self) -> list[dict[str, Any]]:
        """Every finished episode of the run, in (episode, rollout) order."""
        return [self.records[key] for key in sorted(self.records)]

    def found_note(self, asked: EvalConfig, missing: int) -> str | None:
        """What a rerun found in the directory and what it will do about it; None for a
        fresh directory."""
        if not self.found:
            return None
        planned = asked.episodes * asked.rollouts_per_task
        note = f"found {self.found} episode{'s' * (self.found != 1)} in {self.out_dir}; " + (
            f"running the {missing} missing of the {planned} asked for" if missing
            else f"the {planned} asked for are all there")
        if self.found + missing > planned:
            whole = f"--episodes {self.config.episodes}" + (
                f" --rollouts-per-task {self.config.rollouts_per_task}"
                if self.config.rollouts_per_task > 1 else "")
            note += (f"; the summary covers all {self.found + missing}, more than asked for "
                     f"({whole} resumes the whole run; another --out starts a separate one)")
        return note

    def write(self, record: dict[str, Any]) -> Awaitable[None]:
        """Log a finished episode; the returned awaitable resolves once it is durable."""
        self.records[record_key(record)] = record
        return self._episodes.append(record)

    def write_error(self, key: Key, error: BaseException) -> Awaitable[None]:
        self.errors += 1
        text = f"{type(error).__name__}: {error}"
        self.first_error = self.first_error or text
        if self._errors is None:
            self._errors = _GroupCommitFile(self._errors_path)
        return self._errors.append({"episode": key[0], "rollout": key[1], "error": text})

    def close(self) -> None:
        """Commit what is pending and stop the writers (blocks: call it off the loop)."""
        for writer in (self._episodes, self._errors):
            if writer is not None:
                writer.close()


def record_key(record: Mapping[str, Any]) -> Key:
    """An episode line's (episode, rollout); lines written before rollouts existed are
    rollout 0."""
    return int(record["episode"]), int(record.get("rollout", 0))


class _GroupCommitFile:
    """A JSONL file appended to by one writer thread, with one fsync per batch of lines.

    An fsync per finished episode, on the event loop, took a quarter of the loop's time at
    concurrency 32 and every other episode waited for it. Here the loop only hands a line
    over; the writer takes every line waiting, writes them in one call, fsyncs once, and
    only then resolves their futures, so a line is acknowledged exactly when it is durable
    and a burst of finished episodes costs one fsync. A kill mid-write leaves at most a cut
    last line, of an episode never acknowledged, which ``RunLog._recover`` removes; after a
    failed write (disk full) every later line fails too, so none lands after a cut one.
    """

    def __init__(self, path: Path) -> None:
        self._handle = path.open("ab")
        self._pending: list[tuple[bytes, concurrent.futures.Future[None]]] = []
        self._wake = threading.Condition()
        self._closing = False
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"commit {path.name}",
                                        daemon=True)
        self._thread.start()

    def append(self, record: dict[str, Any]) -> Awaitable[None]:
        line = (json.dumps(record, ensure_ascii=True) + "\n").encode()
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._wake:
            if self._closing:
                raise RuntimeError("the run log is closed")
            self._pending.append((line, done))
            self._wake.notify()
        return asyncio.wrap_future(done)

    def close(self) -> None:
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join()
        self._handle.close()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closing:
                    self._wake.wait()
                batch, self._pending = self._pending, []
            if not batch:
                return  # closing, and nothing left to commit
            # Past this call a waiter can no longer cancel; a cancelled one's line is still
            # written (its episode finished), it just has no one to tell.
            waiting = [done for _, done in batch if done.set_running_or_notify_cancel()]
            try:
                if self._failed is not None:  # nothing may follow a possibly cut line
                    raise self._failed
                self._handle.write(b"".join(line for line, _ in batch))
                self._handle.flush()
                os.fsync(self._handle.fileno())
            except BaseException as err:
                self._failed = err
                for done in waiting:
                    done.set_exception(err)
            else:
                for done in waiting:
                    done.set_result(None)


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that a kill at any moment leaves the old or the new file.

    Writing in place truncates first: a run killed mid-write kept an empty ``config.json``
    and every later resume crashed on it. The text goes to a sibling temporary file, is
    synced, and is renamed over ``path`` (atomic on POSIX); the directory is synced so the
    rename survives a power cut too. One writer per run directory, so the temporary name is
    fixed: the next write replaces what a killed one left behind.
    """
    temporary = path.with_name(f".{path.name}.tmp")
    with temporary.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
