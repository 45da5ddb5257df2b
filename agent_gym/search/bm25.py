"""Local BM25 retrieval with bm25s: build an index from a JSONL corpus once, load it mmap'ed.

On disk an index directory holds bm25s's sparse score matrix, a `passages.jsonl` store with an
`offsets.npy` line table (so a loaded index keeps passages on disk, not in RAM), and
`meta.json` recording the corpus fingerprint, the tokenizer settings and the SHA-256 of every
other file of the index. The fingerprint goes into the backend `name`, so cached responses
and saved episodes never mix two corpora.

An index is loaded only once each of its files has the digest recorded when it was built:
the corpus's digest says nothing of the index made from it, and a passage edited in a
cached index was served to the agent while the data set's digests passed. An index in the
cache that fails (or predates the record) is set aside and built again from its corpus;
one named by the user is refused in one line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from agent_gym import untrusted
from agent_gym.durable import open_regular, set_aside
from agent_gym.extras import install_hint
from agent_gym.search.passages import CorpusError, Passage, check_batch, iter_corpus

FORMAT = 1  # bump when the on-disk layout or the tokenizer changes: it keys built indexes
_TOKEN_PATTERN = r"(?u)\b\w\w+\b"
_META = "meta.json"
_PASSAGES = "passages.jsonl"
_OFFSETS = "offsets.npy"
_MAX_META_BYTES = 2**20  # meta.json is a few hundred bytes
_SHA256 = frozenset("0123456789abcdef")


class DamagedIndexError(CorpusError):
    """An index directory whose files are not the ones recorded when it was built."""


def _bm25s() -> Any:
    """Import bm25s on first use: it is the `search` extra, not a core dependency."""
    try:
        import bm25s
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ImportError(f"local BM25 search needs bm25s: {install_hint('search')}") from exc
    logging.getLogger("bm25s").setLevel(logging.WARNING)
    return bm25s


def s_stem(words: list[str]) -> list[str]:
    """A plural-only stemmer after Harman's "S" stemmer ("rivers" -> "river", "cities" -> "city").

    A light stemmer keeps names intact (aggressive stemmers mangle invented proper nouns)
    while still matching the singular/plural forms questions and passages disagree on.
    """
    out = []
    for w in words:
        if len(w) > 3 and w.endswith("ies") and not w.endswith(("eies", "aies")):
            w = w[:-3] + "y"
        elif len(w) > 2 and w.endswith("s") and not w.endswith(("us", "ss")):
            w = w[:-1]
        out.append(w)
    return out


def tokenize(texts: list[str], return_ids: bool) -> Any:
    """The one tokenizer for corpus and queries: lower-case words, English stopwords, s-stem."""
    return _bm25s().tokenize(
        texts, lower=True, token_pattern=_TOKEN_PATTERN, stopwords="en", stemmer=s_stem,
        return_ids=return_ids, show_progress=False,
    )


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class _PassageStore:
    """Passages on disk, read by line offset through a shared read-only mmap (thread-safe)."""

    def __init__(self, directory: Path) -> None:
        self._offsets = np.load(directory / _OFFSETS, mmap_mode="r")
        self._file = open(directory / _PASSAGES, "rb")  # noqa: SIM115 - lives as long as the index
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)

    def get(self, index: int, score: float) -> Passage:
        start, end = int(self._offsets[index]), int(self._offsets[index + 1])
        return Passage.from_json({**json.loads(self._map[start:end]), "score": score})

    def close(self) -> None:
        self._map.close()
        self._file.close()


class BM25Index:
    """A loaded BM25 index; `search` is safe to call from many threads (the server does)."""

    def __init__(self, directory: str | Path, *, mmap: bool = True) -> None:
        self.directory = Path(directory)
        self.meta: dict[str, Any] = check_index(self.directory)
        self.num_docs = self.meta["num_docs"]
        self.name = f"bm25-v{FORMAT}:{self.meta['corpus_sha256'][:16]}"
        self._retriever = _bm25s().BM25.load(
            str(self.directory), mmap=mmap, show_progress=False, verbosity=0
        )
        self._vocab: dict[str, int] = self._retriever.vocab_dict
        self._store = _PassageStore(self.directory)

    @classmethod
    def build(
        cls, corpus: str | Path, out_dir: str | Path, *, overwrite: bool = False
    ) -> BM25Index:
        """Index `corpus` into `out_dir` (written to a temp dir, then renamed into place)."""
        out_dir = Path(out_dir)
        if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
            raise FileExistsError(f"{out_dir} exists and is not empty (pass overwrite=True)")
        _build_into(Path(corpus), out_dir, file_sha256(corpus), replace=True)
        return cls(out_dir)

    def search(self, queries: Sequence[str], topk: int) -> list[list[Passage]]:
        """Top-`topk` passages per query; passages with zero score (no shared term) are dropped."""
        check_batch(queries, topk)
        results: list[list[Passage]] = [[] for _ in queries]
        if not queries:
            return results
        tokens = [[t for t in q if t in self._vocab] for q in tokenize(list(queries), False)]
        live = [i for i, q in enumerate(tokens) if q]
        if not live:
            return results
        k = min(topk, self.num_docs)
        docs, scores = self._retriever.retrieve(
            [tokens[i] for i in live], k=k, show_progress=False, n_threads=0
        )
        for row, i in enumerate(live):
            results[i] = [
                self._store.get(int(d), float(s))
                for d, s in zip(docs[row], scores[row], strict=True)
                if s > 0
            ]
        return results

    def close(self) -> None:
        self._store.close()


class SharedIndex:
    """One holder's handle on an index loaded once per process (``shared_index``).

    An index is read-only and its ``search`` thread-safe, so every env of a process that
    searches the same index can use one copy: a server holding a thousand Search sessions
    keeps one vocabulary and one set of mapped files (six descriptors) instead of a
    thousand, and opens a session without loading anything. ``close`` gives the handle
    back; the last one given back closes the index."""

    def __init__(self, key: tuple[str, int, int], index: BM25Index) -> None:
        self._key = key
        self._index: BM25Index | None = index
        self.name = index.name
        self.num_docs = index.num_docs
        self.directory = index.directory

    def search(self, queries: Sequence[str], topk: int) -> list[list[Passage]]:
        if self._index is None:  # as a closed BM25Index would, though others still use it
            raise ValueError("search on a closed index")
        return self._index.search(queries, topk)

    def close(self) -> None:
        with _SHARED_LOCK:
            if self._index is None:
                return
            self._index = None
            index, holders = _SHARED[self._key]
            if holders > 1:
                _SHARED[self._key] = (index, holders - 1)
                return
            del _SHARED[self._key]
        index.close()


# The indexes loaded in this process, with how many handles each has out.
_SHARED: dict[tuple[str, int, int], tuple[BM25Index, int]] = {}
_SHARED_LOCK = threading.Lock()


def shared_index(directory: str | Path) -> SharedIndex:
    """A handle on the index in ``directory``, loaded by the first caller in this process.

    Keyed by the directory and the identity of its ``meta.json`` (inode, modification
    time), so an index rebuilt in place (``agent-gym search index --force`` renames a new
    directory over it) is loaded anew for the envs opened afterwards."""
    path = Path(directory).resolve()
    try:
        meta = (path / _META).stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"no BM25 index in {path} (missing {_META})") from None
    key = (str(path), meta.st_ino, meta.st_mtime_ns)
    with _SHARED_LOCK:  # loading under it: a second env waits for the first one's copy
        index, holders = _SHARED.get(key) or (BM25Index(path), 0)
        _SHARED[key] = (index, holders + 1)
    return SharedIndex(key, index)


def check_index(directory: Path) -> dict[str, Any]:
    """``directory``'s ``meta.json``, once it is schema-checked and every file of the index
    has the SHA-256 it records (``DamagedIndexError`` naming the first that does not).
    Linear in the index's size; done once per process for an unchanged ``meta.json``."""
    meta_path = directory / _META
    if not meta_path.is_file():
        raise FileNotFoundError(f"no BM25 index in {directory} (missing {_META})")
    rebuild = "rebuild it with `agent-gym search index --force`"
    try:
        with open_regular(meta_path) as handle:
            meta = untrusted.loads(handle.read(_MAX_META_BYTES + 1))
    except (OSError, untrusted.UntrustedJSONError) as err:
        raise DamagedIndexError(f"{meta_path} cannot be read ({err}); {rebuild}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise DamagedIndexError(f"index {directory} has format {found!r}, expected {FORMAT}; "
                                f"{rebuild}")
    files = meta.get("files")
    if not (isinstance(files, dict) and _OFFSETS in files and _PASSAGES in files
            and all(isinstance(digest, str) and len(digest) == 64 and set(digest) <= _SHA256
                    for digest in files.values())
            and type(meta.get("num_docs")) is int and meta["num_docs"] > 0
            and isinstance(meta.get("corpus_sha256"), str)):
        raise DamagedIndexError(f"{meta_path} does not record the digests of the index's "
                                f"files (built by an older agent-gym, or edited); {rebuild}")
    present = sorted(p.name for p in directory.iterdir() if p.name != _META)
    if present != sorted(files):
        raise DamagedIndexError(f"index {directory} holds {present}, not the files it was "
                                f"built with ({sorted(files)}); {rebuild}")
    for name, want in sorted(files.items()):
        if _verified_sha256(directory / name) != want:
            raise DamagedIndexError(f"{directory / name} does not have the SHA-256 recorded "
                                    f"when the index was built: it changed since; {rebuild}")
    return meta


