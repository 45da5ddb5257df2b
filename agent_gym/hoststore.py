"""A host-side key -> bytes store: what this host computed once and may reuse, in any of
its env instances and, with a file, in any of its processes.

Restoring an episode in a fresh process means redoing work another process on the same
host already did (translating a game, playing its first forty steps). This store keeps
those results: a bounded in-memory LRU per process, and optionally a SQLite file (WAL mode,
so the worker processes of a vector env share it safely) named by the host; an env
that is told no file uses ``default_path()``. It is written only by this host's own code
from what it computed itself; a client's saved state can select entries (by the digest of
a prefix it claims) but never write or name one, so nothing here is trusted on a client's
word. The file is a cache: a damaged or unreadable one is reported once and then ignored,
and the store goes on in memory.

Keys of different uses never meet: each use has its own table. ``code_fingerprint``
changes with any edit of this package (its code or its data files) or of the engines'
versions, so entries written by other code are never read back as this code's results.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import sqlite3
import threading
import time
import warnings
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

from agent_gym.paths import cache_root

STORE_PATH_ENV = "AGENT_GYM_HOST_STORE"  # moves the default file, for every process
MAX_MEMORY_ENTRIES = 8192  # per table per process
MAX_FILE_ROWS = 200_000  # per table; the oldest written go first
_PRUNE_EVERY = 1024  # writes between two prunes of the file
BUSY_SECONDS = 30.0  # how long a process waits for another's write
_TABLE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz_")
# The most an entry may take, as stored and once inflated: far past any (an ALFWorld game's
# translation is a few hundred KB). A 1 MB record inflating to 1 GB cost a restore 2.1 GB.
MAX_ENTRY_BYTES = 16 * 2**20
MAX_INFLATED_BYTES = 64 * 2**20


def deflate(data: bytes) -> bytes:
    """``data`` compressed for the store (fast: entries are written on the env's path)."""
    return zlib.compress(data, 1)


def inflate(entry: bytes, limit: int | None = None) -> bytes:
    """An entry from ``deflate`` decompressed, refused (``zlib.error``) past ``limit`` bytes
    (default ``MAX_INFLATED_BYTES``) or short of its end: the file is written by this host
    but read as untrusted, so a record never costs more memory than the bound, whatever it
    claims to hold."""
    limit = MAX_INFLATED_BYTES if limit is None else limit
    decompressor = zlib.decompressobj()
    data = decompressor.decompress(entry, limit + 1)
    if len(data) > limit or decompressor.unconsumed_tail:
        raise zlib.error(f"a stored entry inflates to more than {limit:,} bytes")
    if not decompressor.eof or decompressor.unused_data:
        raise zlib.error("a stored entry is cut or has bytes after its end")
    return data


class HostStore:
    """One table of host-computed entries: memory always, ``path`` (a SQLite file) too
    when given. Thread-safe; safe across ``fork`` (a child reopens the file)."""

    def __init__(self, table: str, path: str | os.PathLike[str] | None = None, *,
                 max_memory: int = MAX_MEMORY_ENTRIES, max_rows: int = MAX_FILE_ROWS) -> None:
        if not table or not set(table) <= _TABLE_CHARS:
            raise ValueError(f"table names are lower-case letters and '_', got {table!r}")
        self.table = table
        self.path = Path(path) if path is not None else None
        self.max_memory = max_memory
        self.max_rows = max_rows
        self._memory: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._pid = -1  # the process that opened _db
        self._writes = 0
        self._broken = False

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        """The entries found among ``keys`` (memory first, then the file, where one longer
        than ``MAX_ENTRY_BYTES`` counts as missing)."""
        keys = list(dict.fromkeys(keys))
        with self._lock:
            found = {key: self._memory[key] for key in keys if key in self._memory}
            missing = [key for key in keys if key not in found]
            db = self._connection() if missing else None
            if db is not None:
                try:
                    for start in range(0, len(missing), 500):  # SQLite's bound-variable limit
                        chunk = missing[start:start + 500]
                        marks = ",".join("?" * len(chunk))
                        rows = db.execute(  # an entry past the bound is never read
                            f"SELECT key, value FROM {self.table} WHERE key IN ({marks}) "
                            "AND length(value) <= ?", [*chunk, MAX_ENTRY_BYTES]
                        ).fetchall()
                        found.update((str(key), bytes(value)) for key, value in rows)
                except sqlite3.Error as err:
                    self._give_up(err)
            for key in keys:
                if key in found:
                    self._keep(key, found[key])
            return found

    def get(self, key: str) -> bytes | None:
        return self.get_many([key]).get(key)

    def put(self, key: str, value: bytes) -> None:
        with self._lock:
            self._keep(key, value)
            db = self._connection()
            if db is None:
                return
            try:
                db.execute(f"INSERT OR REPLACE INTO {self.table} VALUES (?, ?)", (key, value))
                db.commit()
                self._writes += 1
                if self._writes % _PRUNE_EVERY == 0:
                    db.execute(f"DELETE FROM {self.table} WHERE rowid <= "
                               f"(SELECT MAX(rowid) FROM {self.table}) - ?", (self.max_rows,))
                    db.commit()
            except sqlite3.Error as err:
                self._give_up(err)

    def clear_memory(self) -> None:
        """Forget this process's copies (the file keeps its entries)."""
        with self._lock:
            self._memory.clear()

    def _keep(self, key: str, value: bytes) -> None:
        self._memory[key] = value
        self._memory.move_to_end(key)
        while len(self._memory) > self.max_memory:
            self._memory.popitem(last=False)

    def _connection(self) -> sqlite3.Connection | None:
        if self.path is None or self._broken:
            return None
        if self._db is not None and self._pid == os.getpid():
            return self._db
        # A connection inherited through fork must not be used: open this process's own.
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=BUSY_SECONDS, check_same_thread=False)
            _set_wal(db)
            db.execute("PRAGMA synchronous=NORMAL")  # a cache: losing the last writes is fine
            db.execute(f"CREATE TABLE IF NOT EXISTS {self.table} "
                       "(key TEXT PRIMARY KEY, value BLOB NOT NULL)")
            db.commit()
        except (OSError, sqlite3.Error) as err:
            self._give_up(err)
            return None
        self._db, self._pid = db, os.getpid()
        return db

    def _give_up(self, err: Exception) -> None:
        self._broken = True
        warnings.warn(f"host store {self.path} is unusable ({err}); going on in memory only",
                      RuntimeWarning, stacklevel=3)


