"""Files that survive a kill or a power cut, and JSONL from outside read at bounded cost.

Every file agent_gym keeps (a run's config and episodes, a generated data set or cache, a
benchmark's result) is written in one of two ways. A file rewritten whole goes through
``replace_file``: a write in place truncates first, so a kill mid-write left an empty or
half file that every later reader crashed on. A log grows through ``append_lines``: a line
counts as saved only once it is synced, and a kill leaves at most a cut last line, which
the reader here reports rather than takes.

Whatever such a file holds is untrusted to the process reading it next (another version
wrote it, a crash cut it, a hand edited it), so ``read_jsonl`` holds at most one bounded
line in memory and parses each through ``agent_gym.untrusted``. What a bad line means is
the caller's to decide: a run's reader skips it and says so, a data set refuses the file.
"""

from __future__ import annotations

import math
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from agent_gym.untrusted import UntrustedJSONError, loads

MAX_LINE_BYTES = 64 * 2**20  # far past any line agent_gym writes (an episode's transcript)
CUT_LINE = "is cut off (a killed run)"
# A file of a shared cache or package: every user reads it, whatever the writer's umask.
SHARED_MODE = 0o644
_CHUNK = 2**20

# What ``replace_file`` writes: bytes, text (UTF-8), or a function writing to the file.
Content = bytes | str | Callable[[BinaryIO], None]


class NotRegularFileError(OSError):
    """A file to read or replace is a FIFO, a device or a directory: reading it could wait
    or run forever, and replacing it would put a file where the node was, so it is refused
    before a byte is read or written."""


class AppendError(OSError):
    """An append failed part way; ``synced`` bytes of it reached the file and were synced
    (whole lines among them are as saved as any other)."""

    def __init__(self, cause: OSError, synced: int) -> None:
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.synced = synced


# ------------------------------------------------------------------------------ writing
def replace_file(path: Path, content: Content, *, mode: int | None = None) -> None:
    """Replace ``path`` with ``content`` so that a kill at any moment leaves the old file
    or the new one, never a mix; ``OSError`` when it cannot.

    The bytes go to a sibling temporary file of a name no other writer uses (two writers
    of one fixed ``.tmp`` name renamed each other's half-written file into place), are
    synced, and are renamed over ``path``, atomic on POSIX; then the directory is synced,
    so the rename survives a power cut too. A writer killed before the rename leaves its
    temporary (a dot file ending ``.tmp``) beside ``path``, which no reader of ``path``
    ever opens. ``mode`` sets the file's permissions (else they follow the umask).

    A ``path`` that is there and is neither a regular file nor a symlink (a device, a FIFO,
    a socket, a directory) is refused with ``NotRegularFileError`` before a byte is
    written: the rename would have put a regular file where the node was (as root,
    ``--out /dev/null`` left a file there that every other program then wrote into), and
    writing through instead keeps none of the promises above (a FIFO without a reader
    waits forever, ``/dev/full`` fails). A symlink is itself replaced, never its target.
    """
    refuse_special(path)
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
            elif isinstance(content, bytes):
                handle.write(content)
            else:
                content(handle)
            handle.flush()
            if mode is not None:
                os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
        os.replace(temporary, path)
        temporary = None
        sync_directory(path.parent)
    finally:
        if temporary is not None:
            temporary.unlink(missing_ok=True)


def refuse_special(path: Path) -> None:
    """``NotRegularFileError`` when ``path`` exists and is neither a regular file nor a
    symlink: what ``replace_file`` will not rename over (see there)."""
    try:
        kind = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not (stat.S_ISREG(kind) or stat.S_ISLNK(kind)):
        raise NotRegularFileError(f"{path} is not a regular file (a device, FIFO, socket or "
                                  "directory); give the path of a file to write")


