"""``agent-gym eval`` against OpenAI-compatible servers as they really answer: loopback
doubles of llama-cpp-python's quirks and of a server that enforces a context limit."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agent_gym.cli.main import main
from agent_gym.eval.config import EvalConfig
from agent_gym.eval.policies import (
    ERROR_TEXT_LIMIT,
    ContextLengthError,
    OpenAIChatPolicy,
    PolicyError,
    PolicyInput,
    make_policy,
    says_context_length,
)
from agent_gym.eval.run import evaluate
from tests.helpers.openai_server import (
    CONTEXT_ERRORS,
    NULL_CONTENT_ERRORS,
    Behaviour,
    ChatServer,
    prompt_tokens,
)

ALFWORLD = "agent_gym/ALFWorld-v0"
SEARCH = "agent_gym/Search-v0"
GSM8K = "agent_gym/GSM8K-v0"


def _episodes(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]


def _search_then_answer(body: dict[str, Any]) -> dict[str, Any]:
    """A model that searches once, then answers with whatever the tool showed it."""
    if not any(m["role"] in ("tool", "user") and "search" in str(m.get("content"))
               for m in body["messages"][2:]) and len(body["messages"]) <= 2:
        call = {"id": "c1", "type": "function",
                "function": {"name": "search", "arguments": json.dumps({"query": "x"})}}
        return {"content": None, "tool_calls": [call]}
    return {"content": "<answer>unknown</answer>"}


def test_llama_cpp_server_gets_tool_choice_and_empty_content(tmp_path: Path) -> None:
    behaviour = Behaviour(reply=_search_then_answer, llama_cpp=True)
    with ChatServer(behaviour) as server:
        policy = OpenAIChatPolicy("m", server.url, backoff=0.0)
        config = EvalConfig(SEARCH, "openai:m", episodes=2, env_kwargs={"max_turns": 3})
        summary = asyncio.run(evaluate(config, policy, tmp_path, concurrency=1, progress=False))
    assert summary.errors == 0 and summary.episodes == 2, summary.first_error
    first, second = behaviour.requests[:2]
    assert first["tool_choice"] == "auto" and first["tools"]
    after_call = second["messages"][2]
    assert after_call["tool_calls"] and after_call["content"] == ""  # not null: no HTTP 500
    record = _episodes(tmp_path)[0]
    assert [r["finish_reason"] for r in record["replies"]] == ["tool_calls", "stop"]
    assert [r["tool_calls"] for r in record["replies"]] == [1, 0]
    assert summary.finish_reasons == {"stop": 2, "tool_calls": 2}
    assert summary.reply_latency_p50 is not None and summary.reply_latency_p95 is not None
    assert summary.notes == []
    # The server dropped the tool's content: only #text shows the model the results.
    assert behaviour.seen[1][3] == {"role": "tool", "tool_call_id": "call_2", "content": ""}


def test_a_server_that_ignores_tools_is_named_in_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    behaviour = Behaviour(reply=lambda body: {"content": "<answer>no idea</answer>"},
                          llama_cpp=True)
    with ChatServer(behaviour) as server:
        code = main(["eval", SEARCH, "--policy", f"openai:m@{server.url}", "--episodes", "2",
                     "--quiet", "--out", str(tmp_path / "native")])
        assert code == 0
        err = capsys.readouterr().err
        assert "none carried tool_calls" in err and f"openai:m@{server.url}#text" in err
        summary = json.loads((tmp_path / "native" / "summary.json").read_text())
        assert "#text" in summary["notes"][0]
        # With #text the tools are described in the prompt and tool output arrives as a
        # user message, which this server keeps.
        behaviour.reply = _search_then_answer_text
        behaviour.seen.clear()
        assert main(["eval", SEARCH, "--policy", f"openai:m@{server.url}#text", "--episodes",
                     "1", "--quiet", "--out", str(tmp_path / "text")]) == 0
        assert "none carried" not in capsys.readouterr().err
    shown = behaviour.seen[1][-1]
    tool_output = _episodes(tmp_path / "text")[0]["transcript"][3]
    assert tool_output["role"] == "tool" and "searches left" in tool_output["content"]
    assert shown == {"role": "user",
                     "content": f"<tool_response>\n{tool_output['content']}\n</tool_response>"}


def _search_then_answer_text(body: dict[str, Any]) -> dict[str, Any]:
    if len(body["messages"]) <= 2:
        return {"content": '<tool_call>{"name": "search", "arguments": {"query": "x"}}'
                           "</tool_call>"}
    return {"content": "<answer>unknown</answer>"}


@pytest.mark.parametrize("style", sorted(NULL_CONTENT_ERRORS))
def test_null_content_and_validation_errors_are_not_retried(tmp_path: Path, style: str) -> None:
    observation = PolicyInput([{"role": "user", "content": None}], [], 0)
    with ChatServer(Behaviour(llama_cpp=True, null_style=style)) as server:
        policy = OpenAIChatPolicy("m", server.url, backoff=0.0, max_retries=3)
        cause = NULL_CONTENT_ERRORS[style]["error"]["message"]
        with pytest.raises(PolicyError, match=r"^HTTP 500: .*" + re.escape(json.dumps(cause))):
            asyncio.run(policy.act(observation))
        assert len(server.behaviour.requests) == 1  # the same request would fail the same way
    # A 4xx is not retried, and the recorded error keeps ~2 KB of the server's text: enough
    # to show a cause that comes after a long preamble.
    cause = "x" * 1500 + " field 'messages.3.content' must be a string"
    behaviour = Behaviour(failures=[400], failure_body=cause + "y" * 3000)
    with ChatServer(behaviour) as server:
        policy = OpenAIChatPolicy("m", server.url, backoff=0.0)
        config = EvalConfig(GSM8K, "openai:m", episodes=1)
        summary = asyncio.run(evaluate(config, policy, tmp_path, progress=False))
    assert len(behaviour.requests) == 1 and summary.errors == 1
    recorded = json.loads((tmp_path / "errors.jsonl").read_text())["error"]
    assert cause in recorded and len(recorded) < ERROR_TEXT_LIMIT + 100


@pytest.mark.parametrize("style", sorted(CONTEXT_ERRORS))
def test_context_overflow_messages_of_each_server_are_recognised(style: str) -> None:
    status, body = CONTEXT_ERRORS[style]
    assert says_context_length(json.dumps(body))
    observation = PolicyInput([{"role": "user", "content": "long " * 100}], [], 0)
    with ChatServer(Behaviour(context_limit=10, context_style=style)) as server:
        policy = OpenAIChatPolicy("m", server.url, backoff=0.0)
        with pytest.raises(ContextLengthError, match=f"HTTP {status}"):
            asyncio.run(policy.act(observation))
        assert len(server.behaviour.requests) == 1
    assert not says_context_length('{"error": "injected"}')


def _look(body: dict[str, Any]) -> dict[str, Any]:
    call = {"id": "c", "type": "function",
            "function": {"name": "alfworld_step", "arguments": json.dumps({"action": "look"})}}
    return {"content": "", "tool_calls": [call]}


# Tokens of the double (characters / 4): the first two games open with ~600 and ~440 and
# each "look" adds ~230 and ~130, so a whole chat overflows at turn 4 or 8 of 12.
LIMIT = 1200


def test_alfworld_episodes_that_outgrow_the_context_end_context_length(tmp_path: Path) -> None:
    behaviour = Behaviour(reply=_look, context_limit=LIMIT)
    config = EvalConfig(ALFWORLD, "openai:m", episodes=2, env_kwargs={"max_turns": 12})
    with ChatServer(behaviour) as server:
        policy = OpenAIChatPolicy("m", server.url, backoff=0.0)
        summary = asyncio.run(evaluate(config, policy, tmp_path / "full", progress=False))
        records = _episodes(tmp_path / "full")
        assert summary.errors == 0 and summary.episodes == 2
        assert summary.context_length == 2 and summary.end_reasons == {"context_length": 2}
        for record in records:
            assert record["end_reason"] == "context_length" and not record["terminated"]
            assert 1 < record["turns"] < 12 and record["reward"] == 0.0  # scored as it stood
            assert "exceeds the available context" in record["context_error"]
        asked = len(behaviour.requests)
        again = asyncio.run(evaluate(config, policy, tmp_path / "full", progress=False))
        assert len(behaviour.requests) == asked  # never retried on resume
        assert again.context_length == 2

        # A history window of 2 turns keeps every prompt under the limit to the turn budget.
        behaviour.requests.clear()
        windowed = EvalConfig(ALFWORLD, "openai:m", episodes=2, env_kwargs={"max_turns": 12},
                              history_window=2)
        summary = asyncio.run(evaluate(windowed, policy, tmp_path / "window", progress=False))
    assert summary.context_length == 0 and summary.end_reasons == {"truncated": 2}
    assert all(r["turns"] == 12 for r in _episodes(tmp_path / "window"))
    assert max(prompt_tokens(body) for body in behaviour.requests) <= LIMIT
    last = behaviour.requests[-1]["messages"]
    assert [m["role"] for m in last[:2]] == ["system", "user"]  # the task is always kept
    assert len(last) == 2 + 2 * 2
    assert json.loads((tmp_path / "window" / "config.json").read_text())["history_window"] == 2


def test_one_policy_serves_runs_in_several_event_loops(tmp_path: Path) -> None:
    """What --suite does: one policy, one asyncio.run per env."""
    with ChatServer() as server:
        policy = OpenAIChatPolicy("m", server.url)
        for index, env_id in enumerate((GSM8K, GSM8K, SEARCH)):
            config = EvalConfig(env_id, "openai:m", episodes=2, seed=index,
                                env_kwargs={"max_turns": 1})
            summary = asyncio.run(evaluate(config, policy, tmp_path / str(index),
                                           progress=False))
            assert summary.errors == 0, summary.first_error


def test_suite_with_an_openai_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with ChatServer() as server:
        code = main(["eval", "--suite", "default", "--policy", f"openai:m@{server.url}",
                     "--episodes", "1", "--quiet", "--out", str(tmp_path)])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "Event loop is closed" not in out.out + out.err
    assert "overall" in out.out
    overall = json.loads((tmp_path / "overall.json").read_text())
    assert overall[0]["env_id"] == "overall" and overall[0]["episodes"] == 4
    assert overall[0]["errors"] == 0


def test_timeout_is_the_http_clients() -> None:
    policy = make_policy("openai:m@http://127.0.0.1:1/v1", timeout=0.2)
    assert isinstance(policy, OpenAIChatPolicy) and policy.timeout == 0.2
    with ChatServer(Behaviour(delay=1.0)) as server:
        policy = make_policy(f"openai:m@{server.url}", timeout=0.2)
        assert isinstance(policy, OpenAIChatPolicy) and policy.max_retries > 0
        started = time.monotonic()
        # Not retried: the server is still computing the request, and a resend would queue
        # behind it. The error says which setting to change.
        # At --concurrency 1 a slow reply is the request's own length, not a queue.
        with pytest.raises(PolicyError, match=r"^ReadTimeout: no reply within --timeout 0.2 s"
                                              r".*raise --timeout or lower --max-tokens"):
            asyncio.run(policy.act(PolicyInput([{"role": "user", "content": "x"}], [], 0)))
        assert time.monotonic() - started < 0.9
        assert len(server.behaviour.requests) == 1


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_sigterm_writes_the_summary_of_finished_episodes(tmp_path: Path, sigint: str) -> None:
    """Also where SIGINT is ignored, as in a run started with ``cmd &`` from a script."""
    run = tmp_path / "run"
    handler = signal.default_int_handler if sigint == "default" else signal.SIG_IGN
    with ChatServer(Behaviour(delay=0.3)) as server:
        child = subprocess.Popen(
            [sys.executable, "-m", "agent_gym.cli", "eval", GSM8K, "--episodes", "30",
             "--concurrency", "2", "--quiet", "--out", str(run),
             "--policy", f"openai:m@{server.url}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            preexec_fn=lambda: signal.signal(signal.SIGINT, handler),
        )
        log = run / "episodes.jsonl"
        deadline = time.monotonic() + 120
        while not (log.exists() and len(log.read_text().splitlines()) >= 2):
            assert child.poll() is None, child.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGTERM)
        out, err = child.communicate(timeout=60)
    assert child.returncode == 130, err.decode()[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] and summary["episodes"] == len(_episodes(run)) < 30
    assert "(interrupted)" in out.decode() and "rerun the same command" in err.decode()