def _set_wal(db: sqlite3.Connection) -> None:
    """Switch ``db`` to WAL, waiting out other processes as every other statement does.

    SQLite answers a journal-mode switch that meets another connection's lock with "database
    is locked" at once, without its busy handler: processes opening a new file together
    (the workers of a vector env, on a host's first run) lost the file to that race."""
    deadline = time.monotonic() + BUSY_SECONDS
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as err:
            if err.sqlite_errorcode != sqlite3.SQLITE_BUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


_STORES: dict[tuple[str, str | None], HostStore] = {}
_STORES_LOCK = threading.Lock()


def host_store(table: str, path: str | os.PathLike[str] | None = None) -> HostStore:
    """This process's store for ``table`` (and ``path``): every env instance in the
    process that names the same ones shares it."""
    key = (table, None if path is None else os.fspath(Path(path).expanduser().resolve()))
    with _STORES_LOCK:
        if key not in _STORES:
            _STORES[key] = HostStore(table, key[1])
        return _STORES[key]


def default_path() -> Path:
    """The host's store file when a caller names none: ``$AGENT_GYM_HOST_STORE``, else
    ``host_store.sqlite`` in agent_gym's cache directory (``$AGENT_GYM_CACHE`` or
    ``~/.cache/agent_gym``, as ``agent_gym.paths.cache_root`` decides for every cache).

    A default file is what makes a fresh process fast without any option: what one process
    of this host computed, the next one reads back instead of redoing."""
    named = os.environ.get(STORE_PATH_ENV)
    if named:
        return Path(named).expanduser()
    return cache_root() / "host_store.sqlite"


_CODE_FINGERPRINT: str | None = None
ENGINE_PACKAGES = ("textworld", "alfworld", "fast-downward-textworld", "gymnasium")


def code_fingerprint() -> str:
    """A digest of every file of this package (its code and the data it ships, such as the
    ALFWorld packs) and of the engines' versions: results computed by any other code or
    data never share keys with this code's."""
    global _CODE_FINGERPRINT
    if _CODE_FINGERPRINT is None:
        hasher = hashlib.sha256(tree_digest(Path(__file__).resolve().parent).encode())
        for package in ENGINE_PACKAGES:
            try:
                version = importlib.metadata.version(package)
            except importlib.metadata.PackageNotFoundError:
                version = "-"
            hasher.update(f"{package}={version};".encode())
        _CODE_FINGERPRINT = hasher.hexdigest()
    return _CODE_FINGERPRINT


def tree_digest(root: Path) -> str:
    """The SHA-256 of every file under ``root`` by its relative path, but Python's byte
    code caches and hidden files (a writer's temporary). Only *.py files were hashed, so a
    data file the results depend on could change under the same key; and each path and
    content goes in with its length, so no two trees of different files hash alike."""
    hasher = hashlib.sha256()
    for source in sorted(root.rglob("*")):
        relative = source.relative_to(root)
        if (not source.is_file() or "__pycache__" in relative.parts
                or any(part.startswith(".") for part in relative.parts)):
            continue
        name = relative.as_posix().encode("utf-8", "surrogateescape")
        content = source.read_bytes()
        hasher.update(b"%d:%s%d:" % (len(name), name, len(content)))
        hasher.update(content)
    return hasher.hexdigest()