def set_aside(path: Path, label: str = "damaged") -> Path:
    """Rename ``path`` (a file or a directory) to a free sibling name ``NAME.LABEL``, or
    ``NAME.LABEL-2`` and on, and return it: what a reader cannot trust is moved out of the
    way of the next run, never deleted, and never moved over an earlier one set aside.
    Two processes setting aside at once could pick one free name; the rename of a file
    then replaces, so names are taken with a hard link first where the system allows."""
    for number in range(1, 10_000):
        candidate = path.with_name(f"{path.name}.{label}" + (f"-{number}" if number > 1 else ""))
        if os.path.lexists(candidate):
            continue
        if path.is_dir() and not path.is_symlink():
            try:
                os.mkdir(candidate)  # the name is ours: rename over an empty directory
            except FileExistsError:
                continue
            os.rename(path, candidate)
        else:
            try:
                os.link(path, candidate, follow_symlinks=False)
            except FileExistsError:
                continue
            except OSError:  # no hard links here: the check above has to do
                os.rename(path, candidate)
            else:
                os.unlink(path)
        sync_directory(path.parent)
        return candidate
    raise FileExistsError(f"no free name to set {path} aside as {path.name}.{label}-N")


def sync_directory(directory: Path) -> None:
    """Sync ``directory``'s entries: a rename or a new file in it is durable only then."""
    fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_append(path: Path) -> int:
    """A descriptor appending to ``path`` (created if missing), never through a symlink: a
    crafted directory must not make a writer append to a file elsewhere."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                   0o666)


def append_lines(fd: int, data: bytes) -> int:
    """Append ``data``, whole lines, to ``fd`` (from ``open_append``) and sync it; how many
    bytes are durable (all of them).

    The lines go in one ``write`` call where the system allows, so appenders sharing a file
    never interleave within a line. A write that fails part way (a full disk) still syncs
    what reached the file and raises ``AppendError`` saying how much that was: the whole
    lines in it are saved, and the cut one is for the next reader to report.
    """
    if not data.endswith(b"\n"):
        raise ValueError("append_lines takes whole lines, each ending in a newline")
    view = memoryview(data)
    written = 0
    try:
        while written < len(data):
            written += os.write(fd, view[written:])
    except OSError as err:
        if written:
            os.fsync(fd)
        raise AppendError(err, written) from err
    os.fsync(fd)
    return written


def copy_range(source: BinaryIO, target: BinaryIO, start: int, end: int | None) -> None:
    """Copy bytes ``start`` to ``end`` (None: the end) of ``source``, in bounded memory."""
    source.seek(start)
    left = math.inf if end is None else end - start
    while left > 0 and (chunk := source.read(int(min(left, _CHUNK)))):
        target.write(chunk)
        left -= len(chunk)


# ------------------------------------------------------------------------------ reading
def open_regular(path: Path) -> BinaryIO:
    """``path`` opened to read if it is a regular file (through links), else
    ``NotRegularFileError``. The open does not wait for a FIFO's writer, so a FIFO (or a
    link to ``/dev/zero``) in a crafted directory is refused at once."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFileError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


@dataclass(frozen=True)
class JSONLine:
    """A line of a JSONL file: its number (from 1), its bytes ``start`` to ``end``, and
    either its parsed ``value`` or the ``problem`` with it, phrased to follow "line N"."""

    number: int
    start: int
    end: int
    value: Any = None
    problem: str | None = None


def read_jsonl(handle: BinaryIO, *, max_line_bytes: int = MAX_LINE_BYTES,
               cut_ok: bool = False) -> Iterator[JSONLine]:
    """Each non-blank line of ``handle``, parsed as untrusted JSON (bounded depth, finite
    numbers), holding at most ``max_line_bytes`` of it in memory.

    A longer line is skipped unread (its problem says so). A last line without a newline
    is one a kill cut, and is a problem, unless ``cut_ok``: a file someone wrote by hand
    often ends without one.
    """
    position = 0
    number = 0
    while raw := handle.readline(max_line_bytes + 1):
        number += 1
        start = position
        position += len(raw)
        if len(raw) > max_line_bytes:
            while not raw.endswith(b"\n") and (raw := handle.readline(_CHUNK)):
                position += len(raw)
            yield JSONLine(number, start, position,
                           problem=f"is longer than {max_line_bytes:,} bytes")
        elif not raw.endswith(b"\n") and not cut_ok:
            yield JSONLine(number, start, position, problem=CUT_LINE)
        elif raw.strip():
            try:
                value = loads(raw)
            except UntrustedJSONError as err:
                yield JSONLine(number, start, position, problem=str(err))
            else:
                yield JSONLine(number, start, position, value=value)
