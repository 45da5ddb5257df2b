"""The one writer of a run directory: ``RunLog``.

``episodes.jsonl`` gets one line per finished episode, counted as done only once fsynced,
so a run killed at any moment (even SIGKILL) resumes where it stopped: finished episodes
are kept and only the missing (episode, rollout) pairs run again. A resume reads the
directory as every reader does (``agent_gym.eval.runfiles``) and moves what it cannot
read, byte for byte, to ``episodes.jsonl.quarantined`` (saying so in one line) before it
appends to the log. One eval writes a run directory at a time (``eval.lock``); a second is
refused with a line naming the first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, BinaryIO

from agent_gym.durable import (
    AppendError,
    Content,
    append_lines,
    copy_range,
    open_append,
    replace_file,
)
from agent_gym.eval.config import EvalConfig, Key
from agent_gym.eval.runfiles import (
    CONFIG_FILE,
    EPISODE_SCHEMA,
    EPISODES_FILE,
    ERRORS_FILE,
    LOCK_FILE,
    QUARANTINE_FILE,
    SUMMARY_FILE,
    LogLines,
    RunDirError,
    read_config,
    read_log,
    record_key,
)


class RunMismatchError(RunDirError):
    """A run directory already holds a run of something else."""


class RunLockedError(RunDirError):
    """Another eval is writing the run directory."""


class RunWriteError(RunDirError):
    """A file of the run directory could not be written (disk full, read-only, no access)."""


def write_error(path: Path, err: OSError) -> RunWriteError:
    """One line for an ``OSError`` of writing ``path``, with its cause kept for --debug."""
    failure = RunWriteError(f"cannot write {path}: {err.strerror or err}")
    failure.__cause__ = err
    return failure


class RunLog:
    """The run directory: config, finished episodes, errors; durable line by line.

    Opening it takes the directory's lock (released by ``close``), moves what
    ``episodes.jsonl`` holds that cannot be read to ``episodes.jsonl.quarantined``
    (``notes`` says so), and writes back ``config.json``: ``config`` is the run the
    directory holds, the one asked for grown to what it held before
    (``EvalConfig.covering``); ``found`` is how many episodes were already there.
    """

    def __init__(self, out_dir: Path, config: EvalConfig) -> None:
        self.out_dir = out_dir
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise write_error(out_dir, err) from err
        self._lock = _RunLock(out_dir / LOCK_FILE)
        try:
            self._open(config)
        except BaseException:
            self._lock.release()
            raise

    def _open(self, config: EvalConfig) -> None:
        out_dir = self.out_dir
        config_path = out_dir / CONFIG_FILE
        recorded = None
        if config_path.exists():
            recorded, settings = read_config(config_path)
            differences = config.differences(settings)
            if differences:
                raise RunMismatchError(
                    f"{out_dir} holds another run: {'; '.join(differences)}. Rerun with the "
                    "recorded settings to resume it. Use another --out directory for a new run."
                )
        self.episodes_path = out_dir / EPISODES_FILE
        lines = read_log(self.episodes_path, EPISODE_SCHEMA)
        self.records: dict[Key, dict[str, Any]] = lines.by_episode()[0]
        self.notes = [self._quarantine(lines)] if lines.unreadable else []
        self.found = len(self.records)
        self.config = config.covering(self.records, recorded)
        write_file(config_path, json.dumps(asdict(self.config), indent=2))
        self._errors_path = out_dir / ERRORS_FILE
        try:
            self._errors_path.unlink(missing_ok=True)  # errored episodes are retried on resume
        except OSError as err:
            raise write_error(self._errors_path, err) from err
        self.errors = 0
        self.first_error: str | None = None
        self._episodes = _GroupCommitFile(self.episodes_path)
        self._errors: _GroupCommitFile | None = None  # opened at the first error

    def _quarantine(self, lines: LogLines) -> str:
        """Move the unreadable lines of ``episodes.jsonl`` to the quarantine file, keeping
        every other byte of the log in place; what was moved, in one line.

        The lines are appended to the quarantine file and synced before the log is
        replaced without them, so a kill in between leaves them in both (the next resume
        quarantines them again), never in neither. A cut last line goes too: it was never
        acknowledged, and a line appended after it would be lost with it.
        """
        quarantine = self.out_dir / QUARANTINE_FILE
        bad = lines.unreadable
        try:
            with (self.episodes_path.open("rb") as source,
                  os.fdopen(open_append(quarantine), "wb") as side):
                for span in bad:
                    copy_range(source, side, span.start, span.end)
                    source.seek(span.end - 1)
                    if source.read(1) != b"\n":
                        side.write(b"\n")
                side.flush()
                os.fsync(side.fileno())
        except OSError as err:
            raise write_error(quarantine, err) from err

        def kept(target: BinaryIO) -> None:
            with self.episodes_path.open("rb") as source:
                position = 0
                for span in bad:
                    copy_range(source, target, position, span.start)
                    position = span.end
                copy_range(source, target, position, None)

        write_file(self.episodes_path, kept)
        first = bad[0]
        more = f", and {len(bad) - 1} more" if len(bad) > 1 else ""
        return (f"moved {len(bad)} unreadable line{'s' * (len(bad) != 1)} of "
                f"{self.episodes_path} to {quarantine}: line {first.number} {first.problem}"
                f"{more}; the {len(self.records)} episodes it holds are kept")

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
        """Log a finished episode; the returned awaitable resolves once it is durable, and
        only then is the episode one of ``records`` (a line that failed to be written is
        never counted as saved)."""
        key = record_key(record)
        return self._episodes.append(record, lambda: self.records.__setitem__(key, record))

    def write_error(self, key: Key, error: BaseException) -> Awaitable[None]:
        self.errors += 1
        text = f"{type(error).__name__}: {error}"
        self.first_error = self.first_error or text
        if self._errors is None:
            self._errors = _GroupCommitFile(self._errors_path)
        return self._errors.append({"episode": key[0], "rollout": key[1], "error": text})

    @property
    def failure(self) -> BaseException | None:
        """The first failed write, after which nothing more is written."""
        return self._episodes.failed or (self._errors.failed if self._errors else None)

    def write_summary(self, text: str) -> None:
        write_file(self.out_dir / SUMMARY_FILE, text)

    def drain(self) -> None:
        """Commit what is pending and stop the writers (blocks: call it off the loop)."""
        for writer in (self._episodes, self._errors):
            if writer is not None:
                writer.close()

    def close(self) -> None:
        """Stop the writers if still running and let another eval have the directory."""
        try:
            self.drain()
        finally:
            self._lock.release()


class _RunLock:
    """An exclusive ``flock`` on the run's lock file, held while an eval writes the run.

    Two evals on one ``--out`` both played every episode and raced on its files; the
    second now stops at once with a line naming the first, which the file holds. The lock
    dies with its process, so a killed eval never leaves the directory locked; the file
    stays (removing it would let two processes lock two different files).
    """

    def __init__(self, path: Path) -> None:
        try:
            self._fd: int | None = os.open(
                path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            raise write_error(path, err) from err
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.pread(self._fd, 512, 0).decode("utf-8", "replace")
            os.close(self._fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise RunWriteError(f"cannot lock {path}: {err.strerror or err}") from err
            described = "".join(c if c.isprintable() else " " for c in holder).strip()
            raise RunLockedError(
                f"{path.parent} is being written by another eval "
                f"({described or 'one just starting'}); wait for it to end, or give "
                "another --out") from None
        command = " ".join(sys.argv)[:200]
        who = (f"pid {os.getpid()} on {socket.gethostname()} since "
               f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {command}")
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, who.encode() + b"\n", 0)
        except OSError as err:
            self.release()
            raise write_error(path, err) from err

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor releases the lock
            self._fd = None


class _GroupCommitFile:
    """A JSONL file appended to by one writer thread, with one fsync per batch of lines.

    An fsync per finished episode, on the event loop, took a quarter of the loop's time at
    concurrency 32 and every other episode waited for it. Here the loop only hands a line
    over; the writer takes every line waiting, writes them in one call, fsyncs once, and
    only then resolves their futures, so a line is acknowledged exactly when it is durable
    and a burst of finished episodes costs one fsync. A kill mid-write leaves at most a cut
    last line, of an episode never acknowledged, which the next resume quarantines; after
    a failed write (disk full) every later line fails too, so none lands after a cut one.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        try:  # unbuffered: a failed write leaves nothing behind to be flushed at close
            self._fd = open_append(path)
        except OSError as err:
            raise write_error(path, err) from err
        self._pending: list[tuple[bytes, Callable[[], None] | None,
                                  concurrent.futures.Future[None]]] = []
        self._wake = threading.Condition()
        self._closing = False
        self.failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"commit {path.name}",
                                        daemon=True)
        self._thread.start()

    def append(self, record: dict[str, Any], durable: Callable[[], None] | None = None
               ) -> Awaitable[None]:
        """Queue ``record``; ``durable`` is called (in the writer thread) once its line is
        synced, even when no one waits for it any more."""
        line = (json.dumps(record, ensure_ascii=True) + "\n").encode()
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._wake:
            if self._closing:
                raise RuntimeError("the run log is closed")
            self._pending.append((line, durable, done))
            self._wake.notify()
        return asyncio.wrap_future(done)

    def close(self) -> None:
        with self._wake:
            if self._closing:
                return
            self._closing = True
            self._wake.notify()
        self._thread.join()
        os.close(self._fd)

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
            told = [done.set_running_or_notify_cancel() for _, _, done in batch]
            synced = self._commit(b"".join(line for line, _, _ in batch))
            end = 0
            for (line, durable, done), waiting in zip(batch, told, strict=True):
                end += len(line)
                if end <= synced:
                    if durable is not None:
                        durable()
                    if waiting:
                        done.set_result(None)
                elif waiting:
                    assert self.failed is not None
                    done.set_exception(self.failed)

    def _commit(self, data: bytes) -> int:
        """Append and sync ``data``; how many of its bytes are durable. A write that fails
        part way (a full disk) still syncs what reached the file, so each whole line in it
        counts as saved, as a resume will find it; the first failure is kept in ``failed``
        and nothing is written after it (it may have cut a line)."""
        try:
            if self.failed is not None:
                raise self.failed
            return append_lines(self._fd, data)
        except AppendError as err:
            self.failed = write_error(self._path, err)
            return err.synced
        except BaseException as err:
            self.failed = write_error(self._path, err) if isinstance(err, OSError) else err
            return 0


def write_file(path: Path, content: Content) -> None:
    """``durable.replace_file``, failing with a ``RunWriteError`` naming ``path``: a kill at
    any moment leaves the old file or the new one (a run killed while writing its config in
    place kept an empty one, and every later resume crashed on it)."""
    try:
        replace_file(path, content)
    except OSError as err:
        raise write_error(path, err) from err
