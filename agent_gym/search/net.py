"""HTTP plumbing shared by the remote backends: a hard time bound on every request, bounded
retries with backoff, a rate limiter.

Rollouts hit a retrieval service from many workers at once; a server that sheds load (429),
restarts (connection refused, 5xx), stalls, drips its reply or sends garbage must cost a
bounded time and then surface as one `SearchError`, never as a hang or a crash.

**The bound.** One request of a remote backend (an env step sends one) returns or raises
`SearchError` within ``RetryPolicy.bound(timeout) = (max_retries + 1) * timeout +
max_retries * max_backoff`` seconds: each attempt -- connect, send, headers and the whole
body -- is cut at ``timeout`` seconds of wall-clock time, each wait between attempts is at
most ``max_backoff``, and the whole request, rate-limit wait included, runs under one
deadline of that bound. httpx's own timeouts apply to each socket operation, so a server
that sends its headers and then a byte at a time held one step for 12 s with ``timeout=1``;
here the deadlines are enforced by cancellation instead. Requests therefore run on httpx's
async client, on one event-loop thread per process (`BoundedClient`): a deadline cancels an
attempt wherever it is blocked and closes its connection, while the synchronous
``search()`` caller waits for the outcome -- and stops waiting one second past the bound
even if that loop is stalled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from agent_gym.search.passages import SearchError

RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_LOOP_GRACE = 1.0  # seconds the caller waits beyond the bound for the I/O loop to report


@dataclass(frozen=True)
class RetryPolicy:
    """At most `max_retries` retries after the first attempt, sleeping an exponentially
    growing, jittered delay (or the server's `Retry-After`, capped) between them."""

    max_retries: int = 3
    backoff: float = 0.5
    max_backoff: float = 8.0

    def __post_init__(self) -> None:
        values = (self.max_retries, self.backoff, self.max_backoff)
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"retry settings must be finite and non-negative: {self}")

    def delay(self, retry: int, retry_after: float | None = None) -> float:
        """Seconds to wait before retry number `retry` (0-based); never more than `max_backoff`."""
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.max_backoff)
        ceiling = min(self.backoff * 2**retry, self.max_backoff)
        return ceiling * random.uniform(0.5, 1.0)

    def bound(self, timeout: float) -> float:
        """The most one request may take when each attempt is cut at `timeout` seconds."""
        return (self.max_retries + 1) * timeout + self.max_retries * self.max_backoff


def _retry_after(response: httpx.Response) -> float | None:
    """`Retry-After` in seconds when given as a finite, non-negative number.

    The HTTP-date form is ignored, and so are "nan" and "inf", which ``float`` accepts:
    ``time.sleep(nan)`` raised out of the step.
    """
    try:
        seconds = float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


# ---------------------------------------------------------------- the I/O event loop
_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _io_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for search requests, started on first use."""
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="agent-gym-search-io",
                             daemon=True).start()
            _loop = loop
        return _loop


def _forget_loop() -> None:
    # Threads do not survive fork: a child (a vector-env worker) starts its own loop.
    global _loop, _loop_lock
    _loop, _loop_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_loop)


class BoundedClient:
    """A thread-safe client of one service whose every request ends within `bound` seconds.

    `what` names the service in every error, e.g. ``"retrieval server http://host:8001"``.
    """

    def __init__(
        self,
        what: str,
        *,
        timeout: float,
        retry: RetryPolicy,
        headers: Mapping[str, str] | None = None,
        max_connections: int = 16,
    ) -> None:
        if not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.what = what
        self.timeout = timeout
        self.retry = retry
        self.bound = retry.bound(timeout)
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
            headers=dict(headers or {}),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
        )

    def fetch_json(
        self,
        method: str,
        url: str,
        *,
        transient: Callable[[Any], str | None] | None = None,
        pace: Callable[[], float] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Send a request and return the decoded JSON of its 2xx reply.

        Transport errors, cut attempts and retryable statuses are retried; `transient` may
        flag a decoded 2xx reply as retryable too (MediaWiki reports replication lag in the
        body) by returning why. `pace` returns how long to wait for a rate-limit slot before
        the first attempt. A reply that cannot be decoded, is not JSON or is nested too
        deeply is not retried: a broken server does not heal by asking again. Raises
        `SearchError` naming the service, the attempts and the last failure.
        """
        future = asyncio.run_coroutine_threadsafe(
            self._fetch(method, url, transient, pace, kwargs), _io_loop()
        )
        try:  # the loop enforces the bound; this wait holds even if the loop cannot run
            return future.result(timeout=self.bound + _LOOP_GRACE)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise SearchError(
                f"{self.what} gave no answer within the bound of {self.bound:g} s"
            ) from None

    async def _fetch(
        self,
        method: str,
        url: str,
        transient: Callable[[Any], str | None] | None,
        pace: Callable[[], float] | None,
        kwargs: dict[str, Any],
    ) -> Any:
        try:
            async with asyncio.timeout(self.bound):
                if pace is not None:
                    await asyncio.sleep(pace())
                return await self._attempts(method, url, transient, kwargs)
        except TimeoutError:
            raise SearchError(
                f"{self.what} gave no answer within the bound of {self.bound:g} s"
            ) from None

    async def _attempts(
        self,
        method: str,
        url: str,
        transient: Callable[[Any], str | None] | None,
        kwargs: dict[str, Any],
    ) -> Any:
        attempts = self.retry.max_retries + 1
        for attempt in range(attempts):
            retry_after = None
            try:
                async with asyncio.timeout(self.timeout):
                    response = await self._client.request(method, url, **kwargs)
            except TimeoutError:
                failure = f"no complete reply within {self.timeout:g} s"
            except httpx.TransportError as exc:
                failure = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            except httpx.HTTPError as exc:  # DecodingError: a broken gzip body, say
                raise SearchError(
                    f"{self.what} sent a reply that could not be decoded "
                    f"({type(exc).__name__}: {exc})"
                ) from None
            else:
                retry_after = _retry_after(response)
                if response.is_success:
                    payload = self._decode(response)
                    failure = transient(payload) if transient is not None else None
                    if failure is None:
                        return payload
                else:
                    failure = f"HTTP {response.status_code}: {response.text[:200]!r}"
                    if response.status_code not in RETRYABLE_STATUS:
                        raise SearchError(f"{self.what} rejected the request ({failure})")
            if attempt + 1 < attempts:
                await asyncio.sleep(self.retry.delay(attempt, retry_after))
        raise SearchError(f"{self.what} failed after {attempts} attempts; last error: {failure}")

    def _decode(self, response: httpx.Response) -> Any:
        try:
            return response.json()
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            raise SearchError(f"{self.what} sent a malformed reply: not JSON ({exc})") from None
        except RecursionError:
            raise SearchError(
                f"{self.what} sent a malformed reply: JSON nested too deeply to read"
            ) from None

    def close(self) -> None:
        closing = asyncio.run_coroutine_threadsafe(self._client.aclose(), _io_loop())
        with contextlib.suppress(concurrent.futures.TimeoutError):  # never hang an exit
            closing.result(timeout=_LOOP_GRACE)


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

    def reserve(self) -> float:
        """Take one token; returns the seconds the caller must wait before using it.

        The caller does the waiting, so that it can wait under its own deadline.
        """
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= 1.0
            return -self._tokens / self.rate if self._tokens < 0 else 0.0
