"""The base class's snapshot restore, on an env that implements only the two hooks."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agent_gym import (
    BackendFailure,
    EnvState,
    Opening,
    StateError,
    StateMismatchError,
    Task,
    TextEnv,
    Transition,
)
from agent_gym.env.prefixes import chain_key
from agent_gym.hoststore import HostStore


class TallyEnv(TextEnv):
    """Adds up the numbers it is told. Its whole engine state is the running total, so that
    is its snapshot; it counts its steps and snapshot restores so tests can see which
    path a restore took."""

    env_id = "tests/Tally-v0"

    def __init__(self, max_turns: int = 20) -> None:
        super().__init__([Task("zero", {"start": 0}), Task("hundred", {"start": 100})],
                         max_turns=max_turns)
        self.total = 0
        self.steps = 0
        self.restores = 0
        self.snapshots_usable = True

    def _start(self, task: Task) -> Opening:
        self.total = task.payload["start"]
        return Opening(f"total {self.total}", [{"role": "user", "content": "add numbers"}])

    def _step(self, action: str) -> Transition:
        self.steps += 1
        if not action.lstrip("-").isdigit():
            return Transition(f"not a number: {action!r}", invalid=True, role="user")
        self.total += int(action)
        return Transition(f"total {self.total}", role="user", info={"addends": [int(action)]})

    def _snapshot(self) -> int:
        return self.total

    def _restore_snapshot(self, snapshot: object) -> bool:
        self.restores += 1
        if not self.snapshots_usable or not isinstance(snapshot, int):
            return False
        self.total = snapshot
        return True


ACTIONS = ["3", "x", "4", "-2", "10"]


def played(env: TallyEnv, actions: list[str] = ACTIONS, task: str = "zero") -> list:
    """The state after each action of an episode on ``task``."""
    env.reset(options={"task_id": task})
    states = [env.save_state()]
    for action in actions:
        env.step(action)
        states.append(env.save_state())
    return states


def test_restores_in_the_same_env_jump_to_snapshots_without_replaying() -> None:
    env = TallyEnv()
    states = played(env)
    observations = list(env._transcript)
    env.steps = env.restores = 0
    for state in reversed(states[1:]):
        observation, info = env.reset(options={"state": state})
        assert observation == observations[state.depth] and env.save_state() == state
        assert info["snapshot_depth"] == state.depth == info["restored_depth"]
        assert [m["content"] for m in info["history"][1::2]] == observations[1 : state.depth + 1]
    assert (env.steps, env.restores) == (0, len(ACTIONS))
    # The restored episode goes on from the snapshot's engine state.
    env.reset(options={"state": states[3]})
    assert env.step("5")[0] == "total 12"


def test_a_state_beyond_the_cache_jumps_to_its_longest_cached_prefix() -> None:
    env, elsewhere = TallyEnv(), TallyEnv()
    played(env, ACTIONS[:2])
    longer = played(elsewhere)[-1]
    env.steps = env.restores = 0
    observation, info = env.reset(options={"state": longer})
    assert observation == "total 15" and info["snapshot_depth"] == 2
    assert (env.restores, env.steps) == (1, len(ACTIONS) - 2)
    assert env.save_state() == longer


def test_every_observation_is_still_checked_when_the_prefix_is_cached() -> None:
    env = TallyEnv()
    state = played(env)[-1]
    env.steps = 0
    for step in range(1, state.depth + 1):
        digests = list(state.digests)
        digests[step] = "0" * 16
        with pytest.raises(StateMismatchError) as caught:
            env.reset(options={"state": replace(state, digests=tuple(digests))})
        assert caught.value.step == step
    assert env.steps == 0  # the cached transitions were checked, none replayed
    with pytest.raises(RuntimeError, match="reset"):
        env.step("1")  # a failed restore leaves nothing to step on
    # The same actions on another task: the prefix is not that task's, and it differs at 0.
    with pytest.raises(StateMismatchError) as caught:
        env.reset(options={"state": replace(state, task_id="hundred")})
    assert caught.value.step == 0


def test_a_fresh_env_replays_and_an_unusable_snapshot_falls_back_to_replay() -> None:
    state = played(TallyEnv())[-1]
    fresh = TallyEnv()
    assert fresh.reset(options={"state": state})[1]["snapshot_depth"] == 0
    assert (fresh.restores, fresh.steps) == (0, len(ACTIONS))
    fresh.snapshots_usable = False
    fresh.steps = 0
    assert fresh.reset(options={"state": state})[1]["snapshot_depth"] == 0
    assert fresh.steps == len(ACTIONS) and fresh.save_state() == state
    assert fresh.restores == len(ACTIONS)  # each cached prefix was tried once, then dropped
    fresh.snapshots_usable = True
    assert fresh.reset(options={"state": state})[1]["snapshot_depth"] == len(ACTIONS)


def test_the_cache_is_bounded_least_recently_used_first_out() -> None:
    env = TallyEnv()
    env.snapshot_cache_size = 2
    states = played(env)
    assert sorted(key.depth for key in env.prefixes.snapshots()) == [4, 5]
    assert env.reset(options={"state": states[4]})[1]["snapshot_depth"] == 4
    played(env, ["7"], task="hundred")  # evicts depth 5, the least recently used
    assert env.reset(options={"state": states[5]})[1]["snapshot_depth"] == 4
    assert env.reset(options={"state": states[2]})[1]["snapshot_depth"] == 0


def test_a_caller_editing_an_info_does_not_change_later_restores() -> None:
    env = TallyEnv()
    env.reset(options={"task_id": "zero"})
    env.step("3")
    env.step("4")[4]["addends"].append(99)  # a caller's own edits
    state = env.save_state()
    for _ in range(2):
        _, info = env.reset(options={"state": state})
        assert info["snapshot_depth"] == 2 and info["addends"] == [4]
        info["addends"].clear()
        info["history"].clear()
    assert env.reset(options={"state": state})[1]["history"][1]["content"] == "total 3"


class LimitedTally(TallyEnv):
    """Marks the step on which its turns run out (once per application of the rule)."""

    def _out_of_turns(self, last: Transition) -> Transition:
        return replace(last, info={**last.info, "limits": [*last.info.get("limits", []), "hit"]})


def test_base_rules_apply_once_to_cached_transitions() -> None:
    """The cache keeps transitions as _step returned them; the turn limit and the invalid
    penalty are applied on the way out, once, exactly as on a replay."""
    env = LimitedTally(max_turns=3)
    env.invalid_penalty = 0.5
    env.reset(options={"task_id": "zero"})
    assert env.step("x")[1] == -0.5
    env.step("1")
    *_, terminated, truncated, info = env.step("2")
    assert (terminated, truncated, info["limits"]) == (False, True, ["hit"])
    state = env.save_state()
    _, info = env.reset(options={"state": state})
    assert info["snapshot_depth"] == 3 and info["limits"] == ["hit"]
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step("1")
    halfway = replace(state, actions=state.actions[:1], digests=state.digests[:2])
    assert env.reset(options={"state": halfway})[1]["snapshot_depth"] == 1
    assert env.step("y")[1] == -0.5


class FlakyTally(TallyEnv):
    """A tally whose adding goes through a backend that can fail (``down``)."""

    env_id = "tests/FlakyTally-v0"

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.calls = 0

    def _add(self, number: int) -> int:
        self.calls += 1
        if self.down:
            raise ConnectionError("the adder is down")
        return self.total + number

    def _step(self, action: str) -> Transition:
        try:
            self.total = self._outside(lambda: self._add(int(action)), ConnectionError)
        except BackendFailure as err:
            return Transition(f"failed: {err.message}", role="user")
        return Transition(f"total {self.total}", role="user")


def test_recorded_failures_replay_and_key_the_snapshot_cache() -> None:
    """The same actions with and without a failure are two prefixes, not one."""
    env = FlakyTally()
    env.reset(options={"task_id": "zero"})
    env.down = True
    assert env.step("3")[0] == "failed: the adder is down"
    env.down = False
    env.step("4")
    failed = env.save_state()
    env.reset(options={"task_id": "zero"})
    env.step("3")
    env.step("4")
    worked = env.save_state()
    assert failed.faults == ((1, "the adder is down"),) and worked.faults == ()
    for state, last in ((failed, "total 4"), (worked, "total 7")):
        observation, info = env.reset(options={"state": state})
        assert observation == last and info["snapshot_depth"] == 2
        assert env.save_state() == state
    fresh = FlakyTally()  # no snapshots: replays, and never calls the backend for step 1
    assert fresh.reset(options={"state": failed})[0] == "total 4" and fresh.calls == 1


def test_a_step_calls_at_most_one_backend() -> None:
    class Greedy(FlakyTally):
        def _step(self, action: str) -> Transition:
            self._outside(lambda: 1, ConnectionError)
            self._outside(lambda: 2, ConnectionError)
            return Transition("two calls", role="user")

    env = Greedy()
    env.reset(options={"task_id": "zero"})
    with pytest.raises(RuntimeError, match="called a backend twice in one step"):
        env.step("1")


# ------------------------------------------------------------------ the host store
class StoredTally(TallyEnv):
    """A tally that also redoes its moves from the host store: its move is the number
    added (0 for a refused one); ``data`` stands for the content of its tasks."""

    env_id = "tests/StoredTally-v0"

    def __init__(self, store: str | None = None, data: str = "v1") -> None:
        super().__init__()
        self.use_prefix_store(HostStore("tally_prefixes", store))
        self.data = data
        self.redone: list[list[int]] = []
        self.redo_works = True
        self._added = 0

    def _step(self, action: str) -> Transition:
        before = self.total
        result = super()._step(action)
        self._added = self.total - before
        return result

    def _fingerprint(self, task: Task) -> str:
        return self.data

    def _move(self) -> int:
        return self._added

    def _redo(self, moves: Sequence[Any]) -> bool:
        if not self.redo_works:
            return False
        self.redone.append(list(moves))
        self.total += sum(moves)
        return True


def shared(tmp_path: Path, **kwargs: Any) -> tuple[StoredTally, StoredTally]:
    """Two instances on one store file, as two processes of a host would be."""
    path = tmp_path / "store.sqlite"
    return StoredTally(str(path), **kwargs), StoredTally(str(path), **kwargs)


def test_a_fresh_instance_redoes_the_recorded_moves_and_checks_every_observation(
    tmp_path: Path,
) -> None:
    first, fresh = shared(tmp_path)
    states = played(first)
    observation, info = fresh.reset(options={"state": states[-1]})
    assert (observation, info["snapshot_source"], info["snapshot_depth"]) == (
        "total 15", "store", len(ACTIONS))
    assert fresh.steps == 0 and fresh.redone == [[3, 0, 4, -2, 10]]
    assert [m["content"] for m in info["history"][1::2]] == list(first._transcript[1:])
    assert fresh.save_state() == states[-1] and fresh.step("5")[0] == "total 20"
    for step in range(1, len(ACTIONS) + 1):  # a wrong digest still fails at its own step
        digests = list(states[-1].digests)
        digests[step] = "0" * 16
        with pytest.raises(StateMismatchError) as caught:
            fresh.reset(options={"state": replace(states[-1], digests=tuple(digests))})
        assert caught.value.step == step
    # Another action: the record is another prefix's, so the steps from there are replayed.
    forged = replace(states[-1], actions=(*ACTIONS[:2], "5", *ACTIONS[3:]))
    with pytest.raises(StateMismatchError) as caught:
        fresh.reset(options={"state": forged})
    assert caught.value.step == 3


def test_a_record_is_never_taken_across_data_settings_or_an_engine_that_cannot_redo(
    tmp_path: Path,
) -> None:
    first, other_data = shared(tmp_path)
    other_data.data = "v2"  # the same task id on other data
    state = played(first)[-1]
    assert other_data.reset(options={"state": state})[1]["snapshot_source"] is None
    assert other_data.steps == len(ACTIONS)
    unable = StoredTally(str(tmp_path / "store.sqlite"))
    unable.redo_works = False
    assert unable.reset(options={"state": state})[1]["snapshot_source"] is None
    assert unable.save_state() == state


def rewrite_second_record(tmp_path: Path, edit: Callable[[dict[str, Any]], bytes]
                          ) -> tuple[StoredTally, EnvState]:
    """A fresh instance on a store whose record of step 2 ``edit`` rewrote (from the record
    as JSON to the stored bytes), and the state to restore."""
    first, fresh = shared(tmp_path)
    state = played(first)[-1]
    damaged = StoredTally(str(tmp_path / "store.sqlite"))
    damaged.reset(options={"task_id": "zero"})
    damaged.step("3")
    key = chain_key(damaged.prefixes.head, "x", None)
    fresh.prefixes.store.put(key, edit(json.loads(zlib.decompress(
        damaged.prefixes.store.get(key)))))
    fresh.prefixes.store.clear_memory()
    return fresh, state


def test_a_record_that_disagrees_is_settled_by_real_replay(tmp_path: Path) -> None:
    def stale(entry: dict[str, Any]) -> bytes:  # what stale code would have recorded
        entry["transition"]["observation"] = "total 1000"
        return zlib.compress(json.dumps(entry).encode())

    fresh, state = rewrite_second_record(tmp_path, stale)
    observation, info = fresh.reset(options={"state": state})
    assert observation == "total 15" and info["snapshot_source"] is None  # replayed
    assert fresh.steps == len(ACTIONS) and fresh.save_state() == state
    # The replay wrote the record again: the next restore is a redo once more.
    assert StoredTally(str(tmp_path / "store.sqlite")).reset(
        options={"state": state})[1]["snapshot_source"] == "store"


def test_a_record_that_inflates_past_the_bound_is_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small store record may hold any size once inflated: past the bound
    (``hoststore.inflate``) it is refused unread, and the restore redoes only the records
    before it, replaying the rest."""
    def padded(entry: dict[str, Any]) -> bytes:  # the same record, 4 MB larger inflated
        entry["padding"] = " " * (4 * 2**20)
        bomb = zlib.compress(json.dumps(entry).encode(), 9)
        assert len(bomb) < 2**15
        return bomb

    fresh, state = rewrite_second_record(tmp_path, padded)
    monkeypatch.setattr("agent_gym.hoststore.MAX_INFLATED_BYTES", 2**20)
    observation, info = fresh.reset(options={"state": state})
    assert observation == "total 15"
    assert (info["snapshot_source"], info["snapshot_depth"]) == ("store", 1)
    assert fresh.steps == len(ACTIONS) - 1 and fresh.save_state() == state


