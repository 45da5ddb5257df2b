"""A run directory's files are untrusted input to every reader (issue 35): a resume
quarantines what it cannot read and keeps the rest, crafted figures never crash or exhaust
a reader, one eval writes a directory at a time, and writes never share a temporary name."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from agent_gym.eval import runfiles
from agent_gym.eval.config import EvalConfig
from agent_gym.eval.policies import OraclePolicy, PolicyInput, Reply
from agent_gym.eval.report import render_report
from agent_gym.eval.run import evaluate
from agent_gym.eval.runfiles import QUARANTINE_FILE, RunDirError, read_log
from agent_gym.eval.runlog import RunLockedError, RunLog, write_file
from agent_gym.eval.runs import read_run
from agent_gym.eval.summary import overall_summary
from tests.helpers.eval_runs import GSM8K, make_run, run_held_by_another_process

EPISODES = 6


def _resume(run: Path) -> list[str]:
    """Rerun the run's eval (the oracle on GSM8K); what it said before it ran."""
    notes: list[str] = []
    asyncio.run(evaluate(EvalConfig(GSM8K, "oracle", EPISODES), OraclePolicy(), run,
                         concurrency=2, progress=False, notify=notes.append))
    return notes


def _line_of(record: dict, **changes: object) -> bytes:
    return (json.dumps({**record, **changes}) + "\n").encode()


@pytest.mark.parametrize("bad", [
    pytest.param(b"\xff\xfe{\"episode\": 2}\n", id="not-utf8"),
    pytest.param(b"[]\n", id="array"),
    pytest.param(b"{}\n", id="empty-object"),
    pytest.param("string-episode", id="string-episode"),
    pytest.param(b"{oops\n", id="not-json"),
    pytest.param("nan-latency", id="nan-latency"),
    pytest.param("huge-reward", id="1e999-reward"),
])
def test_a_resume_quarantines_an_unreadable_middle_line_and_keeps_every_later_episode(
    tmp_path: Path, bad: bytes | str
) -> None:
    run = tmp_path / "run"
    make_run(run, episodes=EPISODES)
    log = run / "episodes.jsonl"
    lines = log.read_bytes().splitlines(keepends=True)
    record = json.loads(lines[2])
    if bad == "string-episode":
        bad = _line_of(record, episode="two")
    elif bad == "nan-latency":
        bad = _line_of(record).replace(b'"latency_s": ', b'"latency_s": NaN, "x": ')
    elif bad == "huge-reward":
        bad = _line_of(record).replace(b'"reward": ', b'"reward": 1e999, "x": ')
    assert isinstance(bad, bytes)
    log.write_bytes(b"".join(lines[:2]) + bad + b"".join(lines[3:]))

    notes = _resume(run)

    # Every readable line is kept, byte for byte and in its place; the episode whose line
    # could not be read is played again; the line itself is set aside, and said so.
    after = log.read_bytes()
    assert after.startswith(b"".join(lines[:2]) + b"".join(lines[3:]))
    assert sorted(r["episode"] for r in map(json.loads, after.splitlines())) == list(
        range(EPISODES))
    assert (run / QUARANTINE_FILE).read_bytes() == bad
    (said,) = [note for note in notes if "unreadable" in note]
    assert "moved 1 unreadable line" in said and "line 3" in said and QUARANTINE_FILE in said
    assert "the 5 episodes it holds are kept" in said
    # A reader of the run sees the quarantine; the next resume finds nothing to move.
    assert any(QUARANTINE_FILE in note for note in read_run(run).notes)
    assert not [note for note in _resume(run) if "unreadable" in note]


def test_a_cut_last_line_is_quarantined_with_the_others_not_deleted(tmp_path: Path) -> None:
    run = tmp_path / "run"
    make_run(run, episodes=EPISODES)
    log = run / "episodes.jsonl"
    lines = log.read_bytes().splitlines(keepends=True)
    cut = lines[5][:40]
    log.write_bytes(lines[0] + b"[]\n" + b"".join(lines[2:5]) + cut)
    notes = _resume(run)
    assert (run / QUARANTINE_FILE).read_bytes() == b"[]\n" + cut + b"\n"
    assert any("moved 2 unreadable lines" in note for note in notes)
    assert log.read_bytes().startswith(lines[0] + b"".join(lines[2:5]))


