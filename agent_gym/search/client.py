"""Client of Search-R1's retrieval server protocol (`POST /retrieve`), served by
`agent-gym search serve` or by Search-R1's own `retrieval_server.py`.

Request: `{"queries": [str], "topk": int, "return_scores": true}`;
reply: `{"result": [[{"document": {"id", "contents"}, "score"}]]}`, one list per query.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agent_gym.search.net import BoundedClient, RetryPolicy
from agent_gym.search.passages import Passage, SearchError, check_batch


class RetrievalClient:
    """A pooled, retrying HTTP client; one instance per process is enough (it is thread-safe).

    Each POST returns or raises `SearchError` within `bound` seconds (see
    `agent_gym.search.net`). Queries travel as ASCII JSON, where a lone surrogate such as
    ``\\ud800`` (which JSON tool calls can carry) is an escape rather than unencodable UTF-8.
    """

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
        self.max_batch = max_batch
        self._http = BoundedClient(f"retrieval server {self.url}", timeout=timeout,
                                   retry=retry or RetryPolicy(), max_connections=max_connections)
        self.bound = self._http.bound

    def search(self, queries: Sequence[str], topk: int) -> list[list[Passage]]:
        """One POST per `max_batch` queries; raises `SearchError` once retries are exhausted."""
        check_batch(queries, topk)
        results: list[list[Passage]] = []
        for start in range(0, len(queries), self.max_batch):
            results.extend(self._post(list(queries[start : start + self.max_batch]), topk))
        return results

    def _post(self, queries: list[str], topk: int) -> list[list[Passage]]:
        body = json.dumps({"queries": queries, "topk": topk, "return_scores": True})
        payload = self._http.fetch_json(
            "POST", f"{self.url}/retrieve", content=body.encode("ascii"),
            headers={"content-type": "application/json"},
        )
        try:
            return _parse_result(payload, len(queries))
        except ValueError as exc:
            raise SearchError(f"{self._http.what} sent a malformed reply: {exc}") from None

    def close(self) -> None:
        self._http.close()


def _parse_result(payload: Any, expected: int) -> list[list[Passage]]:
    """Validate the decoded reply's shape; ValueError on anything unexpected.

    Errors describe the reply rather than quote it: repr of a deeply nested one overflows.
    """
    result = payload.get("result") if isinstance(payload, dict) else None
    if not isinstance(result, list) or len(result) != expected:
        if isinstance(result, list):
            got = f"{len(result)}"
        elif isinstance(payload, dict):
            got = "no 'result' list"
        else:
            got = f"a JSON {type(payload).__name__}"
        raise ValueError(f"expected {{'result': [...]}} with {expected} lists, got {got}")
    if not all(isinstance(hits, list) for hits in result):
        raise ValueError("each entry of 'result' must be a list of hits")
    return [[Passage.from_wire(hit) for hit in hits] for hits in result]