def test_the_host_store_is_opt_in_and_clear_forgets_only_this_instances_snapshots(
    tmp_path: Path,
) -> None:
    assert TallyEnv().prefixes.store is None  # an env keeps no record unless it opts in
    path = str(tmp_path / "store.sqlite")
    quiet = StoredTally(path)
    quiet.use_prefix_store(None)  # opted out again: its prefixes are kept in no store
    state = played(quiet)[-1]
    assert quiet.prefixes.store is None and quiet.prefixes.head is None
    assert StoredTally(path).reset(options={"state": state})[1]["snapshot_source"] is None
    loud = StoredTally(path)  # opts in through use_prefix_store in its constructor
    assert isinstance(loud.prefixes.store, HostStore)
    played(loud)
    assert loud.prefixes.head is not None
    assert len(loud.prefixes.snapshots()) == len(ACTIONS)
    loud.prefixes.clear()  # this instance's snapshots go; the host's records stay
    assert loud.prefixes.snapshots() == []
    loud.steps = 0
    _, info = loud.reset(options={"state": state})
    assert (info["snapshot_source"], info["snapshot_depth"]) == ("store", len(ACTIONS))
    loud.use_prefix_store(None)
    _, info = loud.reset(options={"state": state})
    assert (info["snapshot_source"], info["snapshot_depth"]) == (None, 0)
    assert loud.steps == len(ACTIONS) and loud.save_state() == state