# Digests of index files this process checked, by the file's identity: an env per slot
# loads the same index, and hashing it is linear in its size.
_VERIFIED: dict[tuple[str, int, int, int], str] = {}


def _verified_sha256(path: Path) -> str:
    with open_regular(path) as handle:
        stat = os.fstat(handle.fileno())
        key = (str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if key not in _VERIFIED:
            digest = hashlib.sha256()
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
            _VERIFIED[key] = digest.hexdigest()
    return _VERIFIED[key]


def _write_index(corpus: Path, out: Path, sha: str) -> None:
    """Stream the corpus into the passage store, then tokenize and index the texts."""
    texts: list[str] = []
    offsets = [0]
    with open(out / _PASSAGES, "wb") as store:
        for passage in iter_corpus(corpus):
            line = json.dumps(
                {"id": passage.id, "title": passage.title, "text": passage.text},
                ensure_ascii=False,
            ).encode() + b"\n"
            store.write(line)
            offsets.append(offsets[-1] + len(line))
            texts.append(f"{passage.title} {passage.text}")
    if not texts:
        raise CorpusError(f"{corpus}: the corpus has no passages")
    np.save(out / _OFFSETS, np.asarray(offsets, dtype=np.int64))
    retriever = _bm25s().BM25()
    retriever.index(tokenize(texts, True), show_progress=False)
    retriever.save(str(out), show_progress=False)
    meta = {
        "format": FORMAT,
        "num_docs": len(texts),
        "corpus_sha256": sha,
        "corpus_name": corpus.name,
        "tokenizer": {"pattern": _TOKEN_PATTERN, "stopwords": "en", "stemmer": "s"},
        "bm25": {"method": retriever.method, "k1": retriever.k1, "b": retriever.b},
        "bm25s_version": _bm25s().__version__,
        "files": {p.name: file_sha256(p) for p in sorted(out.iterdir())},
    }
    (out / _META).write_text(json.dumps(meta, indent=1))


_BUILD_LOCK = threading.Lock()
# Corpus hashes by the file's identity: every env built on a corpus finds its index by the
# hash, and a corpus of gigabytes takes a minute to hash, so each file is hashed once per
# process (again if it changes: another inode, size or modification time).
_CORPUS_SHA: dict[tuple[str, int, int, int], str] = {}


def corpus_sha256(corpus: Path) -> str:
    """``file_sha256(corpus)``, computed once per process for an unchanged file."""
    stat = corpus.stat()
    key = (str(corpus.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if key not in _CORPUS_SHA:
        _CORPUS_SHA[key] = file_sha256(corpus)
    return _CORPUS_SHA[key]


def ensure_index(corpus: str | Path, root: str | Path) -> Path:
    """The index of `corpus` under `root`, built on first use and keyed by the corpus hash;
    one there whose files fail ``check_index`` is set aside (never deleted) and built again.

    Threads of one process build it once (a lock); separate processes (an async vector env
    starts several at once) each build into a private temp dir and the first rename wins,
    so nobody ever reads a half-written index.
    """
    sha = corpus_sha256(Path(corpus))
    target = Path(root) / f"bm25-v{FORMAT}-{sha[:16]}"
    with _BUILD_LOCK:
        if (target / _META).is_file():
            try:
                check_index(target)
            except DamagedIndexError as err:
                aside = set_aside(target)
                warnings.warn(f"{err}: set aside as {aside.name} (delete it when done with "
                              "it) and built again from the corpus", RuntimeWarning,
                              stacklevel=2)
        if not (target / _META).is_file():
            _build_into(Path(corpus), target, sha, replace=False)
    return target


def _build_into(corpus: Path, target: Path, sha: str, *, replace: bool) -> None:
    """Write the index into a private temp dir and rename it to `target`.

    With `replace=False` losing a rename race to another process is fine: its index is
    for the same corpus hash.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _write_index(corpus, tmp, sha)
        if replace and target.exists():
            shutil.rmtree(target)
        try:
            tmp.rename(target)
        except OSError:
            if replace or not (target / _META).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
