"""Live Wikipedia search through the MediaWiki Action API, rate-limited and retried.

One request per query: `generator=search` ranks pages and `prop=extracts` returns their
plain-text introductions, so a hit carries the page title and its lead section. Results
change as Wikipedia is edited; wrap the backend in a `CachedBackend` with a persistent cache
to make episodes replayable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agent_gym.search.net import BoundedClient, RetryPolicy, TokenBucket
from agent_gym.search.passages import Passage, SearchError, check_batch

DEFAULT_API = "https://en.wikipedia.org/w/api.php"
USER_AGENT = "agent-gym/0.1 (https://pypi.org/project/agent-gym/; retrieval QA environments)"
MAX_EXTRACTS = 20  # TextExtracts returns at most 20 intro extracts per request


class WikipediaBackend:
    """`search` paces requests with a token bucket shared by all threads of this instance.

    Each query returns or raises `SearchError` within `bound` seconds, the wait for a
    rate-limit slot included (see `agent_gym.search.net`).
    """

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
        self.max_chars = max_chars
        self._bucket = TokenBucket(rate, burst)
        self._http = BoundedClient(
            f"MediaWiki API {api_url}", timeout=timeout,
            retry=retry or RetryPolicy(max_retries=3, backoff=1.0, max_backoff=30.0),
            headers={"user-agent": user_agent},
        )
        self.bound = self._http.bound

    def search(self, queries: Sequence[str], topk: int) -> list[list[Passage]]:
        check_batch(queries, topk)
        return [self._search_one(q, min(topk, MAX_EXTRACTS)) if q.strip() else [] for q in queries]

    def _search_one(self, query: str, topk: int) -> list[Passage]:
        try:
            query.encode("utf-8")
        except UnicodeEncodeError as exc:  # the URL carries UTF-8, which has no such character
            raise SearchError(
                f"the query cannot be sent to the MediaWiki API: it holds a lone surrogate "
                f"({exc.object[exc.start : exc.end]!r}), which has no UTF-8 form"
            ) from None
        params = {
            "action": "query", "format": "json", "formatversion": "2", "redirects": "1",
            "generator": "search", "gsrsearch": query, "gsrlimit": str(topk),
            "gsrnamespace": "0", "prop": "extracts", "exintro": "1", "explaintext": "1",
            "exlimit": str(topk), "maxlag": "5",
        }
        payload = self._http.fetch_json(
            "GET", self.api_url, transient=_lagged, pace=self._bucket.reserve, params=params,
        )
        return self._parse(payload)

    def _parse(self, payload: Any) -> list[Passage]:
        """Check the reply's shape field by field: any other shape is a `SearchError` that
        names the field (errors name types; a repr of a deeply nested reply overflows)."""
        if not isinstance(payload, dict):
            raise _malformed(f"the reply must be an object, got {type(payload).__name__}")
        if "error" in payload:
            raise SearchError(f"MediaWiki API error: {_error_text(payload['error'])}")
        query = payload.get("query") or {}  # absent, or PHP's empty array: no results
        if not isinstance(query, dict):
            raise _malformed(f"'query' must be an object, got {type(query).__name__}")
        pages = query.get("pages") or []
        if isinstance(pages, dict):  # formatversion=1 shape
            pages = list(pages.values())
        if not isinstance(pages, list):
            raise _malformed(f"'pages' must be a list, got {type(pages).__name__}")
        ranked: list[tuple[int, Passage]] = []
        for page in pages:
            if not isinstance(page, dict):
                raise _malformed(f"a page must be an object, got {type(page).__name__}")
            if "missing" in page:
                continue
            pid, title = page.get("pageid"), page.get("title")
            extract, index = page.get("extract") or "", page.get("index", 0)
            for field, value, kinds in (("pageid", pid, int), ("title", title, str),
                                        ("extract", extract, str), ("index", index, int)):
                if isinstance(value, bool) or not isinstance(value, kinds):
                    raise _malformed(f"a page's {field!r} must be {_KIND_NAMES[kinds]}, "
                                     f"got {type(value).__name__}")
            ranked.append((index, Passage(str(pid), title, extract[: self.max_chars])))
        ranked.sort(key=lambda entry: entry[0])
        return [passage for _, passage in ranked]

    def close(self) -> None:
        self._http.close()


_KIND_NAMES = {int: "an integer", str: "a string"}


def _malformed(detail: str) -> SearchError:
    return SearchError(f"MediaWiki API sent a malformed reply: {detail}")


def _error_text(error: Any) -> str:
    """MediaWiki's ``{"code", "info"}`` error as text, without repr of arbitrary JSON."""
    if isinstance(error, dict):
        parts = [error.get("code"), error.get("info")]
        return ": ".join(p for p in parts if isinstance(p, str))[:300] or "(no details)"
    return error[:300] if isinstance(error, str) else f"(a {type(error).__name__})"


def _lagged(payload: Any) -> str | None:
    """MediaWiki answers `maxlag` overruns with HTTP 200 and an error body: retry those."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict) and error.get("code") == "maxlag":
        return f"replication lag: {_error_text(error)}"
    return None
