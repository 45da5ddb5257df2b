"""HTTP plumbing shared by the remote backends: bounded retries with backoff, a rate limiter.

Rollouts hit a retrieval service from many workers at once; a server that sheds load (429),
restarts (connection refused, 5xx) or stalls (timeouts) must cost a bounded number of
attempts and then surface as one `SearchError`, never as an unbounded loop or a crash.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from agent_gym.search.passages import SearchError

RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    """At most `max_retries` retries after the first attempt, sleeping an exponentially
    growing, jittered delay (or the server's `Retry-After`, capped) between them."""

    max_retries: int = 3
    backoff: float = 0.5
    max_backoff: float = 8.0

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.backoff < 0 or self.max_backoff < 0:
            raise ValueError(f"retry settings must be non-negative: {self}")

    def delay(self, retry: int, retry_after: float | None = None) -> float:
        """Seconds to wait before retry number `retry` (0-based)."""
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.max_backoff)
        ceiling = min(self.backoff * 2**retry, self.max_backoff)
        return ceiling * random.uniform(0.5, 1.0)


def _retry_after(response: httpx.Response) -> float | None:
    """`Retry-After` in seconds when given as a number (the HTTP-date form is ignored)."""
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None


def send_with_retries(
    client: httpx.Client,
    method: str,
    url: str,
    policy: RetryPolicy,
    what: str,
    *,
    transient: Callable[[httpx.Response], str | None] | None = None,
    **kwargs: Any,
) -> httpx.Response:
    """Send a request, retrying transport errors and retryable statuses; return a 2xx response.

    `transient` may flag a 2xx reply as a retryable failure (MediaWiki reports replication lag
    in the body). Raises `SearchError` naming `what`, the attempts and the last failure.
    """
    attempts = policy.max_retries + 1
    for attempt in range(attempts):
        retry_after = None
        try:
            response = client.request(method, url, **kwargs)
        except httpx.TransportError as exc:
            failure = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        else:
            retry_after = _retry_after(response)
            if response.is_success:
                failure = transient(response) if transient is not None else None
                if failure is None:
                    return response
            else:
                failure = f"HTTP {response.status_code}: {response.text[:200]!r}"
                if response.status_code not in RETRYABLE_STATUS:
                    raise SearchError(f"{what} rejected the request ({failure})")
        if attempt + 1 < attempts:
            time.sleep(policy.delay(attempt, retry_after))
    raise SearchError(f"{what} failed after {attempts} attempts; last error: {failure}")


class TokenBucket:
    """Allow `rate` acquisitions per second on average with bursts up to `burst` (thread-safe).

    Public APIs such as Wikipedia's ask clients to stay under a request rate; the bucket
    paces requests on the client side instead of waiting to be throttled.
    """

    def __init__(self, rate: float, burst: int = 1) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"need rate > 0 and burst >= 1, got rate={rate}, burst={burst}")
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    def acquire(self) -> float:
        """Take one token, sleeping until one is available; returns the seconds waited."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= 1.0
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)
        return wait
