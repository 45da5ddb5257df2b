"""The retrieval server and its HTTP client on loopback, with injected faults, and the
Wikipedia backend against a fake MediaWiki API."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from agent_gym.search import (
    BM25Index,
    Passage,
    RetrievalClient,
    RetrievalServer,
    RetryPolicy,
    SearchError,
    WikipediaBackend,
    bundled_corpus,
)
from agent_gym.search.net import TokenBucket
from tests.helpers.search_fakes import FakeMediaWiki, FaultProxy, refused_url

FAST = RetryPolicy(max_retries=2, backoff=0.01, max_backoff=0.05)
QUERIES = ["inventor of the copper crane", "capital of Vellmark", "Zennhaven twinned"]


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> BM25Index:
    return BM25Index.build(bundled_corpus(), tmp_path_factory.mktemp("http") / "index")


@pytest.fixture(scope="module")
def server(index: BM25Index) -> Iterator[RetrievalServer]:
    with RetrievalServer(index) as running:
        yield running


@pytest.fixture
def proxy(server: RetrievalServer) -> Iterator[FaultProxy]:
    stub = FaultProxy(server.url, slow_seconds=0.5)
    yield stub
    stub.close()


def test_client_through_server_equals_in_process(index: BM25Index, server: RetrievalServer) -> None:
    client = RetrievalClient(server.url, retry=FAST)
    assert client.search(QUERIES, 3) == index.search(QUERIES, 3)
    assert client.search([], 3) == []
    health = httpx.get(f"{server.url}/health").json()
    assert health == {"status": "ok", "backend": index.name}
    client.close()


def test_server_speaks_search_r1_wire_format(server: RetrievalServer) -> None:
    reply = httpx.post(f"{server.url}/retrieve",
                       json={"queries": ["copper crane"], "topk": 2, "return_scores": True})
    hits = reply.json()["result"][0]
    assert len(hits) == 2 and set(hits[0]) == {"document", "score"}
    assert hits[0]["document"]["contents"].startswith('"The copper crane"\n')
    bare = httpx.post(f"{server.url}/retrieve",
                      json={"queries": ["copper crane"], "topk": 1, "return_scores": False})
    assert set(bare.json()["result"][0][0]) == {"id", "contents"}
    default = httpx.post(f"{server.url}/retrieve", json={"queries": ["copper crane"]})
    assert len(default.json()["result"][0]) == 3  # the server's default topk


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not JSON"),
        (b'["a"]', "JSON object"),
        (b'{"queries": "one string", "topk": 3}', "list of strings"),
        (b'{"queries": ["a"], "topk": 0}', "topk"),
        (b'{"queries": ["a"], "topk": true}', "topk"),
        (b"[" * 100_000 + b"]" * 100_000, "nested deeper"),  # used to drop the connection
        (b'{"queries": ["a"], "topk": NaN}', "non-finite"),
    ],
)
def test_server_rejects_bad_requests_clearly(
    server: RetrievalServer, body: bytes, message: str
) -> None:
    reply = httpx.post(f"{server.url}/retrieve", content=body)
    assert reply.status_code == 400 and message in reply.json()["error"]
    assert httpx.post(f"{server.url}/nope", content=b"{}").status_code == 404
    assert httpx.get(f"{server.url}/nope").status_code == 404


def test_lone_surrogates_cross_the_wire_both_ways() -> None:
    """JSON tool calls decode "\\ud800" to a lone surrogate, and live backends' JSON can hold
    one too; UTF-8 cannot, so both directions fall back to JSON's escapes."""

    class Echo:
        name = "echo"

        def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
            return [[Passage("1", f"T {q}", f"text {q}")] for q in queries]

        def close(self) -> None:
            pass

    with RetrievalServer(Echo()) as echo:
        client = RetrievalClient(echo.url, retry=FAST)
        assert client.search(["a \ud800", "b"], 1) == [
            [Passage("1", "T a \ud800", "text a \ud800")], [Passage("1", "T b", "text b")]]
        client.close()


def test_client_rejects_bad_requests_without_retrying(server: RetrievalServer) -> None:
    client = RetrievalClient(server.url, retry=FAST)
    with pytest.raises(ValueError, match="topk"):
        client.search(["x"], 0)
    client.max_batch = 10_000  # let the server refuse an oversized batch: a 400, not retried
    with pytest.raises(SearchError, match=r"rejected the request.*HTTP 400"):
        client.search(["x"] * 2000, 1)


def test_many_threads_share_one_client_and_server(index: BM25Index, server: RetrievalServer) -> None:
    client = RetrievalClient(server.url, retry=FAST, max_connections=8)
    queries = [f"who invented the {m} {d}" for m in ("tide", "salt", "wind", "copper")
               for d in ("clock", "loom", "press", "pump")]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda q: client.search([q], 3)[0], queries))
    assert got == index.search(queries, 3)
    client.close()


@pytest.mark.parametrize("faults", [["429"], ["500"], ["429", "500"], ["slow"]])
def test_transient_faults_are_retried(
    index: BM25Index, proxy: FaultProxy, faults: list[str]
) -> None:
    proxy.faults.extend(faults)
    client = RetrievalClient(proxy.url, timeout=0.25, retry=FAST)
    assert client.search(QUERIES, 3) == index.search(QUERIES, 3)
    assert len(proxy.requests) == len(faults) + 1
    client.close()


