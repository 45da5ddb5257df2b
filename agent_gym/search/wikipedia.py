"""Live Wikipedia search through the MediaWiki Action API, rate-limited and retried.

One request per query: `generator=search` ranks pages and `prop=extracts` returns their
plain-text introductions, so a hit carries the page title and its lead section. Results
change as Wikipedia is edited; wrap the backend in a `CachedBackend` with a persistent cache
to make episodes replayable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from agent_gym.search.net import RetryPolicy, TokenBucket, send_with_retries
from agent_gym.search.passages import Passage, SearchError, check_batch

DEFAULT_API = "https://en.wikipedia.org/w/api.php"
USER_AGENT = "agent-gym/0.1 (https://pypi.org/project/agent-gym/; retrieval QA environments)"
MAX_EXTRACTS = 20  # TextExtracts returns at most 20 intro extracts per request


class WikipediaBackend:
    """`search` paces requests with a token bucket shared by all threads of this instance."""

    def __init__(
        self,
        api_url: str = DEFAULT_API,
        *,
        rate: float = 2.0,
        burst: int = 4,
        timeout: float = 15.0,
        retry: RetryPolicy | None = None,
        user_agent: str = USER_AGENT,
        max_chars: int = 4000,
    ) -> None:
        if not api_url.startswith(("http://", "https://")):
            raise ValueError(f"MediaWiki API URL must start with http:// or https://: {api_url!r}")
        self.api_url = api_url
        self.name = f"wikipedia:{api_url}"
        self.retry = retry or RetryPolicy(max_retries=3, backoff=1.0, max_backoff=30.0)
        self.max_chars = max_chars
        self._bucket = TokenBucket(rate, burst)
        self._client = httpx.Client(
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
            headers={"user-agent": user_agent},
        )

    def search(self, queries: Sequence[str], topk: int) -> list[list[Passage]]:
        check_batch(queries, topk)
        return [self._search_one(q, min(topk, MAX_EXTRACTS)) if q.strip() else [] for q in queries]

    def _search_one(self, query: str, topk: int) -> list[Passage]:
        params = {
            "action": "query", "format": "json", "formatversion": "2", "redirects": "1",
            "generator": "search", "gsrsearch": query, "gsrlimit": str(topk),
            "gsrnamespace": "0", "prop": "extracts", "exintro": "1", "explaintext": "1",
            "exlimit": str(topk), "maxlag": "5",
        }
        self._bucket.acquire()
        response = send_with_retries(
            self._client, "GET", self.api_url, self.retry, f"MediaWiki API {self.api_url}",
            transient=_lagged, params=params,
        )
        try:
            payload = response.json()
        except ValueError as exc:
            raise SearchError(f"MediaWiki API sent a malformed reply: {exc}") from None
        return self._parse(payload)

    def _parse(self, payload: Any) -> list[Passage]:
        if not isinstance(payload, dict):
            raise SearchError(f"MediaWiki API sent a malformed reply: {payload!r:.200}")
        if "error" in payload:
            raise SearchError(f"MediaWiki API error: {payload['error']!r:.300}")
        pages = (payload.get("query") or {}).get("pages", [])
        if isinstance(pages, dict):  # formatversion=1 shape
            pages = list(pages.values())
        try:
            ranked = sorted(pages, key=lambda page: page.get("index", 0))
            return [
                Passage(str(p["pageid"]), p["title"], (p.get("extract") or "")[: self.max_chars])
                for p in ranked
                if "missing" not in p
            ]
        except (AttributeError, KeyError, TypeError) as exc:
            raise SearchError(f"MediaWiki API sent unexpected pages: {exc!r}") from None

    def close(self) -> None:
        self._client.close()


def _lagged(response: httpx.Response) -> str | None:
    """MediaWiki answers `maxlag` overruns with HTTP 200 and an error body: retry those."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    if isinstance(error, dict) and error.get("code") == "maxlag":
        return f"replication lag: {error.get('info', '')}"
    return None
