"""Retrieval for the Search env: one batched interface over a local BM25 index, a
Search-R1-compatible HTTP server and client, live Wikipedia, and a response cache.

`open_backend` is the one place that turns an env's plain-JSON settings into a backend, so
the same settings rebuild the same backend when a saved episode is restored.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from agent_gym.paths import cache_root
from agent_gym.search.bm25 import BM25Index, ensure_index, shared_index
from agent_gym.search.cache import CachedBackend, ResponseCache
from agent_gym.search.client import RetrievalClient
from agent_gym.search.net import RetryPolicy
from agent_gym.search.passages import CorpusError, Passage, SearchBackend, SearchError
from agent_gym.search.server import RetrievalServer
from agent_gym.search.wikipedia import WikipediaBackend

__all__ = [
    "BACKENDS",
    "BM25Index",
    "CachedBackend",
    "CorpusError",
    "Passage",
    "ResponseCache",
    "RetrievalClient",
    "RetrievalServer",
    "RetryPolicy",
    "SearchBackend",
    "SearchError",
    "WikipediaBackend",
    "bundled_corpus",
    "open_backend",
]

BACKENDS = ("bm25", "http", "wikipedia")


def bundled_corpus() -> Path:
    """The original mini corpus shipped with the package (see `agent_gym.search.world`)."""
    return Path(str(resources.files("agent_gym") / "datasets" / "search_corpus.jsonl"))


def open_backend(
    kind: str = "bm25",
    *,
    corpus: str | None = None,
    index_dir: str | None = None,
    url: str | None = None,
    timeout: float = 10.0,
    max_retries: int = 3,
    backoff: float = 0.5,
) -> SearchBackend:
    """Build a backend: `bm25` over `index_dir`, or over `corpus` (default: the bundled one)
    indexed lazily under `cache_root()`, loaded once per process and shared by every
    backend opened on it (`shared_index`); `http` against a `/retrieve` server at `url`;
    `wikipedia` against the MediaWiki API at `url` (default: English Wikipedia).

    For the remote backends `timeout` cuts each attempt (connect to last byte) and
    `max_retries` counts retries; one query then returns or raises `SearchError` within
    ``(max_retries + 1) * timeout + max_retries * 8`` seconds (`RetryPolicy.bound`; 8 s is
    the longest wait between attempts), 64 s with the Search env's defaults."""
    retry = RetryPolicy(max_retries=max_retries, backoff=backoff)
    if kind == "bm25":
        if index_dir is not None:
            return shared_index(index_dir)
        source = Path(corpus) if corpus is not None else bundled_corpus()
        return shared_index(ensure_index(source, cache_root() / "search"))
    if kind == "http":
        if url is None:
            raise ValueError("the http backend needs url='http://host:port' of a /retrieve server")
        return RetrievalClient(url, timeout=timeout, retry=retry)
    if kind == "wikipedia":
        if url is None:
            return WikipediaBackend(timeout=timeout, retry=retry)
        return WikipediaBackend(url, timeout=timeout, retry=retry)
    raise ValueError(f"unknown search backend {kind!r}; choose one of {', '.join(BACKENDS)}")