@pytest.mark.parametrize("fault", ["429", "500", "slow"])
def test_persistent_faults_give_up_after_bounded_retries(proxy: FaultProxy, fault: str) -> None:
    proxy.fallback = fault
    client = RetrievalClient(proxy.url, timeout=0.2, retry=FAST)
    start = time.monotonic()
    with pytest.raises(SearchError, match="failed after 3 attempts"):
        client.search(QUERIES, 3)
    assert len(proxy.requests) == 3  # one try + max_retries, never more
    assert time.monotonic() - start < 3.0
    client.close()


@pytest.mark.parametrize("fault", ["malformed", "wrong-shape"])
def test_malformed_replies_fail_at_once(proxy: FaultProxy, fault: str) -> None:
    proxy.fallback = fault
    client = RetrievalClient(proxy.url, retry=FAST)
    with pytest.raises(SearchError, match="malformed reply"):
        client.search(QUERIES, 3)
    assert len(proxy.requests) == 1  # a broken server does not heal by asking again
    client.close()


def test_connection_refused_gives_up_quickly() -> None:
    client = RetrievalClient(refused_url(), timeout=1.0, retry=FAST)
    start = time.monotonic()
    with pytest.raises(SearchError, match=r"failed after 3 attempts.*Connect"):
        client.search(["x"], 1)
    assert time.monotonic() - start < 2.0


def test_retry_policy_bounds_and_honours_retry_after() -> None:
    policy = RetryPolicy(max_retries=5, backoff=0.5, max_backoff=4.0)
    assert 0.25 <= policy.delay(0) <= 0.5
    assert all(policy.delay(n) <= 4.0 for n in range(20))
    assert policy.delay(0, retry_after=100.0) == 4.0 and policy.delay(3, retry_after=1.5) == 1.5
    with pytest.raises(ValueError):
        RetryPolicy(max_retries=-1)


def test_token_bucket_paces_calls() -> None:
    bucket = TokenBucket(rate=50.0, burst=2)
    waits = [bucket.reserve() for _ in range(7)]  # taken at once: 2 free, then 5 paced at 50/s
    assert waits[:2] == [0.0, 0.0]
    assert all(0.0 < w < v for w, v in itertools.pairwise(waits[2:]))
    assert 0.9 * 5 / 50.0 <= waits[-1] <= 5 / 50.0
    with pytest.raises(ValueError):
        TokenBucket(rate=0)


@pytest.fixture
def wiki() -> Iterator[FakeMediaWiki]:
    stub = FakeMediaWiki()
    yield stub
    stub.close()


def test_wikipedia_backend_parses_and_orders_pages(wiki: FakeMediaWiki) -> None:
    backend = WikipediaBackend(f"{wiki.url}/w/api.php", rate=100.0, retry=FAST)
    first, none, blank = backend.search(["Orvane river Grey Sea", "xylophone", "  "], 2)
    assert [p.title for p in first] == ["Orvane", "Zennhaven"]
    assert first[0].id == "101" and "Grey Sea" in first[0].text
    assert none == [] and blank == []
    assert len(wiki.params) == 2  # the blank query never left the process
    params = wiki.params[0]
    assert params["generator"] == "search" and params["prop"] == "extracts"
    assert params["gsrsearch"] == "Orvane river Grey Sea" and params["gsrlimit"] == "2"
    assert wiki.agents[0].startswith("agent-gym/")
    backend.close()


def test_wikipedia_retries_throttling_and_lag_then_gives_up(wiki: FakeMediaWiki) -> None:
    backend = WikipediaBackend(f"{wiki.url}/w/api.php", rate=100.0, retry=FAST)
    wiki.faults.extend(["429", "maxlag"])
    assert backend.search(["Zennhaven glassmaking"], 1)[0][0].title == "Zennhaven"
    assert len(wiki.requests) == 3
    wiki.fallback = "503"
    with pytest.raises(SearchError, match="failed after 3 attempts"):
        backend.search(["Zennhaven"], 1)
    assert len(wiki.requests) == 6
    wiki.fallback = "malformed"
    with pytest.raises(SearchError, match="malformed"):
        backend.search(["Zennhaven"], 1)
    backend.close()


def test_wikipedia_is_rate_limited(wiki: FakeMediaWiki) -> None:
    backend = WikipediaBackend(f"{wiki.url}/w/api.php", rate=20.0, burst=1, retry=FAST)
    backend.search(["Orvane", "Zennhaven", "glass", "river", "town"], 1)
    # Arrival times at the server jitter under load; their span cannot beat the pacing.
    assert len(wiki.requests) == 5
    assert wiki.requests[-1] - wiki.requests[0] >= 0.8 * 4 / 20.0
    backend.close()


def test_server_can_share_a_live_backend(wiki: FakeMediaWiki) -> None:
    """Serving Wikipedia from one process gives all workers one rate limit and one cache."""
    backend = WikipediaBackend(f"{wiki.url}/w/api.php", rate=100.0, retry=FAST)
    with RetrievalServer(backend) as shared:
        client = RetrievalClient(shared.url, retry=FAST)
        assert client.search(["Orvane"], 1)[0][0].title == "Orvane"
        wiki.fallback = "503"
        with pytest.raises(SearchError, match=r"failed after 3 attempts.*HTTP 502"):
            client.search(["Orvane"], 1)
        client.close()
    assert len(wiki.requests) == 1 + 3 * 3  # each client attempt: one upstream try + 2 retries
