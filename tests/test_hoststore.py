"""agent_gym.hoststore: bounded memory, a file shared by processes, damage survived."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import tracemalloc
import warnings
import zlib
from pathlib import Path
from typing import Any

import pytest

import agent_gym
from agent_gym.hoststore import (
    STORE_PATH_ENV,
    HostStore,
    code_fingerprint,
    default_path,
    deflate,
    host_store,
    inflate,
    tree_digest,
)


def test_memory_is_bounded_least_recently_used_first_out() -> None:
    store = HostStore("things", max_memory=2)
    store.put("a", b"1")
    store.put("b", b"2")
    assert store.get("a") == b"1"  # a is now the most recent
    store.put("c", b"3")
    assert store.get_many(["a", "b", "c", "d"]) == {"a": b"1", "c": b"3"}


def test_a_file_outlives_the_process_memory_and_is_pruned(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "store.sqlite"
    writer = HostStore("things", path, max_rows=10)
    for n in range(1100):  # one prune happens at the 1024th write
        writer.put(f"k{n}", str(n).encode())
    reader = HostStore("things", path)
    found = reader.get_many(f"k{n}" for n in range(1100))
    assert found["k1099"] == b"1099" and "k0" not in found and len(found) <= 1100 - 1000
    assert HostStore("others", path).get("k1099") is None  # tables never meet


def _write_in_child(path: str) -> None:
    host_store("things", path).put("child", b"yes")


def test_a_forked_child_opens_its_own_connection(tmp_path: Path) -> None:
    path = str(tmp_path / "store.sqlite")
    parent = host_store("things", path)
    parent.put("parent", b"yes")
    child = multiprocessing.get_context("fork").Process(target=_write_in_child, args=(path,))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    parent.clear_memory()
    assert parent.get_many(["parent", "child"]) == {"parent": b"yes", "child": b"yes"}


def _open_together_and_write(path: str, index: int, barrier: Any) -> None:
    store = HostStore("things", path)
    barrier.wait()  # every process opens the new file at once (its first put opens it)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "unusable": this process lost the file
        for n in range(5):
            store.put(f"{index}:{n}", b"yes")


def test_processes_opening_a_new_file_together_all_keep_it(tmp_path: Path) -> None:
    """SQLite refuses a switch to WAL that meets another process's without waiting (about
    one round in five lost a process to it): the workers of a vector env, opening the
    host's default file on its first run, must all keep it. A race, so many rounds."""
    context = multiprocessing.get_context("fork")
    processes, rounds = 8, 30
    for attempt in range(rounds):
        path = str(tmp_path / f"store{attempt}.sqlite")
        barrier = context.Barrier(processes)
        children = [context.Process(target=_open_together_and_write, args=(path, i, barrier))
                    for i in range(processes)]
        for child in children:
            child.start()
        for child in children:
            child.join(60)
        assert [child.exitcode for child in children] == [0] * processes, f"round {attempt}"
        keys = [f"{i}:{n}" for i in range(processes) for n in range(5)]
        assert len(HostStore("things", path).get_many(keys)) == len(keys)


def test_the_default_file_is_in_the_cache_directory_unless_moved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(STORE_PATH_ENV, raising=False)
    monkeypatch.setenv("AGENT_GYM_CACHE", str(tmp_path / "cache"))
    assert default_path() == tmp_path / "cache" / "host_store.sqlite"
    monkeypatch.setenv(STORE_PATH_ENV, str(tmp_path / "elsewhere.sqlite"))
    assert default_path() == tmp_path / "elsewhere.sqlite"


def test_a_damaged_file_is_reported_once_and_memory_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "store.sqlite"
    path.write_bytes(b"not a database" * 100)
    store = HostStore("things", path)
    with pytest.warns(RuntimeWarning, match="unusable"):
        store.put("a", b"1")
    assert store.get("a") == b"1"
    store.put("b", b"2")  # no second warning: the file is left alone from now on


def test_table_names_are_plain_and_the_code_fingerprint_is_stable() -> None:
    with pytest.raises(ValueError, match="table names"):
        HostStore("x; DROP TABLE y")
    assert code_fingerprint() == code_fingerprint() and len(code_fingerprint()) == 64


def test_an_entry_inflates_within_its_bound_or_is_refused() -> None:
    """A 1 MB record inflating to 1 GB cost a restore 2.1 GB: inflating stops at the bound."""
    assert inflate(deflate(b"frame" * 1000)) == b"frame" * 1000
    bomb = zlib.compress(bytes(8 * 2**20), 9)  # 8 KB of zeros' worth of a bomb
    tracemalloc.start()
    try:
        with pytest.raises(zlib.error, match="more than 1,048,576 bytes"):
            inflate(bomb, limit=2**20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * 2**20, peak
    with pytest.raises(zlib.error, match="cut"):
        inflate(deflate(b"frame" * 1000)[:-4])


def test_an_entry_stored_past_the_bound_is_never_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "store.sqlite"
    HostStore("things", path).put("big", bytes(4096))
    monkeypatch.setattr("agent_gym.hoststore.MAX_ENTRY_BYTES", 1024)
    assert HostStore("things", path).get("big") is None


def _fingerprint_of(package: Path) -> str:
    """``code_fingerprint`` as a process importing ``package`` (a copy of agent_gym)
    computes it."""
    done = subprocess.run(
        [sys.executable, "-c", "from agent_gym.hoststore import code_fingerprint as f; print(f())"],
        env={**os.environ, "PYTHONPATH": str(package.parent)}, cwd=package.parent,
        capture_output=True, text=True, timeout=120, check=True)
    return done.stdout.strip()


def test_the_key_changes_with_an_engine_file_and_a_data_file_of_the_package(
    tmp_path: Path
) -> None:
    """Stored results (rewards included) of old code were served as the new code's when
    the key missed an edited source."""
    package = tmp_path / "agent_gym"
    shutil.copytree(Path(agent_gym.__file__).parent, package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    before = _fingerprint_of(package)
    assert _fingerprint_of(package) == before  # stable, byte code written or not
    engine = package / "alfworld" / "engine.py"
    engine.write_text(engine.read_text() + "\n# an edit\n")
    edited = _fingerprint_of(package)
    pack = package / "datasets" / "alfworld" / "large" / "large_test.jsonl.xz"
    pack.write_bytes(pack.read_bytes() + b"\0")
    assert len({before, edited, _fingerprint_of(package)}) == 3


def test_files_are_framed_so_moved_bytes_change_the_key(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    (one / "a.py").write_text("b.py")
    (two / "a.py").write_text("")
    (two / "b.py").write_text("")
    assert tree_digest(one) != tree_digest(two)
