"""The journal of in-flight episodes (agent_gym_train.run.journal): a run killed at any moment
resumes its rollouts from their last turn, loses no episode and counts none twice."""

from __future__ import annotations

import json
import random
import sqlite3
from pathlib import Path

import pytest

from agent_gym.env.state import EnvState
from agent_gym_train.run.episode import Episode, Span, TokenSequence
from agent_gym_train.run.files import RunConfigError
from agent_gym_train.run.journal import (
    JOURNAL_FILE,
    BranchRecord,
    Journal,
    check_journal,
    fingerprint,
)
from tests.agent_gym_train.test_grpo import toy_model  # noqa: F401 (a fixture)
from tests.helpers import grpo_toy
from tests.helpers.fork_runner import PHASES, ForkRunner


def in_flight(version: int) -> BranchRecord:
    state = EnvState("agent_gym_tests/SayDigit-v0", {}, "task-0", 0, ("7",), ("a" * 16,) * 2)
    return BranchRecord(version, state, [1, 2, 3], [{"role": "user", "content": "3"}],
                        TokenSequence((1, 2, 3), (Span(2, (-0.5,)),)), [0.0], 0, 0)


def finished(version: int) -> BranchRecord:
    episode = Episode("task-0", TokenSequence((1, 2, 3), (Span(2, (-0.5,)),)), 1.0,
                      "terminated", [{"role": "assistant", "content": "3"}], version=version)
    return BranchRecord(version, None, [], [], episode.sequence, [1.0], 0, 0, episode=episode)


