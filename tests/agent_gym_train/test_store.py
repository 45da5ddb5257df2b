"""TEMPO's state store: resume points cut from episodes, and the store's rules (bounded,
consumed, fresh tasks never starved, stale states dropped, saved and restored as JSON)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from agent_gym.env.state import EnvState
from agent_gym_train.run.episode import Episode, ResumePoint, Span, TokenSequence
from agent_gym_train.run.store import STORE_FORMAT_VERSION, StateStore, StoreError, cut, fresh_quota


def resume_point(version: int, index: int = 0) -> ResumePoint:
    state = EnvState("agent_gym_tests/None", {}, f"task-{index}", None, ("a",), ("d0", "d1"))
    messages = ({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                {"role": "user", "content": "no"})
    return ResumePoint(state, TokenSequence((1, 2, 3, 4), (Span(1, (-0.5,)),)), messages, 1, {},
                       version)


def test_fresh_quota() -> None:
    assert [fresh_quota(4, f) for f in (0.25, 0.5, 0.75, 1.0)] == [1, 2, 3, 4]
    assert fresh_quota(3, 0.5) == 2  # rounds up: never less than the fraction
    assert fresh_quota(10, 0.01) == 1  # at least one fresh task
    with pytest.raises(ValueError):
        fresh_quota(4, 0.0)


def test_store_never_starves_fresh_tasks_and_consumes_states() -> None:
    store = StateStore(capacity=1000, staleness=100)
    store.add(resume_point(0, i) for i in range(100))
    rng = np.random.default_rng(0)
    seen: set[str] = set()
    for _ in range(20):
        drawn, stale = store.draw(4, 0.25, version=1, rng=rng)
        assert len(drawn) == 3 and stale == 0  # one group of four left to a fresh task
        ids = {s.state.task_id for s in drawn}
        assert len(ids) == 3 and not ids & seen  # consumed: never drawn twice
        seen |= ids
    assert len(store) == 100 - 60
    assert store.draw(4, 1.0, version=1, rng=rng) == ([], 0)  # all fresh
    small = StateStore(capacity=10, staleness=1)
    small.add([resume_point(0)])
    drawn, _ = small.draw(8, 0.25, version=0, rng=rng)
    assert len(drawn) == 1 and len(small) == 0  # fewer states than slots: the rest is fresh


def test_store_evicts_fifo_and_drops_stale_states() -> None:
    store = StateStore(capacity=3, staleness=2)
    assert store.add(resume_point(v, v) for v in range(5)) == 2
    assert [s.version for s in store] == [2, 3, 4]  # the two oldest went
    assert store.drop_stale(version=5) == 1  # version 2 is 3 versions old
    assert [s.version for s in store] == [3, 4]
    drawn, stale = store.draw(4, 0.25, version=6, rng=np.random.default_rng(0))
    assert stale == 1 and [s.version for s in drawn] == [4]


def test_store_round_trips_through_json_and_rejects_bad_files() -> None:
    store = StateStore(capacity=5, staleness=3)
    store.add(resume_point(v, v) for v in range(4))
    again = StateStore.from_json(store.to_json(), capacity=5, staleness=3)
    assert list(again) == list(store)
    assert json.loads(store.to_json())["version"] == STORE_FORMAT_VERSION == 2
    smaller = StateStore.from_json(store.to_json(), capacity=2, staleness=3)
    assert [s.version for s in smaller] == [2, 3]
    with pytest.raises(StoreError, match="not valid JSON"):
        StateStore.from_json("{", 5, 3)
    with pytest.raises(StoreError, match="version"):
        StateStore.from_json('{"states": []}', 5, 3)
    broken = json.loads(store.to_json())
    broken["states"][0]["sequence"]["spans"] = [{"start": 3, "logprobs": [-1.0, -1.0]}]
    with pytest.raises(StoreError, match="outside the 4 tokens"):
        StateStore.from_json(json.dumps(broken), 5, 3)
    del broken["states"][0]["version"]
    with pytest.raises(StoreError, match="fields"):
        StateStore.from_json(json.dumps(broken), 5, 3)


def test_the_critic_replay_is_saved_with_the_store_and_checked_on_load() -> None:
    store = StateStore(capacity=5, staleness=3)
    reply = TokenSequence((1, 2)).extend([1, 2], [3, 4], [-0.5, -0.1])
    store.critic_replay += [(reply, 1.0), (reply, 0.25)]
    again = StateStore.from_json(store.to_json(), capacity=5, staleness=3)
    assert again.critic_replay == store.critic_replay
    older = json.loads(store.to_json())
    del older["critic_replay"]  # a store saved before replay existed
    assert StateStore.from_json(json.dumps(older), 5, 3).critic_replay == []
    for bad in ([{"sequence": reply.to_dict(), "target": float("nan")}],
                [{"sequence": reply.to_dict()}], {"sequence": []}):
        with pytest.raises(StoreError, match="critic replay must be"):
            StateStore.from_json(json.dumps(older | {"critic_replay": bad}), 5, 3)
    hostile = reply.to_dict() | {"spans": [{"start": 9, "logprobs": [-1.0]}]}
    with pytest.raises(StoreError, match="critic replay is bad"):
        StateStore.from_json(json.dumps(older | {"critic_replay": [
            {"sequence": hostile, "target": 1.0}]}), 5, 3)


def test_a_version_1_store_is_refused_with_a_clear_error() -> None:
    old = {"version": 1, "states": [{"state": {}, "tokens": [1], "sampled": [[0, 1]],
                                     "old_logprob_sum": -1.0}]}
    with pytest.raises(StoreError, match=r"version 1.*start a fresh run"):
        StateStore.from_json(json.dumps(old), 5, 3)


def hand_made_episode(start: ResumePoint | None = None) -> Episode:
    """Turn 1 samples [4 5] after prompt [1 2 3]; the env adds [6 7]; turn 2 samples [8 9]."""
    before = list(start.messages) if start else [{"role": "system", "content": "s"},
                                                 {"role": "user", "content": "task"}]
    actions = (*(start.state.actions if start else ()), "a1", "a2")
    prefix = start.sequence.as_context() if start else TokenSequence((1, 2, 3))
    sequence = prefix.extend([1, 2, 3], [4, 5], [-0.1, -0.2]).extend(
        [1, 2, 3, 4, 5, 6, 7], [8, 9], [-0.3, -0.4])
    return Episode(
        "t", sequence, reward=0.5, end_reason="max_turns",
        messages=[*before, {"role": "assistant", "content": "a1"}, {"role": "tool", "content": "o1"},
                  {"role": "assistant", "content": "a2"}, {"role": "tool", "content": "o2"}],
        step_rewards=[0.0, 0.5], opening_messages=2, privileged={"answer": "x"},
        env_state=EnvState("e", {}, "t", 7, actions, tuple(f"d{i}" for i in range(len(actions) + 1))),
        next_prompt=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], start=start,
    )


def test_cutting_resume_points_from_an_episode() -> None:
    episode = hand_made_episode()
    middle = cut(episode, 1, version=3)
    assert middle.sequence.tokens == (1, 2, 3, 4, 5, 6, 7)
    assert middle.sequence.spans == (Span(3, (-0.1, -0.2)),)
    assert middle.sequence.logprob_sum == pytest.approx(-0.3)
    assert middle.state.actions == ("a1",) and middle.state.digests == ("d0", "d1")
    assert [m["content"] for m in middle.messages] == ["s", "task", "a1", "o1"]
    assert middle.observation == "o1" and middle.turn == 1 and middle.version == 3
    end = cut(episode, 2, version=3)
    assert list(end.sequence.tokens) == episode.next_prompt
    assert [s.start for s in end.sequence.spans] == [3, 7]
    assert end.sequence.logprob_sum == pytest.approx(-1.0)
    assert end.state == episode.env_state and end.privileged == {"answer": "x"}
    assert ResumePoint.from_dict(json.loads(json.dumps(end.to_dict()))) == end
    with pytest.raises(StoreError, match="between 1 and"):
        cut(episode, 3, version=3)
    with pytest.raises(StoreError, match="keep_states"):
        cut(dataclasses.replace(episode, env_state=None), 1, version=3)
    with pytest.raises(StoreError, match="no prompt to resume"):
        cut(dataclasses.replace(episode, next_prompt=None, end_reason="truncated"), 2, 3)
    with pytest.raises(StoreError, match="token-continuous"):
        cut(dataclasses.replace(episode, next_prompt=[1, 2, 3, 9]), 2, 3)


def test_cut_chains_onto_the_point_an_episode_resumed_from() -> None:
    start = dataclasses.replace(
        resume_point(1), sequence=TokenSequence((1, 2, 3), (Span(1, (-2.0,)),)),
        messages=({"role": "system", "content": "s"}, {"role": "user", "content": "task"},
                  {"role": "assistant", "content": "a0"}, {"role": "tool", "content": "o0"}),
        opening=2, state=EnvState("e", {}, "t", 7, ("a0",), ("d0", "d1")),
    )
    point = cut(hand_made_episode(start), 1, version=4)
    assert [s.start for s in point.sequence.spans] == [1, 3]  # the prefix's span, then turn 1
    assert point.sequence.logprob_sum == pytest.approx(-2.3)
    assert point.state.actions == ("a0", "a1") and point.turn == 2
    assert [m["content"] for m in point.messages][2:] == ["a0", "o0", "a1", "o1"]
