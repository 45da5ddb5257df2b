"""Fault injection against real loopback servers: every bad reply a remote search backend can
get ends the step in a "Search failed" observation, within the documented time bound."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium
import pytest

from agent_gym.search import (
    BM25Index,
    RetrievalClient,
    RetrievalServer,
    RetryPolicy,
    SearchError,
    WikipediaBackend,
    bundled_corpus,
)
from tests.helpers.search_fakes import FakeMediaWiki, ScriptedServer

SLACK = 0.5  # thread wake-ups on a loaded machine, beyond the bound
QUERY = "copper crane"
SURROGATE_QUERY = "copper crane \ud800"  # a lone surrogate, as JSON's "\ud800" decodes


def search_call(query: str) -> str:
    # json.dumps escapes the surrogate as "\ud800", which is how a model's JSON carries one.
    payload = json.dumps({"name": "search", "arguments": {"query": query}})
    return f"<tool_call>{payload}</tool_call>"


def step_bound(timeout: float, max_retries: int) -> float:
    """The documented bound for the env's settings (`open_backend` uses backoff 0.5)."""
    return RetryPolicy(max_retries=max_retries, backoff=0.5).bound(timeout)


@pytest.fixture
def scripted() -> Iterator[ScriptedServer]:
    stub = ScriptedServer()
    yield stub
    stub.close()


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> BM25Index:
    return BM25Index.build(bundled_corpus(), tmp_path_factory.mktemp("faults") / "index")


def make_env(backend: str, url: str, **kwargs: Any) -> gymnasium.Env:
    if backend == "wikipedia":
        url = f"{url}/w/api.php"
    env = gymnasium.make("agent_gym/Search-v0", backend=backend, url=url, **kwargs)
    env.reset(seed=0)
    return env


BOTH = ["http", "wikipedia"]


@pytest.mark.parametrize("backend", BOTH)
@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("retry-after-nan", "HTTP 429"),
        ("bad-gzip", "could not be decoded"),
        ("deep-json", "nested too deeply"),
        ("drip", "no complete reply within 1 s"),
    ],
)
def test_a_bad_reply_is_a_search_failed_observation_within_the_bound(
    scripted: ScriptedServer, backend: str, fault: str, reason: str
) -> None:
    scripted.fallback = fault
    env = make_env(backend, scripted.url, cache="off", timeout=1.0, max_retries=1)
    start = time.monotonic()
    observation, reward, terminated, _, info = env.step(search_call(QUERY))
    elapsed = time.monotonic() - start
    assert observation.startswith("Search failed:") and reason in observation, observation
    assert reason in info["search_error"] and reward == 0.0 and not terminated
    assert elapsed <= step_bound(1.0, 1) + SLACK
    assert len(scripted.requests) <= 2  # one try and at most one retry
    env.close()


@pytest.mark.parametrize("backend", BOTH)
def test_a_dripping_server_cannot_hold_a_step_past_the_bound(
    scripted: ScriptedServer, backend: str
) -> None:
    """Headers at once, then a byte every 50 ms: each read beats the timeout, the step must not."""
    scripted.fallback = "drip"
    env = make_env(backend, scripted.url, cache="off", timeout=1.0, max_retries=0)
    start = time.monotonic()
    observation, *_ = env.step(search_call(QUERY))
    elapsed = time.monotonic() - start
    assert observation.startswith("Search failed:"), observation
    assert step_bound(1.0, 0) == 1.0 and 0.9 <= elapsed <= 1.0 + SLACK
    env.close()


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("wiki-query-list", "'query' must be an object"),
        ("wiki-pages-text", "'pages' must be a list"),
        ("wiki-title-number", "'title' must be a string"),
    ],
)
def test_a_mediawiki_reply_of_the_wrong_shape_is_a_search_failed_observation(
    scripted: ScriptedServer, fault: str, reason: str
) -> None:
    scripted.fallback = fault
    env = make_env("wikipedia", scripted.url, cache="off", timeout=1.0, max_retries=1)
    start = time.monotonic()
    observation, *_ = env.step(search_call(QUERY))
    assert time.monotonic() - start <= step_bound(1.0, 1) + SLACK
    assert observation.startswith("Search failed:") and reason in observation, observation
    assert len(scripted.requests) == 1  # a reply of the wrong shape is not retried
    env.close()


def test_the_bound_holds_for_the_backends_themselves(scripted: ScriptedServer) -> None:
    """Without the env: the client's own `bound` is the documented figure, and it holds."""
    policy = RetryPolicy(max_retries=1, backoff=0.01, max_backoff=0.5)
    scripted.fallback = "drip"
    for backend in (
        RetrievalClient(scripted.url, timeout=0.5, retry=policy),
        WikipediaBackend(f"{scripted.url}/w/api.php", timeout=0.5, retry=policy),
    ):
        assert backend.bound == 2 * 0.5 + 1 * 0.5
        start = time.monotonic()
        with pytest.raises(SearchError, match="failed after 2 attempts"):
            backend.search([QUERY], 3)
        assert time.monotonic() - start <= backend.bound + SLACK
        backend.close()


@pytest.mark.parametrize("cache", ["off", "sqlite"])
def test_a_lone_surrogate_in_a_query_is_searched_over_http(
    index: BM25Index, tmp_path: Path, cache: str
) -> None:
    """The BM25 backend copes with it; JSON can carry it ("\\ud800"); so must the client and
    the SQLite cache, which replays it on restore once the server is gone."""
    setting = str(tmp_path / "cache.sqlite") if cache == "sqlite" else "off"
    with RetrievalServer(index) as server:
        env = make_env("http", server.url, cache=setting, timeout=2.0, max_retries=0)
        observation, _, _, _, info = env.step(search_call(SURROGATE_QUERY))
        assert observation.startswith("Doc 1"), observation
        assert info["query"] == SURROGATE_QUERY
        state = env.unwrapped.save_state()
        env.close()
        url = server.url
    if cache == "sqlite":
        branch = gymnasium.make("agent_gym/Search-v0", backend="http", url=url, cache=setting,
                                timeout=2.0, max_retries=0)
        restored, _ = branch.reset(options={"state": state})
        assert restored == observation
        branch.close()


def test_a_lone_surrogate_cannot_reach_mediawiki_and_says_why() -> None:
    wiki = FakeMediaWiki()
    try:
        env = make_env("wikipedia", wiki.url, cache="off", timeout=1.0, max_retries=0)
        observation, *_ = env.step(search_call(SURROGATE_QUERY))
        assert observation.startswith("Search failed:") and "lone surrogate" in observation
        assert wiki.requests == []
        env.close()
    finally:
        wiki.close()
