"""A response cache keyed by (backend name, query, topk), in memory or persisted in SQLite.

Restoring an episode replays every search. For a live backend (Wikipedia, a remote server
whose corpus may change) only a cache makes the replay see the same passages; for a local
index it saves the work. SQLite (WAL mode) lets the worker processes of a vector env share
one cache file safely.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from agent_gym.search.passages import Passage, SearchBackend, check_batch

_SCHEMA = """CREATE TABLE IF NOT EXISTS responses (
    backend TEXT NOT NULL, query TEXT NOT NULL, topk INTEGER NOT NULL, passages TEXT NOT NULL,
    PRIMARY KEY (backend, query, topk))"""

Key = tuple[str, str, int]


class ResponseCache:
    """`path=None` keeps entries in memory only; a path persists them across processes.

    The in-memory layer is an LRU of at most `max_memory` entries, so a long training run
    does not grow without bound; with a file nothing is lost on eviction.
    """

    def __init__(self, path: str | Path | None = None, *, max_memory: int = 100_000) -> None:
        self.path = Path(path) if path is not None else None
        self.max_memory = max_memory
        self._memory: OrderedDict[Key, list[Passage]] = OrderedDict()
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=30.0, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(_SCHEMA)
            self._db.commit()

    def get(self, key: Key) -> list[Passage] | None:
        with self._lock:
            if key in self._memory:
                self._memory.move_to_end(key)
                return self._memory[key]
            if self._db is None:
                return None
            row = self._db.execute(
                "SELECT passages FROM responses WHERE backend=? AND query=? AND topk=?",
                _sql_key(key),
            ).fetchone()
            if row is None:
                return None
            passages = [Passage.from_json(p) for p in json.loads(row[0])]
            self._remember({key: passages})
            return passages

    def put_many(self, entries: dict[Key, list[Passage]]) -> None:
        with self._lock:
            self._remember(entries)
            if self._db is None or not entries:
                return
            rows = [(*_sql_key(key), _sql_passages(passages)) for key, passages in entries.items()]
            self._db.executemany("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)", rows)
            self._db.commit()

    def _remember(self, entries: dict[Key, list[Passage]]) -> None:
        self._memory.update(entries)
        for key in entries:
            self._memory.move_to_end(key)
        while len(self._memory) > self.max_memory:
            self._memory.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            if self._db is None:
                return len(self._memory)
            return int(self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


def _sql_key(key: Key) -> tuple[str | bytes, str | bytes, int]:
    return _sql_text(key[0]), _sql_text(key[1]), key[2]


def _sql_text(text: str) -> str | bytes:
    """``text`` as SQLite can bind it: itself, or, when it holds a lone surrogate (``"\\ud800"``
    in a model's JSON tool call decodes to one, and UTF-8 cannot encode it), its
    ``surrogatepass`` bytes as a BLOB. A BLOB never equals a TEXT value, so such a key
    cannot collide with any other, and files written before keep their keys."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")
    return text


def _sql_passages(passages: list[Passage]) -> str:
    """The passages as JSON text; ASCII escapes only when a lone surrogate forces them."""
    records = [p.to_json() for p in passages]
    text = json.dumps(records, ensure_ascii=False)
    return text if isinstance(_sql_text(text), str) else json.dumps(records)


class CachedBackend:
    """Answers from the cache where it can and sends only the misses, as one batch, to
    the wrapped backend. Failures are not cached, so a later call can still succeed."""

    def __init__(self, backend: SearchBackend, cache: ResponseCache) -> None:
        self.backend = backend
        self.cache = cache
        self.name = backend.name
        self.hits = 0
        self.misses = 0

    def search(self, queries: Sequence[str], topk: int) -> list[list[Passage]]:
        check_batch(queries, topk)
        found: dict[str, list[Passage]] = {}
        for query in dict.fromkeys(queries):
            cached = self.cache.get((self.name, query, topk))
            if cached is not None:
                found[query] = cached
        missing = [q for q in dict.fromkeys(queries) if q not in found]
        self.hits += len(queries) - sum(q in missing for q in queries)
        self.misses += len(missing)
        if missing:
            fresh = dict(zip(missing, self.backend.search(missing, topk), strict=True))
            self.cache.put_many({(self.name, q, topk): p for q, p in fresh.items()})
            found.update(fresh)
        return [found[q] for q in queries]

    def close(self) -> None:
        self.backend.close()
        self.cache.close()