class CountedAction(str):
    """An action that counts how often it is hashed: every lookup of a key built from a
    prefix of the actions hashes each of them again."""

    hashes = 0

    def __hash__(self) -> int:
        CountedAction.hashes += 1
        return str.__hash__(self)


@pytest.mark.parametrize("cached", [True, False])
def test_naming_the_prefixes_of_a_state_is_linear_in_its_length(cached: bool) -> None:
    length = 300
    env = TallyEnv(max_turns=length)
    states = played(env, ["1"] * length)
    if not cached:
        env.prefixes.clear()
    state = replace(states[-1], actions=tuple(CountedAction(a) for a in states[-1].actions))
    CountedAction.hashes = 0
    assert env.reset(options={"state": state})[1]["snapshot_depth"] == (length if cached else 0)
    # Keys holding every prefix's actions hashed each action once per shorter prefix:
    # ~length**2 / 2 = 45,000 here; a chained digest per prefix hashes none of them.
    assert CountedAction.hashes <= 4 * length


def test_a_state_longer_than_the_env_allows_is_refused_before_any_prefix_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = TallyEnv(max_turns=20)
    short = played(env)[-1]
    long = replace(short, actions=("1",) * 50, digests=(short.digests[0],) + ("0" * 16,) * 50)

    def no_prefix_work(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a state the env cannot have played was looked up")

    monkeypatch.setattr(type(env.prefixes), "jump", no_prefix_work)
    monkeypatch.setattr(TallyEnv, "_start", no_prefix_work)
    with pytest.raises(StateError, match=r"50 actions.*max_turns=20"):
        env.reset(options={"state": long})
