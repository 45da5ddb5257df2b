import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent_gym.eval.config import EvalConfig
from agent_gym.eval.policies import (
    OpenAIChatPolicy,
    OraclePolicy,
    PolicyError,
    PolicyInput,
    _native_tool_messages,
    _tool_calls_as_text,
    make_policy,
)
from agent_gym.eval.run import evaluate
from agent_gym.eval.runlog import RunLog, RunMismatchError, RunWriteError
from agent_gym.eval.stats import wilson_interval
from tests.helpers.eval_runs import GSM8K, read_episodes
from tests.helpers.openai_server import Behaviour, ChatServer


def test_oracle_solves_every_episode_and_logs_transcripts(tmp_path: Path) -> None:
    config = EvalConfig(GSM8K, "oracle", episodes=6, seed=3)
    summary = asyncio.run(evaluate(config, OraclePolicy(), tmp_path, progress=False))
    assert summary.success_rate == 1.0 and summary.episodes == 6
    records = read_episodes(tmp_path)
    assert sorted(r["episode"] for r in records) == list(range(6))
    for record in records:
        assert record["transcript"][-2]["role"] == "assistant"
        assert record["final_state"]["env_id"] == GSM8K
    assert json.loads((tmp_path / "summary.json").read_text())["episodes"] == 6


def test_openai_policy_against_a_loopback_server(tmp_path: Path) -> None:
    with ChatServer() as server:
        policy = OpenAIChatPolicy("test-model", server.url, api_key="sk-test")
        config = EvalConfig(GSM8K, "openai:test-model", episodes=4)
        summary = asyncio.run(evaluate(config, policy, tmp_path, concurrency=2, progress=False))
        assert len(server.behaviour.requests) == 4
        assert server.behaviour.requests[0]["messages"][0]["role"] == "system"
    assert summary.episodes == 4 and summary.mean_tokens == 7
    assert all("boxed{42}" in r["transcript"][-2]["content"] for r in read_episodes(tmp_path))


def test_transient_server_errors_are_retried_with_a_bound() -> None:
    observation = PolicyInput([{"role": "user", "content": "hi"}], [], 0)
    with ChatServer(Behaviour(failures=[500, 429])) as server:
        policy = OpenAIChatPolicy("m", server.url, backoff=0.01, max_retries=3)
        assert "42" in asyncio.run(policy.act(observation)).text
        assert len(server.behaviour.requests) == 3
    with ChatServer(Behaviour(failures=[503] * 10)) as server:
        policy = OpenAIChatPolicy("m", server.url, backoff=0.01, max_retries=2)
        with pytest.raises(PolicyError, match="gave up after 3 attempts; last: HTTP 503"):
            asyncio.run(policy.act(observation))
        assert len(server.behaviour.requests) == 3
    with ChatServer(Behaviour(malformed=5)) as server:
        policy = OpenAIChatPolicy("m", server.url, backoff=0.01, max_retries=1)
        with pytest.raises(PolicyError, match="not JSON"):
            asyncio.run(policy.act(observation))
    with ChatServer(Behaviour(failures=[401])) as server:
        with pytest.raises(PolicyError, match="HTTP 401"):
            asyncio.run(OpenAIChatPolicy("m", server.url).act(observation))
        assert len(server.behaviour.requests) == 1  # not retried: it will not get better


def test_connection_refused_is_a_policy_error() -> None:
    policy = OpenAIChatPolicy("m", "http://127.0.0.1:9/v1", backoff=0.01, max_retries=1)
    with pytest.raises(PolicyError, match="ConnectError"):
        asyncio.run(policy.act(PolicyInput([{"role": "user", "content": "x"}], [], 0)))


def test_failed_episodes_are_logged_then_retried_on_resume(tmp_path: Path) -> None:
    config = EvalConfig(GSM8K, "openai:m", episodes=3)
    with ChatServer(Behaviour(failures=[500] * 6)) as server:
        policy = OpenAIChatPolicy("m", server.url, backoff=0.0, max_retries=1)
        summary = asyncio.run(evaluate(config, policy, tmp_path, concurrency=1, progress=False))
        assert summary.errors == 3 and summary.episodes == 0
        assert len((tmp_path / "errors.jsonl").read_text().splitlines()) == 3
        summary = asyncio.run(evaluate(config, policy, tmp_path, concurrency=1, progress=False))
    assert summary.errors == 0 and summary.episodes == 3