def test_a_group_is_taken_whole_or_dropped_and_counted(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.sqlite", {"seed": 0}, max_staleness=1)
    # step 5: two branches finished on version 4 (one update old: usable)
    for branch in (0, 1):
        journal.record(5, "group", 0, branch, finished(4))
    taken = journal.take(5, "group", 0, version=5, branches=2)
    assert sorted(taken) == [0, 1] and all(r.episode is not None for r in taken.values())
    # a finished group needs no weights; a group in flight must be on the weights given now
    journal.record(5, "group", 1, 0, finished(5))
    journal.record(5, "group", 1, 1, in_flight(5))
    assert sorted(journal.take(5, "group", 1, version=5, branches=2)) == [0, 1]
    journal.record(5, "group", 2, 0, in_flight(4))
    assert journal.take(5, "group", 2, version=5, branches=2) == {}  # its weights are gone
    # too stale for the bound: dropped, even finished
    journal.record(7, "group", 0, 0, finished(5))
    assert journal.take(7, "group", 0, version=6, branches=1) == {}
    counts = journal.resumed(5)
    assert (counts.reused_episodes, counts.resumed_branches, counts.dropped_branches) == (3, 1, 1)
    assert journal.resumed(7).dropped_branches == 1
    assert journal.take(5, "group", 2, version=5, branches=2) == {}  # dropped for good


def test_an_unreadable_record_drops_its_group_and_is_counted(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.sqlite", {}, max_staleness=0)
    journal.record(0, "group", 0, 0, in_flight(0))
    journal.record(0, "group", 0, 1, in_flight(0))
    journal.close()
    import sqlite3

    with sqlite3.connect(tmp_path / "j.sqlite") as db:
        db.execute("UPDATE branches SET record = '{\"version\": NaN}' WHERE branch = 1")
    journal = Journal(tmp_path / "j.sqlite", {}, max_staleness=0)
    assert journal.take(0, "group", 0, version=0, branches=2) == {}
    assert journal.resumed(0).dropped_branches == 2


def test_a_journal_of_other_settings_is_discarded_on_opening(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.sqlite", fingerprint({"seed": 0, "out": "a"}))
    journal.record(0, "group", 0, 0, in_flight(0))
    journal.close()
    same = Journal(tmp_path / "j.sqlite", fingerprint({"seed": 0, "out": "b", "threads": 2,
                                                       "vllm_url": "http://127.0.0.1:8001"}))
    assert same.discarded == 0 and same.take(0, "group", 0, version=0, branches=1)
    same.close()
    other = Journal(tmp_path / "j.sqlite", fingerprint({"seed": 1, "out": "a"}))
    assert other.discarded == 1 and other.take(0, "group", 0, version=0, branches=1) == {}


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("staleness", "kills", "phases", "more"), [
    (1, 20, PHASES, []), (0, 8, PHASES, []),
    # windowed chats continue too: killed only mid-rollout, where they are in flight
    (0, 6, ("journal",), ["--history-window", "1", "--max-turns", "3", "--max-tokens", "12"]),
])
def test_kills_at_random_moments_lose_no_episode_and_count_none_twice(
    toy_model: str, tmp_path: Path, staleness: int, kills: int,  # noqa: F811
    phases: tuple[str, ...], more: list[str],
) -> None:
    """20 SIGKILLs of an asynchronous run (8 of a synchronous one), each at a random call
    of a random phase (a turn being journaled, a sampling call, an optimizer step,
    checkpoint.json about to be written), each rerun into the same directory; then once
    more to the end. Every step trained exactly the datums of a run never killed (same
    digest of tokens, targets and advantages), and the journal was used: branches
    continued mid-episode, finished episodes reused."""
    steps = 20
    argv = ["--env-id", grpo_toy.ENV_ID, "--model", toy_model, "--lora-rank", "0",
            "--steps", str(steps), "--batch-size", "2", "--group-size", "4",
            "--learning-rate", "1e-2", "--max-turns", "2", "--max-tokens", "8",
            "--max-trajectory-tokens", "96", "--save-every", "1", "--no-progress",
            "--max-staleness", str(staleness), "--concurrency", "1", *more]
    rng = random.Random(staleness)
    killed_in: list[str] = []
    with ForkRunner() as runner:
        assert runner.run([*argv, "--out", str(tmp_path / "straight")]) == "finished"
        while len(killed_in) < kills:
            if len(killed_in) % len(phases) == 0:  # every phase, in a random order
                order = rng.sample(phases, len(phases))
            phase = order[len(killed_in) % len(phases)]
            # at most about a step's worth of calls: the run must outlast the kills
            call = rng.randint(1, {"journal": 10, "sample": 6, "update": 2,
                                   "checkpoint": 2}[phase])
            outcome = runner.run([*argv, "--out", str(tmp_path / "killed")], (phase, call))
            assert outcome in ("killed", "finished"), outcome
            if outcome == "finished":
                break
            killed_in.append(phase)
        if len(killed_in) == kills:  # then to the end, untouched
            assert runner.run([*argv, "--out", str(tmp_path / "killed")]) == "finished"
    assert len(killed_in) == kills, f"the run ended after {len(killed_in)} kills: lengthen it"
    assert set(killed_in) == set(phases)
    straight, killed = rows(tmp_path / "straight"), rows(tmp_path / "killed")
    assert [r["step"] for r in killed] == list(range(steps))
    dropped = sum(r["journal_dropped_branches"] for r in killed)
    assert dropped == 0  # nothing was too stale: every journaled branch could be used
    for a, b in zip(killed, straight, strict=True):
        assert (a["datums_digest"], a["episodes"], a["reward_mean"], a["sampler_version"]) == (
            b["datums_digest"], b["episodes"], b["reward_mean"], b["sampler_version"]), a["step"]
    assert sum(r["journal_resumed_branches"] for r in killed) > 0
    assert sum(r["journal_reused_episodes"] for r in killed) > 0
    assert not any(r["journal_resumed_branches"] + r["journal_reused_episodes"]
                   for r in straight)


def test_a_chat_holding_a_lone_surrogate_is_journaled_and_read_back(tmp_path: Path) -> None:
    """Env text can hold anything; the journal stores it escaped (SQLite would refuse a
    lone surrogate as UTF-8) and gives back the same string."""
    record = in_flight(0)
    record.messages = [{"role": "user", "content": "a\udc80b"}]
    journal = Journal(tmp_path / "j.sqlite", {})
    journal.record(0, "group", 0, 0, record)
    assert journal.take(0, "group", 0, version=0, branches=1)[0].messages == record.messages


def test_a_finished_record_edited_in_the_file_is_dropped_not_trained_on(tmp_path: Path) -> None:
    """Rewards set to 1000 in rollouts.sqlite were reused as they were, and the resumed
    run trained step 0 on them."""
    path = tmp_path / JOURNAL_FILE
    journal = Journal(path, {"seed": 0})
    for group in (0, 1):
        for branch in (0, 1):
            journal.record(0, "group", group, branch, finished(0))
    journal.close()
    with sqlite3.connect(path) as db:
        (text,) = db.execute("SELECT record FROM branches WHERE grp = 0 AND branch = 1"
                             ).fetchone()
        edited = text.replace('"reward": 1.0', '"reward": 1000.0')
        assert edited != text
        db.execute("UPDATE branches SET record = ? WHERE grp = 0 AND branch = 1", (edited,))
        # a record moved to another place of the journal is not as written either
        db.execute("UPDATE branches SET grp = 2 WHERE grp = 1 AND branch = 0")
    journal = Journal(path, {"seed": 0})
    assert journal.take(0, "group", 0, version=0, branches=2) == {}
    assert journal.take(0, "group", 2, version=0, branches=2) == {}
    assert journal.resumed(0).dropped_branches == 3


@pytest.mark.parametrize("damage", ["cut in half", "replaced by bytes"])
def test_a_journal_that_is_not_a_database_is_moved_aside_in_one_line(
    tmp_path: Path, damage: str
) -> None:
    path = tmp_path / JOURNAL_FILE
    journal = Journal(path, {"seed": 0})
    for step in range(40):  # pages enough that half the file loses some
        journal.record(step, "group", 0, 0, finished(0))
    journal.close()
    raw = path.read_bytes()
    raw = raw[:len(raw) // 2] if damage == "cut in half" else b"\x07" * len(raw)
    path.write_bytes(raw)
    with pytest.raises(RunConfigError, match=r"is not a readable journal .* moved to "
                       r"rollouts\.sqlite\.damaged") as caught:
        check_journal(path)
    assert "\n" not in str(caught.value)
    assert not path.exists() and (tmp_path / "rollouts.sqlite.damaged").read_bytes() == raw
    check_journal(path)  # the next run starts a new one
