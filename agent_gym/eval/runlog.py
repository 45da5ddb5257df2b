"""The run directory's files, and the one reader and the one writer of them.

``episodes.jsonl`` gets one line per finished episode, counted as done only once fsynced,
so a run killed at any moment (even SIGKILL) resumes where it stopped: finished episodes
are kept and only the missing (episode, rollout) pairs run again.

Every file of a run directory is untrusted input to whoever reads it next: another version
wrote it, a crash cut it, a disk corrupted it, a hand edited it. So every reader (the
resume here, ``view``, ``compare``, ``rescore``, a suite's overall row) goes through
``read_log`` and ``read_config``: JSON of bounded depth and line length, finite numbers in
sane ranges, each record checked against its schema. What cannot be read is never
deleted: readers skip it and say so, and a resume moves it, byte for byte, to
``episodes.jsonl.quarantined`` (saying so in one line) before it appends to the log.
One eval writes a run directory at a time (``eval.lock``); a second is refused with a line
naming the first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import fcntl
import json
import math
import os
import secrets
import socket
import stat
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

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
# episode with its whole transcript), a JSON file read whole, and the figures of a record.
MAX_LINE_BYTES = 64 * 2**20
MAX_CONFIG_BYTES = 2**20
MAX_COUNT = 10**9  # turns, tokens, invalid actions
MAX_FIGURE = 1e12  # |reward|, seconds: sums and means of many stay finite
MAX_NOTED_LINES = 10  # unreadable lines named one by one; the rest are counted
_COPY_CHUNK = 2**20


class RunDirError(ValueError):
    """A run directory cannot be used as asked: it is not one (or holds none), a file of it
    cannot be read or written, or a file was to be written over one of its own."""


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
class Unreadable:
    """A line a reader could not take: where it is (bytes ``start`` to ``end``) and why."""

    line: int
    start: int
    end: int
    reason: str


@dataclass(frozen=True)
class LogLines:
    """What a JSONL file of a run holds: each record that fits its schema, with its line
    number, in file order, and every line that does not."""

    name: str
    records: list[tuple[int, dict[str, Any]]]
    unreadable: list[Unreadable]

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
        notes = [f"{self.name}: line {bad.line} {bad.reason}; skipped"
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
    unreadable: list[Unreadable] = []
    try:
        with open_regular(path) as handle:
            for number, (start, end, line) in enumerate(_lines(handle), start=1):
                if line is None:
                    reason: str | None = f"is longer than {MAX_LINE_BYTES:,} bytes"
                elif not line.endswith(b"\n"):
                    reason = "is cut off (a killed run)"
                elif not line.strip():
                    continue
                else:
                    try:
                        record = loads(line)
                    except UntrustedJSONError as err:
                        reason = str(err)
                    else:
                        reason = schema_problem(record, schema)
                        if reason is None:
                            records.append((number, record))
                            continue
                unreadable.append(Unreadable(number, start, end, reason))
    except FileNotFoundError:
        pass
    except OSError as err:
        raise RunDirError(f"cannot read {path}: {err.strerror or err}") from err
    return LogLines(path.name, records, unreadable)


def open_regular(path: Path) -> BinaryIO:
    """``path`` opened to read if it is a regular file (through links), else ``RunDirError``:
    a run directory is untrusted, and a file there that is a FIFO or a link to a device
    (``/dev/zero``) would keep every reader waiting or reading forever. The open does not
    wait for a FIFO's writer, so it is refused at once."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RunDirError(f"{path} is not a regular file; a run's files are")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _lines(handle: BinaryIO) -> Iterator[tuple[int, int, bytes | None]]:
    """``(start, end, line)`` of each line, in bounded memory: a line longer than
    ``MAX_LINE_BYTES`` comes as ``None`` (its bytes are skipped, never held)."""
    position = 0
    while line := handle.readline(MAX_LINE_BYTES + 1):
        start = position
        position += len(line)
        if len(line) <= MAX_LINE_BYTES:
            yield start, position, line
            continue
        while not line.endswith(b"\n") and (line := handle.readline(_COPY_CHUNK)):
            position += len(line)
        yield start, position, None


def read_json_file(path: Path, limit: int) -> Any:
    """A whole JSON file of a run, at most ``limit`` bytes; ``RunDirError`` (one line)
    when it cannot be read, is larger, or is not JSON this code accepts."""
    try:
        with open_regular(path) as handle:
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


# ------------------------------------------------------------------------------ writing
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
        write_atomically(config_path, json.dumps(asdict(self.config), indent=2))
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
                  os.fdopen(_open_append(quarantine), "wb") as side):
                for span in bad:
                    _copy(source, side, span.start, span.end)
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
                    _copy(source, target, position, span.start)
                    position = span.end
                _copy(source, target, position, None)

        write_atomically(self.episodes_path, kept)
        first = bad[0]
        more = f", and {len(bad) - 1} more" if len(bad) > 1 else ""
        return (f"moved {len(bad)} unreadable line{'s' * (len(bad) != 1)} of "
                f"{self.episodes_path} to {quarantine}: line {first.line} {first.reason}"
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
        write_atomically(self.out_dir / SUMMARY_FILE, text)

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
            self._fd = _open_append(path)
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
        synced = 0
        try:
            if self.failed is not None:
                raise self.failed
            written = 0
            view = memoryview(data)
            try:
                while written < len(data):
                    written += os.write(self._fd, view[written:])
            finally:
                if written:
                    os.fsync(self._fd)
                    synced = written
        except BaseException as err:
            self.failed = write_error(self._path, err) if isinstance(err, OSError) else err
        return synced


def write_atomically(path: Path, content: str | Callable[[BinaryIO], None]) -> None:
    """Replace ``path`` with ``content`` (text, or a function writing the bytes) so that a
    kill at any moment leaves the old or the new file; ``RunWriteError`` when it cannot.

    Writing in place truncates first: a run killed mid-write kept an empty ``config.json``
    and every later resume crashed on it. The bytes go to a sibling temporary file, are
    synced, and are renamed over ``path`` (atomic on POSIX); the directory is synced so the
    rename survives a power cut too. The temporary name is new each time: two writers of
    one fixed name took each other's file away mid-write.
    """
    temporary = None
    try:
        while temporary is None:
            candidate = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
            try:
                fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                             0o666)
            except FileExistsError:
                continue
            temporary = candidate
        with os.fdopen(fd, "wb") as handle:
            if isinstance(content, str):
                handle.write(content.encode("utf-8"))
            else:
                content(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
        temporary = None
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except OSError as err:
        raise write_error(path, err) from err
    finally:
        if temporary is not None:
            temporary.unlink(missing_ok=True)


def _open_append(path: Path) -> int:
    """A descriptor appending to ``path``, never through a symlink: a crafted run directory
    must not make an eval write (or, for the lock, truncate) a file elsewhere."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                   0o666)


def _copy(source: BinaryIO, target: BinaryIO, start: int, end: int | None) -> None:
    """Bytes ``start`` to ``end`` (None: the end) of ``source``, in bounded memory."""
    source.seek(start)
    left = math.inf if end is None else end - start
    while left > 0 and (chunk := source.read(int(min(left, _COPY_CHUNK)))):
        target.write(chunk)
        left -= len(chunk)