def test_a_sigkilled_run_resumes_with_nothing_lost_or_repeated(tmp_path: Path) -> None:
    run = tmp_path / "run"
    command = [
        sys.executable, "-m", "agent_gym.cli", "eval", GSM8K, "--episodes", "12",
        "--concurrency", "2", "--out", str(run), "--quiet",
    ]
    with ChatServer(Behaviour(delay=0.15)) as server:
        command += ["--policy", f"openai:m@{server.url}"]
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        log = run / "episodes.jsonl"
        while time.monotonic() < deadline:
            if log.exists() and len(log.read_text().splitlines()) >= 3:
                break
            if child.poll() is not None:
                pytest.fail(f"eval exited early: {child.stderr.read().decode()[-2000:]}")
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        before = log.read_bytes()
        assert 3 <= len(before.splitlines()) < 12
        with log.open("ab") as handle:  # as if the kill had landed mid-write
            handle.write(b'{"episode": 11, "reward": 1.0, "trunc')
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, timeout=120)
    after = log.read_bytes()
    assert after.startswith(before)  # finished episodes were kept as they were
    assert sorted(r["episode"] for r in read_episodes(run)) == list(range(12))


def test_resumed_oracle_run_equals_an_unbroken_run(tmp_path: Path) -> None:
    unbroken = EvalConfig(GSM8K, "oracle", episodes=8, seed=5)
    asyncio.run(evaluate(unbroken, OraclePolicy(), tmp_path / "a", progress=False))
    partial = EvalConfig(GSM8K, "oracle", episodes=3, seed=5)
    asyncio.run(evaluate(partial, OraclePolicy(), tmp_path / "b", progress=False))
    asyncio.run(evaluate(unbroken, OraclePolicy(), tmp_path / "b", progress=False))

    def by_episode(run: Path) -> list[tuple]:
        return sorted((r["episode"], r["task_id"], r["reward"]) for r in read_episodes(run))

    assert by_episode(tmp_path / "a") == by_episode(tmp_path / "b")


def test_a_run_directory_of_another_run_is_refused(tmp_path: Path) -> None:
    asyncio.run(evaluate(EvalConfig(GSM8K, "oracle", 1), OraclePolicy(), tmp_path, progress=False))
    with pytest.raises(RunMismatchError, match="another --out"):
        asyncio.run(
            evaluate(EvalConfig(GSM8K, "oracle", 1, seed=9), OraclePolicy(), tmp_path,
                     progress=False)
        )


def test_native_tool_calls_become_text_and_back() -> None:
    text = _tool_calls_as_text(
        "Looking.", [{"function": {"name": "search", "arguments": '{"query": "nile"}'}}]
    )
    assert text.endswith('<tool_call>\n{"name": "search", "arguments": {"query": "nile"}}\n</tool_call>')
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": text},
        {"role": "tool", "content": "results"},
        {"role": "assistant", "content": "<tool_call>{broken</tool_call>"},
        {"role": "tool", "content": "Error: not valid JSON"},
    ]
    converted = _native_tool_messages(messages)
    assert converted[1]["tool_calls"][0]["function"]["name"] == "search"
    assert converted[2] == {"role": "tool", "tool_call_id": "call_1", "content": "results"}
    assert converted[4]["role"] == "user"  # an error answer to an unparsed call


def test_policy_specs() -> None:
    assert make_policy("oracle").name == "oracle"
    policy = make_policy("openai:qwen@http://127.0.0.1:1/v1#text")
    assert isinstance(policy, OpenAIChatPolicy) and not policy.native_tools
    with pytest.raises(ValueError, match="openai:MODEL@BASE_URL"):
        make_policy("openai:qwen")
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("gpt")


def test_wilson_interval() -> None:
    low, high = wilson_interval(10, 10)
    assert high == 1.0 and 0.69 < low < 0.73
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and 0.27 < high < 0.31
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_local_sampler_policy_plays_an_episode(tmp_path: Path) -> None:
    policy = make_policy("local:tiny", max_tokens=8)
    assert policy.name == "local:tiny"
    config = EvalConfig(GSM8K, "local:tiny", episodes=2, env_kwargs={"max_turns": 2})
    summary = asyncio.run(evaluate(config, policy, tmp_path, concurrency=2, progress=False))
    assert summary.episodes == 2 and summary.errors == 0
    record = read_episodes(tmp_path)[0]
    assert 1 <= record["completion_tokens"] <= 16 and record["prompt_tokens"] > 20


def test_episodes_cover_distinct_tasks_before_any_repeats(tmp_path: Path) -> None:
    config = EvalConfig(GSM8K, "oracle", episodes=60, seed=1)
    asyncio.run(evaluate(config, OraclePolicy(), tmp_path, concurrency=8, progress=False))
    by_episode = {r["episode"]: r["task_id"] for r in read_episodes(tmp_path)}
    first = [by_episode[i] for i in range(54)]  # the bundled set has 54 problems
    assert len(set(first)) == 54
    assert [by_episode[i] for i in range(54, 60)] == first[:6]