def test_readers_skip_crafted_figures_and_never_change_the_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    make_run(run, episodes=4)
    log = run / "episodes.jsonl"
    lines = log.read_bytes().splitlines(keepends=True)
    good = json.loads(lines[0])
    crafted = [
        _line_of(good, episode=4).replace(b'"latency_s": ', b'"latency_s": NaN, "x": '),
        _line_of(good, episode=5).replace(b'"reward": ', b'"reward": Infinity, "x": '),
        _line_of(good, episode=6, reward=1e300),  # two of them overflowed every mean
        _line_of(good, episode=7, reward=1e300),
        _line_of(good, episode=8, replies=[{"latency_s": "1"}]),
        _line_of(good, episode=9, step_rewards=["nan"]),
        _line_of(good, episode=10, rollout=10**7),
        _line_of(good, episode=10**12),
        b"[" * 100_000 + b"\n",  # nested past any parser's recursion limit
    ]
    text = b"".join(lines) + b"".join(crafted)
    log.write_bytes(text)
    read = read_run(run)
    assert sorted(r["episode"] for r in read.episodes.values()) == [0, 1, 2, 3]
    skipped = [note for note in read.notes if note.startswith("episodes.jsonl: line")]
    assert len(skipped) == len(crafted)
    assert "line 5 holds the non-finite number NaN" in skipped[0]
    assert "line 7 has no valid reward" in skipped[2]
    assert "line 13 is nested deeper" in skipped[8]
    assert "line 13" in skipped[8] and "skipped" in skipped[8]
    assert read.summary().episodes == 4
    render_report([read])
    assert overall_summary([(read.config, read.summary(), run)]).episodes == 4
    assert log.read_bytes() == text  # readers never repair, cut or move


def test_a_line_longer_than_the_bound_is_skipped_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "episodes.jsonl"
    log.write_bytes(b'{"episode": 0}\n' + b"x" * 5000 + b"\n" + b'{"episode": 1}\n')
    monkeypatch.setattr(runfiles, "MAX_LINE_BYTES", 1000)
    read = read_log(log, {"episode": (runfiles.count(10), True)})
    assert [record["episode"] for _, record in read.records] == [0, 1]
    assert [(bad.number, bad.start, bad.end) for bad in read.unreadable] == [(2, 15, 5016)]
    assert "longer than 1,000 bytes" in read.unreadable[0].problem


def test_a_turn_count_of_a_hundred_thousand_is_ten_bars_not_a_hundred_thousand(
    tmp_path: Path
) -> None:
    run = tmp_path / "run"
    make_run(run, episodes=2)
    log = run / "episodes.jsonl"
    first, second = (json.loads(line) for line in log.read_text().splitlines())
    log.write_text(json.dumps({**first, "turns": 100_000}) + "\n" + json.dumps(second) + "\n")
    page = render_report([read_run(run)])
    assert page.count("<rect") <= 3 * 10 and len(page) < 200_000


@pytest.mark.parametrize(("config", "needle"), [
    (b"{not json", "is not valid JSON"),
    (b'{"env_id": "\xff"}', "is not UTF-8"),
    (b"[]", "is not a JSON object"),
    (b'{"env_id": "agent_gym/GSM8K-v0", "policy": "oracle", "episodes": 0}',
     "episodes must be from 1"),
    (b'{"env_id": "agent_gym/GSM8K-v0", "policy": "oracle", "episodes": "6"}',
     "episodes is '6', not an integer"),
    (b'{"env_id": "agent_gym/GSM8K-v0", "policy": "oracle", "episodes": 6, '
     b'"rollouts_per_task": 10000000}', "rollouts_per_task must be from 1 to 1000"),
    (b'{"env_id": "agent_gym/GSM8K-v0", "policy": "oracle", "episodes": 6, '
     b'"temperature": 1e999}', "too large to be finite"),
    (b'{"policy": "oracle", "episodes": 6}', "records no env_id"),
])
def test_a_crafted_config_is_refused_by_every_reader_and_left_as_it_is(
    tmp_path: Path, config: bytes, needle: str
) -> None:
    run = tmp_path / "run"
    make_run(run, episodes=2)
    (run / "config.json").write_bytes(config)
    for read in (lambda: read_run(run), lambda: _resume(run)):
        with pytest.raises(RunDirError) as caught:
            read()
        assert str(run / "config.json") in str(caught.value) and needle in str(caught.value)
    assert (run / "config.json").read_bytes() == config


