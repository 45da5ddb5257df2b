"""Client of Search-R1's retrieval server protocol (`POST /retrieve`), served by
`agent-gym search serve` or by Search-R1's own `retrieval_server.py`.

Request: `{"queries": [str], "topk": int, "return_scores": true}`;
reply: `{"result": [[{"document": {"id", "contents"}, "score"}]]}`, one list per query.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from agent_gym.search.net import RetryPolicy, send_with_retries
from agent_gym.search.passages import Passage, SearchError, check_batch


class RetrievalClient:
    """A pooled, retrying HTTP client; one instance per process is enough (it is thread-safe)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 10.0,
        retry: RetryPolicy | None = None,
        max_connections: int = 16,
        max_batch: int = 256,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"retrieval server URL must start with http:// or https://: {url!r}")
        self.url = url.rstrip("/")
        self.name = f"http:{self.url}"
        self.retry = retry or RetryPolicy()
        self.max_batch = max_batch
        self._client = httpx.Client(
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
        )

    def search(self, queries: Sequence[str], topk: int) -> list[list[Passage]]:
        """One POST per `max_batch` queries; raises `SearchError` once retries are exhausted."""
        check_batch(queries, topk)
        results: list[list[Passage]] = []
        for start in range(0, len(queries), self.max_batch):
            results.extend(self._post(list(queries[start : start + self.max_batch]), topk))
        return results

    def _post(self, queries: list[str], topk: int) -> list[list[Passage]]:
        response = send_with_retries(
            self._client, "POST", f"{self.url}/retrieve", self.retry,
            f"retrieval server {self.url}",
            json={"queries": queries, "topk": topk, "return_scores": True},
        )
        try:
            return _parse_result(response.json(), len(queries))
        except ValueError as exc:
            raise SearchError(f"retrieval server {self.url} sent a bad reply: {exc}") from None

    def close(self) -> None:
        self._client.close()


def _parse_result(payload: Any, expected: int) -> list[list[Passage]]:
    """Validate the reply shape; ValueError (JSONDecodeError included) on anything unexpected."""
    result = payload.get("result") if isinstance(payload, dict) else None
    if not isinstance(result, list) or len(result) != expected:
        raise ValueError(f"expected {{'result': [...]}} with {expected} lists: {payload!r:.200}")
    if not all(isinstance(hits, list) for hits in result):
        raise ValueError("each entry of 'result' must be a list of hits")
    return [[Passage.from_wire(hit) for hit in hits] for hits in result]
