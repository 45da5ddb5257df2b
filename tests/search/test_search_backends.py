"""Local search parts: passages and corpora, the BM25 index, the response cache, the bundled
world data and the `agent-gym search` CLI."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from agent_gym.search import (
    BM25Index,
    CachedBackend,
    CorpusError,
    Passage,
    ResponseCache,
    bundled_corpus,
    open_backend,
)
from agent_gym.search import cli as search_cli
from agent_gym.search.bm25 import ensure_index, file_sha256, s_stem
from agent_gym.search.passages import iter_corpus
from agent_gym.search.world import build_dataset

DOCS = [
    {"id": "a", "contents": '"Orvane"\nThe Orvane is a river that flows into the Grey Sea.'},
    {"id": "b", "contents": '"Zennhaven"\nZennhaven is a town on the Orvane famous for glass.'},
    {"id": "c", "contents": '"Kellmere"\nKellmere makes cider from its many orchards.'},
    {"id": "d", "contents": "no title line here, cities and rivers"},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def small_index(tmp_path_factory: pytest.TempPathFactory) -> BM25Index:
    root = tmp_path_factory.mktemp("small")
    return BM25Index.build(write_jsonl(root / "c.jsonl", DOCS), root / "index")


def test_passage_contents_round_trip() -> None:
    p = Passage.from_contents("7", '"Title with spaces"\nBody\nsecond line', 1.5)
    assert (p.title, p.text, p.score) == ("Title with spaces", "Body\nsecond line", 1.5)
    assert Passage.from_contents("7", p.contents) == Passage("7", p.title, p.text)
    assert Passage.from_contents("8", "no title").title == ""
    assert Passage.from_wire(p.to_wire()) == p
    assert Passage.from_wire({"id": "9", "contents": '"T"\nx'}) == Passage("9", "T", "x")
    with pytest.raises(ValueError, match="contents"):
        Passage.from_wire({"document": {"id": "1"}})


def test_corpus_reader_accepts_both_layouts_and_names_bad_lines(tmp_path: Path) -> None:
    rows = [{"id": "x", "contents": '"A"\ntext a'}, {"title": "B", "text": "text b"}]
    passages = list(iter_corpus(write_jsonl(tmp_path / "c.jsonl", rows)))
    assert passages == [Passage("x", "A", "text a"), Passage("1", "B", "text b")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "contents": "ok"}\n{"title": 3}\n')
    with pytest.raises(CorpusError, match=r"bad.jsonl:2"):
        list(iter_corpus(bad))
    bad.write_text("not json\n")
    with pytest.raises(CorpusError, match=r":1"):
        list(iter_corpus(bad))
    with pytest.raises(CorpusError, match="not found"):
        list(iter_corpus(tmp_path / "missing.jsonl"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(CorpusError, match="no passages"):
        BM25Index.build(empty, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_s_stemmer_folds_plurals_only() -> None:
    assert s_stem(["rivers", "cities", "glass", "bus", "orchards", "ss"]) == [
        "river", "city", "glass", "bus", "orchard", "ss"
    ]


def test_bm25_ranks_titles_text_and_drops_non_matches(small_index: BM25Index) -> None:
    first, second, none, empty = small_index.search(
        ["which river flows into the Grey Sea", "orchard cider", "xylophone", "   "], topk=2
    )
    assert first[0].id == "a" and first[0].title == "Orvane"
    assert [p.id for p in second] == ["c"]  # "orchards" matches "orchard" after stemming
    assert none == [] and empty == []
    assert first[0].score >= first[-1].score > 0
    assert small_index.search([], 3) == []
    assert len(small_index.search(["orvane river city"], topk=50)[0]) <= 4  # topk > corpus
    with pytest.raises(ValueError, match="topk"):
        small_index.search(["x"], 0)
    with pytest.raises(TypeError):
        small_index.search("a string is not a batch", 1)  # type: ignore[arg-type]


def test_bm25_saved_index_loads_mmap_with_identical_results(
    small_index: BM25Index, tmp_path: Path
) -> None:
    queries = ["Orvane glass town", "river sea", "cider"]
    loaded = BM25Index(small_index.directory, mmap=True)
    in_ram = BM25Index(small_index.directory, mmap=False)
    assert loaded.search(queries, 3) == small_index.search(queries, 3) == in_ram.search(
        queries, 3
    )
    assert loaded.name == small_index.name and loaded.name.startswith("bm25-v1:")
    with pytest.raises(FileExistsError):
        BM25Index.build(tmp_path / "x.jsonl", small_index.directory)
    with pytest.raises(FileNotFoundError, match="no BM25 index"):
        BM25Index(tmp_path)


def test_ensure_index_is_keyed_by_corpus_content(tmp_path: Path) -> None:
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    first = ensure_index(corpus, tmp_path / "cache")
    assert ensure_index(corpus, tmp_path / "cache") == first  # reused, not rebuilt
    write_jsonl(corpus, [*DOCS, {"id": "e", "contents": '"New"\nnew passage'}])
    second = ensure_index(corpus, tmp_path / "cache")
    assert second != first and BM25Index(second).num_docs == 5
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        [first.name, second.name]
    )


def _poison(index: Path) -> None:
    """Change a passage of a built index in place, bytes for bytes, so its offsets still
    read: the corpus (and a data set's digest of it) is untouched."""
    store = index / "passages.jsonl"
    store.write_bytes(store.read_bytes().replace(b"Grey Sea", b"Red! Sea"))


def test_a_cached_index_whose_files_changed_is_set_aside_and_built_again(
    tmp_path: Path
) -> None:
    """A passage poisoned in the cached index was served while the corpus's digest passed."""
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    index = ensure_index(corpus, tmp_path / "cache")
    _poison(index)
    with pytest.raises(CorpusError, match=r"passages\.jsonl does not have the SHA-256"):
        BM25Index(index)  # an index named by the user: refused
    with pytest.warns(RuntimeWarning, match="set aside as .*damaged.* built again"):
        assert ensure_index(corpus, tmp_path / "cache") == index
    (passage,) = BM25Index(index).search(["grey sea"], 1)[0][:1]
    assert passage.id == "a" and "Grey Sea" in passage.text
    aside = tmp_path / "cache" / f"{index.name}.damaged"
    assert b"Red! Sea" in (aside / "passages.jsonl").read_bytes()  # kept, never deleted


@pytest.mark.parametrize("edit", ["a file added", "a file removed", "meta without digests"])
def test_an_index_unlike_the_one_built_is_refused(tmp_path: Path, edit: str) -> None:
    index = BM25Index.build(write_jsonl(tmp_path / "c.jsonl", DOCS), tmp_path / "index")
    index.close()
    meta = json.loads((tmp_path / "index" / "meta.json").read_text())
    if edit == "a file added":
        (tmp_path / "index" / "extra.npy").write_bytes(b"")
    elif edit == "a file removed":
        (tmp_path / "index" / "offsets.npy").unlink()
    else:
        del meta["files"]
        (tmp_path / "index" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CorpusError, match="rebuild it"):
        BM25Index(tmp_path / "index")


def test_ensure_index_under_concurrent_first_use(tmp_path: Path) -> None:
    """Threads of one process (an eval's env slots) race to build the same index."""
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    with ThreadPoolExecutor(4) as pool:
        paths = set(pool.map(lambda _: ensure_index(corpus, tmp_path / "cache"), range(8)))
    assert len(paths) == 1 and BM25Index(paths.pop()).num_docs == 4
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [f"bm25-v1-{file_sha256(corpus)[:16]}"]


def test_cache_serves_hits_batches_misses_and_persists(
    small_index: BM25Index, tmp_path: Path
) -> None:
    calls: list[list[str]] = []

    class Counting:
        name = small_index.name

        def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
            calls.append(list(queries))
            return small_index.search(queries, topk)

        def close(self) -> None:
            pass

    path = tmp_path / "responses.sqlite"
    cached = CachedBackend(Counting(), ResponseCache(path))
    expected = small_index.search(["river", "cider", "river"], 2)
    assert cached.search(["river", "cider", "river"], 2) == expected
    assert calls == [["river", "cider"]]  # duplicates collapsed into one batch
    assert cached.search(["cider", "glass"], 2)[0] == expected[1]
    assert calls[-1] == ["glass"] and (cached.hits, cached.misses) == (1, 3)
    cached.search(["cider"], 3)  # another topk is another key
    assert calls[-1] == ["cider"]
    cached.cache.close()

    reopened = CachedBackend(Counting(), ResponseCache(path))  # e.g. another process
    assert reopened.search(["river", "cider"], 2) == expected[:2]
    assert len(calls) == 3 and len(reopened.cache) == 4


def test_sqlite_cache_keeps_lone_surrogates_apart_and_persists_them(tmp_path: Path) -> None:
    """A JSON tool call can carry "\\ud800", which UTF-8 (and so SQLite TEXT) cannot hold."""
    path = tmp_path / "responses.sqlite"
    odd = [Passage("1", "T\udfff", "text \ud800", 1.5)]
    plain = [Passage("2", "T", "plain")]
    entries = {("b", "q \ud800", 1): odd, ("b", "q \\ud800", 1): plain}  # lone vs its escape
    cache = ResponseCache(path)
    cache.put_many(entries)
    cache.close()
    reopened = ResponseCache(path)  # nothing served from memory
    assert reopened.get(("b", "q \ud800", 1)) == odd
    assert reopened.get(("b", "q \\ud800", 1)) == plain
    assert reopened.get(("b", "q \udc00", 1)) is None and len(reopened) == 2
    reopened.close()


def test_cache_memory_layer_is_bounded(small_index: BM25Index) -> None:
    cache = ResponseCache(max_memory=2)
    backend = CachedBackend(small_index, cache)
    backend.search(["a1", "b2", "c3"], 1)
    assert len(cache) == 2 and cache.get((small_index.name, "a1", 1)) is None


def test_bundled_world_is_consistent_and_regenerates_identically() -> None:
    corpus, qa = build_dataset()
    shipped = [json.loads(line) for line in bundled_corpus().read_text().splitlines()]
    shipped_qa = [
        json.loads(line)
        for line in (bundled_corpus().parent / "search_qa.jsonl").read_text().splitlines()
    ]
    assert shipped == corpus and shipped_qa == qa
    assert len(corpus) >= 300 and len(qa) >= 50
    assert len({c["id"] for c in corpus}) == len(corpus)
    assert sum(q["hops"] >= 2 for q in qa) >= 20
    by_id = {c["id"]: Passage.from_record(c, "").contents.lower() for c in corpus}
    for q in qa:
        gold = q["answers"][0].lower()
        assert gold in by_id[q["supporting"][-1]], q  # the last hop's passage holds the answer
        if q["hops"] >= 2:  # and the first hop's does not: it takes a second search
            assert gold not in by_id[q["supporting"][0]], q


def test_bundled_first_hop_is_retrievable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_GYM_CACHE", str(tmp_path))
    index = open_backend("bm25")
    qa = [json.loads(x) for x in (bundled_corpus().parent / "search_qa.jsonl").open()]
    results = index.search([q["question"] for q in qa], 3)
    found = sum(q["supporting"][0] in {p.id for p in r} for q, r in zip(qa, results, strict=True))
    assert found / len(qa) >= 0.9
    assert list(tmp_path.glob("search/bm25-*/meta.json"))  # built lazily into the cache dir


def test_open_backend_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="unknown search backend"):
        open_backend("elastic")
    with pytest.raises(ValueError, match="needs url"):
        open_backend("http")
    with pytest.raises(ValueError, match="http://"):
        open_backend("http", url="localhost:8000")


def test_cli_index_and_query(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    search_cli.register(parser.add_subparsers(dest="command"))

    def run(*argv: str) -> int:
        args = parser.parse_args(list(argv))
        return args.run(args)

    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    assert run("search", "index", str(corpus), str(tmp_path / "ix")) == 0
    assert "indexed 4 passages" in capsys.readouterr().out
    assert run("search", "index", str(corpus), str(tmp_path / "ix")) == 2
    assert "exists" in capsys.readouterr().err
    assert run("search", "query", str(tmp_path / "ix"), "cider orchards", "--json") == 0
    line = json.loads(capsys.readouterr().out)
    assert line["result"][0]["document"]["id"] == "c"
    assert run("search", "query", str(tmp_path / "nope"), "x") == 2
    assert "no BM25 index" in capsys.readouterr().err