def test_random_policy_choices_do_not_depend_on_scheduling() -> None:
    policy = make_policy("random", seed=3)
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "task A"}]
    observation = PolicyInput(chat, [], 2, info={"admissible_actions": list("abcdefgh")})
    first = asyncio.run(policy.act(observation)).text
    for _ in range(5):  # other episodes in between do not shift this one's choice
        asyncio.run(policy.act(PolicyInput([chat[0], {"role": "user", "content": "B"}], [], 0,
                                           info={"admissible_actions": list("xyz")})))
        assert asyncio.run(policy.act(observation)).text == first


def test_a_kill_while_config_json_is_rewritten_keeps_the_run_resumable(tmp_path: Path) -> None:
    """A resume rewrites config.json; a process killed mid-write must not leave it broken."""
    config = EvalConfig(GSM8K, "oracle", episodes=2, seed=4)
    asyncio.run(evaluate(config, OraclePolicy(), tmp_path, progress=False))
    before = (tmp_path / "config.json").read_bytes()
    # The child dies of SIGXFSZ at its first write past 16 bytes: a kill in mid-write.
    child = subprocess.run(
        [sys.executable, "-c", (
            "import resource, signal, sys\n"
            "from pathlib import Path\n"
            "from agent_gym.eval.config import EvalConfig\n"
            "from agent_gym.eval.runlog import RunLog\n"
            "config = EvalConfig('agent_gym/GSM8K-v0', 'oracle', episodes=3, seed=4)\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_DFL)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (16, resource.RLIM_INFINITY))\n"
            "RunLog(Path(sys.argv[1]), config)\n"
        ), str(tmp_path)],
        capture_output=True, timeout=120,
    )
    assert child.returncode == -signal.SIGXFSZ, child.stderr.decode()[-2000:]
    assert (tmp_path / "config.json").read_bytes() == before
    summary = asyncio.run(evaluate(EvalConfig(GSM8K, "oracle", episodes=3, seed=4),
                                   OraclePolicy(), tmp_path, progress=False))
    assert summary.episodes == 3


def test_an_acknowledged_episode_line_is_already_in_the_file(tmp_path: Path) -> None:
    """The group-commit writer: every awaited line is on disk, whole, in append order."""
    log = RunLog(tmp_path, EvalConfig(GSM8K, "oracle", episodes=50))

    async def write_all() -> None:
        async def one(episode: int) -> None:
            await log.write({"episode": episode, "reward": 1.0})
            lines = (tmp_path / "episodes.jsonl").read_text().splitlines()
            assert {"episode": episode, "reward": 1.0} in [json.loads(line) for line in lines]

        await asyncio.gather(*(one(i) for i in range(50)))

    try:
        asyncio.run(write_all())
    finally:
        log.close()
    assert [r["episode"] for r in read_episodes(tmp_path)] == list(range(50))