def test_a_second_writer_of_a_run_is_refused_naming_the_first(tmp_path: Path) -> None:
    run = tmp_path / "run"
    make_run(run, episodes=2)
    before = (run / "episodes.jsonl").read_bytes()
    with run_held_by_another_process(run) as holder:
        with pytest.raises(RunLockedError, match=f"another eval \\(pid {holder.pid} on "):
            _resume(run)
        assert (run / "episodes.jsonl").read_bytes() == before
    assert holder.returncode == 0
    assert not _resume(run)[1:]  # the holder is gone: the directory is free again


def test_a_run_log_in_this_process_also_holds_the_directory(tmp_path: Path) -> None:
    log = RunLog(tmp_path, EvalConfig(GSM8K, "oracle", 2))
    try:
        with pytest.raises(RunLockedError, match="wait for it to end"):
            RunLog(tmp_path, EvalConfig(GSM8K, "oracle", 2))
    finally:
        log.close()
    RunLog(tmp_path, EvalConfig(GSM8K, "oracle", 2)).close()


def test_two_writes_of_one_file_never_take_each_others_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second write lands between the first's write and its rename (what a second eval
    or a resume racing a kill did): with one fixed temporary name the second renamed the
    first's file away and the first crashed."""
    target = tmp_path / "config.json"
    real_fsync = os.fsync
    calls = []

    def fsync_with_a_writer_in_between(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            write_file(target, "second")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_with_a_writer_in_between)
    write_file(target, "first")
    assert target.read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # no temporary left


@pytest.mark.parametrize("name", ["eval.lock", "episodes.jsonl"])
def test_an_eval_never_writes_through_a_symlink_a_crafted_run_holds(
    tmp_path: Path, name: str
) -> None:
    run = tmp_path / "run"
    make_run(run, episodes=2)
    elsewhere = tmp_path / "someone-elses-file"
    elsewhere.write_bytes((run / name).read_bytes())  # the log: lines an eval would take
    before = elsewhere.read_bytes()
    (run / name).unlink()
    (run / name).symlink_to(elsewhere)
    with pytest.raises(RunDirError, match=f"cannot write {run / name}"):
        _resume(run)
    assert elsewhere.read_bytes() == before


class FailsOnSomeTasks:
    """The oracle, except that it raises on a third of the episodes."""

    name = "fails-sometimes"

    async def act(self, observation: PolicyInput) -> Reply:
        if observation.seed % 3 == 0:
            raise RuntimeError("this episode breaks")
        return await OraclePolicy().act(observation)


def test_the_progress_bar_counts_saved_episodes_and_shows_failed_ones_beside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = EvalConfig(GSM8K, "fails-sometimes", 9)
    summary = asyncio.run(evaluate(config, FailsOnSomeTasks(), tmp_path, concurrency=2))
    assert (summary.episodes, summary.errors) == (6, 3)
    bar = capsys.readouterr().err.replace("\r", "\n").splitlines()[-1]
    assert "6/9" in bar and "errors=3" in bar, bar


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_run_file_that_is_not_a_regular_file_is_refused_at_once(
    tmp_path: Path, kind: str
) -> None:
    """A FIFO (no writer ever comes) or a link to /dev/zero (no end) in a crafted run would
    keep every reader waiting: each is refused in one line before a byte is read."""
    run = tmp_path / "run"
    make_run(run, episodes=2)
    log = run / "episodes.jsonl"
    log.unlink()
    if kind == "fifo":
        os.mkfifo(log)
    else:
        log.symlink_to("/dev/zero")
    with pytest.raises(RunDirError, match="not a regular file"):
        read_run(run)
    (run / "config.json").unlink()
    (run / "config.json").symlink_to("/dev/zero")
    with pytest.raises(RunDirError, match="not a regular file"):
        runfiles.read_config(run / "config.json")
