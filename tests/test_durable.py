"""``agent_gym.durable``: a file replaced whole or not at all, lines appended whole, and
JSONL from outside read at bounded cost (issue 48)."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agent_gym.durable import (
    CUT_LINE,
    AppendError,
    NotRegularFileError,
    append_lines,
    open_append,
    open_regular,
    read_jsonl,
    replace_file,
    set_aside,
)
from tests.helpers.nodes import special_nodes


def _temporaries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_each_write_takes_a_fresh_temporary_so_two_writers_never_clobber_each_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second writer lands between the first's write and its rename: with one fixed
    temporary name it renamed the first's file away, and the first crashed."""
    target = tmp_path / "state.json"
    renamed: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync_with_a_writer_in_between(fd: int) -> None:
        if not renamed and len(_temporaries(tmp_path)) == 1:
            replace_file(target, "second")
        real_fsync(fd)

    def replace(source: str | Path, destination: str | Path) -> None:
        renamed.append(Path(source).name)
        real_replace(source, destination)

    monkeypatch.setattr(os, "fsync", fsync_with_a_writer_in_between)
    monkeypatch.setattr(os, "replace", replace)
    replace_file(target, "first")
    assert target.read_text() == "first"  # the later rename wins, and neither failed
    assert len(set(renamed)) == 2 and all(name.startswith(".state.json.") for name in renamed)
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_kill_between_write_and_rename_leaves_the_old_file_whole(tmp_path: Path) -> None:
    target = tmp_path / "config.json"
    replace_file(target, b'{"old": true}\n')
    killed = subprocess.run(
        [sys.executable, "-c",
         "import os, sys\n"
         "from pathlib import Path\n"
         "from agent_gym.durable import replace_file\n"
         "os.replace = lambda *_: os._exit(9)  # killed after the sync, before the rename\n"
         "replace_file(Path(sys.argv[1]), b'{\"new\": tr')\n",
         str(target)], check=False)
    assert killed.returncode == 9
    assert target.read_bytes() == b'{"old": true}\n'
    (leftover,) = _temporaries(tmp_path)
    assert leftover.startswith(".config.json.")  # a dot file, never read as the target
    replace_file(target, lambda handle: handle.write(b'{"new": true}\n'))
    assert target.read_bytes() == b'{"new": true}\n'
    assert _temporaries(tmp_path) == [leftover]  # the next write took a name of its own


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "summary.json"
    replace_file(target, "kept", mode=0o640)

    def fails(handle: io.BufferedWriter) -> None:
        handle.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        replace_file(target, fails)
    assert target.read_text() == "kept" and _temporaries(tmp_path) == []
    assert target.stat().st_mode & 0o777 == 0o640


def test_appends_are_whole_lines_even_from_many_writers(tmp_path: Path) -> None:
    log = tmp_path / "episodes.jsonl"
    with pytest.raises(ValueError, match="whole lines"):
        append_lines(open_append(log), b'{"cut": ')

    def writer(name: int) -> None:
        fd = open_append(log)
        try:
            for n in range(50):
                append_lines(fd, f'{{"writer": {name}, "n": {n}, "pad": "{"x" * 500}"}}\n'
                             .encode())
        finally:
            os.close(fd)

    threads = [threading.Thread(target=writer, args=(name,)) for name in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with open_regular(log) as handle:
        lines = list(read_jsonl(handle))
    assert all(line.problem is None for line in lines) and len(lines) == 200


def test_an_append_cut_by_a_full_disk_says_how_much_is_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "episodes.jsonl"
    fd = open_append(log)
    real_write = os.write
    room = [10]

    def full_after_ten_bytes(target: int, data: bytes | memoryview) -> int:
        if not room[0]:
            raise OSError(28, "No space left on device")
        written = real_write(target, bytes(data[:room[0]]))
        room[0] -= written
        return written

    monkeypatch.setattr(os, "write", full_after_ten_bytes)
    with pytest.raises(AppendError) as caught:
        append_lines(fd, b'{"episode": 0}\n{"episode": 1}\n')
    monkeypatch.undo()
    os.close(fd)
    assert caught.value.synced == 10 and "No space" in str(caught.value)
    with open_regular(log) as handle:
        (cut,) = read_jsonl(handle)
    assert (cut.number, cut.start, cut.end, cut.problem) == (1, 0, 10, CUT_LINE)


def test_the_reader_skips_a_huge_line_unread_and_refuses_hostile_json() -> None:
    lines = [b'{"ok": 1}', b"x" * 5000, b"", b'{"x": NaN}', b"[" * 100 + b"]" * 100,
             b'{"big": 1e999}', b"\xff", b'{"ok": 2}', b'{"cut": ']
    handle = io.BytesIO(b"\n".join(lines))
    read = list(read_jsonl(handle, max_line_bytes=1000))
    assert [line.number for line in read] == [1, 2, 4, 5, 6, 7, 8, 9]  # 3 is blank
    assert read[0].value == {"ok": 1} and read[6].value == {"ok": 2}
    assert (read[1].start, read[1].end) == (10, 5011)
    problems = [line.problem for line in read]
    assert problems[0] is None and "longer than 1,000 bytes" in str(problems[1])
    for problem, needle in zip(problems[2:6], ["non-finite", "nested deeper",
                                               "too large to be finite", "not UTF-8"],
                               strict=True):
        assert needle in str(problem)
    assert problems[7] == CUT_LINE


def test_a_last_line_without_a_newline_is_read_when_the_caller_allows_it() -> None:
    (line,) = read_jsonl(io.BytesIO(b'{"hand": "written"}'), cut_ok=True)
    assert line.value == {"hand": "written"} and line.problem is None


def test_a_fifo_is_refused_before_a_byte_is_read(tmp_path: Path) -> None:
    fifo = tmp_path / "episodes.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(NotRegularFileError, match="not a regular file"):
        open_regular(fifo)


def test_a_device_or_fifo_is_never_replaced_by_a_file(tmp_path: Path) -> None:
    """As root, ``view --out /dev/null`` renamed a report over the device node."""
    for node in special_nodes(tmp_path):
        kind = stat.S_IFMT(os.lstat(node).st_mode)
        with pytest.raises(NotRegularFileError, match="not a regular file"):
            replace_file(node, "report")
        assert stat.S_IFMT(os.lstat(node).st_mode) == kind
    assert _temporaries(tmp_path) == []
    # A symlink is replaced itself, its target untouched (the device behind it included).
    (tmp_path / "link").symlink_to(tmp_path / "fifo")
    replace_file(tmp_path / "link", "report")
    assert (tmp_path / "link").read_text() == "report" and stat.S_ISFIFO(
        os.lstat(tmp_path / "fifo").st_mode)


def test_what_is_set_aside_is_renamed_never_over_an_earlier_one(tmp_path: Path) -> None:
    journal, index = tmp_path / "rollouts.sqlite", tmp_path / "index"
    for text in ("first", "second"):
        journal.write_text(text)
        index.mkdir()
        (index / "meta.json").write_text(text)
        set_aside(journal)
        set_aside(index)
    assert (tmp_path / "rollouts.sqlite.damaged").read_text() == "first"
    assert (tmp_path / "rollouts.sqlite.damaged-2").read_text() == "second"
    assert (tmp_path / "index.damaged-2" / "meta.json").read_text() == "second"
    assert not journal.exists() and not index.exists()
