"""What bounds how many sessions one server holds: open files (a socket per session, and a
loaded index per Search env), the corpus hashed for every env built, and the process's
garbage collector. ``benchmarks/bench_serve.py --section sessions`` measures the rest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gymnasium
import pytest

import agent_gym  # noqa: F401  (registers the envs)
from agent_gym.search import BM25Index, bm25, open_backend
from agent_gym.search.bm25 import shared_index
from tests.helpers.serve_process import ROOT, frame, running_server

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(),
                                reason="counts open files through /proc")

DOCS = [
    {"id": "a", "title": "Orvane", "text": "The Orvane is a river that flows into the sea."},
    {"id": "b", "title": "Kellmere", "text": "Kellmere makes cider from its many orchards."},
]
SOFT_FILES = 48  # what a server under test starts with (tests/serve/few_open_files.py)
SEARCH = ('<tool_call>\n{"name": "search", "arguments": {"query": "cider orchards"}}\n'
          "</tool_call>")


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def files_open_under(directory: Path) -> int:
    """How many of this process's open files lie under ``directory``."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory))
        except OSError:  # closed meanwhile
            continue
    return count


# ------------------------------------------------------------------ one index per process
def test_search_envs_of_one_process_share_one_loaded_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("AGENT_GYM_CACHE", str(cache))
    corpus = str(write_jsonl(tmp_path / "corpus.jsonl", DOCS))
    envs = [gymnasium.make("agent_gym/Search-v0", corpus=corpus, max_turns=5)]
    one = files_open_under(cache)
    assert one > 0  # the index's mapped files
    envs += [gymnasium.make("agent_gym/Search-v0", corpus=corpus, max_turns=5)
             for _ in range(7)]
    assert files_open_under(cache) == one  # not eight times as many
    for env in envs[1:]:
        env.close()
    envs[0].reset(options={"index": 0})
    info = envs[0].step(SEARCH)[4]
    assert info["passage_ids"] == ["b"]  # the others' closing left it searching
    envs[0].close()
    assert files_open_under(cache) == 0  # the last one closed it


def test_an_index_rebuilt_in_place_is_loaded_anew_and_a_closed_handle_refuses(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "index"
    BM25Index.build(write_jsonl(tmp_path / "old.jsonl", DOCS[:1]), directory)
    old = shared_index(directory)
    BM25Index.build(write_jsonl(tmp_path / "new.jsonl", DOCS), directory, overwrite=True)
    new = shared_index(directory)
    assert new.name != old.name  # another corpus: another cache key, another state check
    assert [p.id for p in old.search(["cider"], 2)[0]] == []
    assert [p.id for p in new.search(["cider"], 2)[0]] == ["b"]
    old.close()
    old.close()  # twice is once
    assert [p.id for p in new.search(["river"], 2)[0]] == ["a"]
    new.close()
    with pytest.raises(ValueError, match="closed"):
        new.search(["river"], 2)


def test_a_corpus_is_hashed_once_per_process_until_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every Search env built on a corpus finds its index by the corpus's hash; a server
    opening a session per client must not read a large corpus whole each time."""
    monkeypatch.setenv("AGENT_GYM_CACHE", str(tmp_path / "cache"))
    corpus = write_jsonl(tmp_path / "corpus.jsonl", DOCS)
    hashed: list[Path] = []
    real = bm25.file_sha256
    # the corpus's own hash (the index's files are checked once per process, apart)
    monkeypatch.setattr(bm25, "file_sha256",
                        lambda path: (Path(path) == corpus and hashed.append(path)) or real(path))
    first = [open_backend("bm25", corpus=str(corpus)) for _ in range(3)]
    assert len(hashed) == 1
    with corpus.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps({"id": "c", "title": "Zenn", "text": "glass"}) + "\n")
    changed = open_backend("bm25", corpus=str(corpus))
    assert len(hashed) == 2 and changed.name != first[0].name
    for backend in (*first, changed):
        backend.close()


# ------------------------------------------------------------------ the server process
def test_a_server_holds_more_sessions_than_the_open_file_limit_it_started_with() -> None:
    """Each session holds a socket; a server started under a low soft limit (many systems
    start processes at 1,024) raises it to the hard limit itself."""
    import asyncio

    from websockets.asyncio.client import connect

    sessions = 2 * SOFT_FILES

    async def hold(url: str) -> list[str]:
        sockets = [await connect(url.replace("http", "ws") + "/ws", open_timeout=15)
                   for _ in range(sessions)]
        try:
            for index, ws in enumerate(sockets):
                await ws.send(frame("reset", {"index": index % 50}))
            return [json.loads(await ws.recv())["type"] for ws in sockets]
        finally:
            for ws in sockets:
                await ws.close()

    with running_server("agent_gym/GSM8K-v0", "--import", "tests.serve.few_open_files",
                        "--max-sessions", str(sessions),
                        env={"AGENT_GYM_TEST_SOFT_FILES": str(SOFT_FILES)}) as url:
        assert asyncio.run(hold(url)) == ["observation"] * sessions


def test_prepare_process_raises_the_soft_limit_and_says_when_the_hard_one_is_short() -> None:
    """In a process of its own: it changes the process it runs in."""
    script = textwrap.dedent("""
        import gc, json, resource
        from agent_gym.serve.sessions import prepare_process
        hard = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 4096)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        fits = prepare_process(hard - 64)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        print(json.dumps([hard, fits, soft, prepare_process(hard), gc.get_threshold()[0]]))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120, check=True)
    hard, fits, soft, short, young = json.loads(done.stdout)
    assert fits is None and soft == hard
    assert f"may open {hard} files" in short and f"--max-sessions {hard}" in short
    assert young >= 10_000  # collected less often than CPython's 700