def test_after_a_failed_commit_no_line_is_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that failed may have left a cut line: nothing may be appended after it."""
    log = RunLog(tmp_path, EvalConfig(GSM8K, "oracle", episodes=2))

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    async def write_two() -> list[BaseException | None]:
        monkeypatch.setattr("agent_gym.eval.runlog.os.fsync", disk_full)
        first = await asyncio.gather(log.write({"episode": 0}), return_exceptions=True)
        monkeypatch.undo()
        second = await asyncio.gather(log.write({"episode": 1}), return_exceptions=True)
        return [*first, *second]

    try:
        outcomes = asyncio.run(write_two())
    finally:
        log.close()
    assert all(isinstance(o, RunWriteError) and "No space" in str(o) for o in outcomes)
    assert log.records == {}  # neither counts as saved


def test_random_policy_plays_valid_calls_in_either_alfworld_protocol(tmp_path: Path) -> None:
    """Issue 33: random sent bare commands to ALFWorld's default tool protocol, which refused
    every one, and the table showed a believable 0.00."""
    for protocol in ("tool", "text"):
        config = EvalConfig("agent_gym/ALFWorld-v0", "random", episodes=2,
                            env_kwargs={"protocol": protocol, "max_turns": 4})
        asyncio.run(evaluate(config, make_policy("random"), tmp_path / protocol,
                             concurrency=1, progress=False))
        records = read_episodes(tmp_path / protocol)
        assert len(records) == 2 and sum(r["turns"] for r in records) == 8
        assert [r["invalid_actions"] for r in records] == [0, 0], protocol
        replies = [m["content"] for r in records for m in r["transcript"]
                   if m["role"] == "assistant"]
        assert all(("<tool_call>" in reply) == (protocol == "tool") for reply in replies)


def test_random_policy_refuses_to_phrase_an_action_it_cannot_know_how_to() -> None:
    from agent_gym.actions.protocols import PlainTextProtocol, TagProtocol
    from agent_gym.envs.alfworld import STEP_TOOL

    policy = make_policy("random")
    chat = [{"role": "user", "content": "task"}]

    def act(tools: list, protocol: object, admissible: list[str]) -> str:
        observation = PolicyInput(chat, tools, 0, info={"admissible_actions": admissible},
                                  protocol=protocol)
        return asyncio.run(policy.act(observation)).text

    assert act([], None, ["look"]) == "look"  # an env without a protocol takes plain text
    assert act([], PlainTextProtocol(), ["look"]) == "look"
    # Tools offered but no protocol to call them with: a bare command would be refused.
    with pytest.raises(PolicyError, match="no action protocol"):
        act([STEP_TOOL.openai_schema()], None, ["look"])
    with pytest.raises(PolicyError, match="cannot carry"):
        act([], TagProtocol("search", "information", "query"), ["a </search> b"])


def test_the_table_shows_invalid_actions_and_cut_replies_and_notes_when_they_dominate(
    tmp_path: Path,
) -> None:
    """Issue 33: SmolLM2 at --max-tokens 128 had every reply cut and the table said 0.00."""
    from typing import Any

    from agent_gym.eval.policies import Reply
    from agent_gym.eval.summary import Summary, format_table

    class Unboxed:  # GSM8K refuses a reply without a boxed answer
        name = "unboxed"

        async def act(self, observation: PolicyInput) -> Reply:
            return Reply("I am not sure.")

    class Cut:
        name = "cut"

        async def act(self, observation: PolicyInput) -> Reply:
            return Reply(observation.privileged["oracle_actions"][0], cut=True)

    def run(policy: Any, **settings: int) -> Summary:
        config = EvalConfig(GSM8K, policy.name, episodes=3, **settings)
        return asyncio.run(evaluate(config, policy, tmp_path / policy.name, progress=False))

    oracle, unboxed, cut = run(OraclePolicy()), run(Unboxed()), run(Cut(), max_tokens=128)
    assert (unboxed.invalid_actions, unboxed.actions) == (3, 3) and unboxed.cut_replies == 0
    assert (cut.actions, cut.cut_replies) == (0, 3)
    lines = format_table([oracle, unboxed, cut]).splitlines()
    spans = [m.span() for m in re.finditer(r"-+", lines[1])]  # the rule under the header
    rows = [{lines[0][a:b].strip(): line[a:b].strip() for a, b in spans} for line in lines[2:]]
    assert [(row["policy"], row["invalid"], row["cut"]) for row in rows] == [
        ("oracle", "0.00", "0.00"), ("unboxed", "1.00", "0.00"), ("cut", "-", "1.00")]
    assert oracle.notes == []
    assert any(n.startswith("most actions were invalid (3 of 3)") for n in unboxed.notes)
    assert not any("calls the tool" in n for n in unboxed.notes)  # GSM8K has no tool
    assert any(n.startswith("most replies were cut by --max-tokens 128: raise it")
               for n in cut.notes)
    saved = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert saved["notes"] == cut.notes and saved["cut_replies"] == 3


def test_a_rerun_with_fewer_episodes_never_shrinks_what_the_run_reports(tmp_path: Path) -> None:
    """Issue 33: a rerun into a 6-episode --out with --episodes 3 rewrote summary.json (and
    what compare and view read) to 3 episodes without a word."""
    from agent_gym.eval.compare import compare
    from agent_gym.eval.runs import read_run

    told: list[str] = []
    asyncio.run(evaluate(EvalConfig(GSM8K, "oracle", episodes=6), OraclePolicy(), tmp_path,
                         progress=False, notify=told.append))
    assert told == []  # a fresh directory has nothing to report
    summary = asyncio.run(evaluate(EvalConfig(GSM8K, "oracle", episodes=3), OraclePolicy(),
                                   tmp_path, progress=False, notify=told.append))
    assert summary.episodes == 6
    assert json.loads((tmp_path / "summary.json").read_text())["episodes"] == 6
    assert json.loads((tmp_path / "config.json").read_text())["episodes"] == 6
    (note,) = told
    assert note.startswith(f"found 6 episodes in {tmp_path}; the 3 asked for are all there")
    assert "covers all 6" in note and "--episodes 6" in note
    run = read_run(tmp_path)
    assert run.summary().episodes == 6 and run.notes == []
    assert compare([run], [run], "A", "B").overall.pairs == 6
    # A resume that runs the missing episodes says so too.
    lines = (tmp_path / "episodes.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "episodes.jsonl").write_text("".join(lines[:4]))
    told.clear()
    resumed = asyncio.run(evaluate(EvalConfig(GSM8K, "oracle", episodes=6), OraclePolicy(),
                                   tmp_path, progress=False, notify=told.append))
    assert resumed.episodes == 6
    assert told == [f"found 4 episodes in {tmp_path}; running the 2 missing of the 6 asked for"]
