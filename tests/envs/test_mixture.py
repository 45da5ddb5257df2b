"""agent_gym/Mixture-v0: members' tasks numbered end to end, episodes played by the member
that owns the task, states that restore in the mixture or in the member alone."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import gymnasium
import pytest

import agent_gym
from agent_gym import StateError, TextEnv
from agent_gym.env import EnvPart

GSM8K = {"env_id": "agent_gym/GSM8K-v0", "weight": 3}
SEARCH = {"env_id": "agent_gym/Search-v0", "env_kwargs": {"protocol": "tag", "max_turns": 3}}


def mixture(*members: dict[str, Any]) -> gymnasium.Env:
    return gymnasium.make("agent_gym/Mixture-v0", members=list(members))


def test_task_indices_run_through_the_members_in_order() -> None:
    env, gsm8k, search = (mixture(GSM8K, SEARCH), gymnasium.make(GSM8K["env_id"]),
                          gymnasium.make(SEARCH["env_id"], **SEARCH["env_kwargs"]))
    try:
        n = gsm8k.unwrapped.num_tasks
        assert env.unwrapped.num_tasks == n + search.unwrapped.num_tasks
        assert env.unwrapped.parts == (EnvPart(n, 3.0), EnvPart(search.unwrapped.num_tasks, 1.0))
        assert env.unwrapped.max_turns == 3
        for index, member, alone, own in ((0, 0, gsm8k, 0), (n - 1, 0, gsm8k, n - 1),
                                          (n, 1, search, 0), (n + 5, 1, search, 5)):
            observation, info = env.reset(seed=1, options={"index": index})
            expected, expected_info = alone.reset(seed=1, options={"index": own})
            assert (observation, info["task_id"], info["member"]) == (
                expected, expected_info["task_id"], member)
            assert info["messages"] == expected_info["messages"]
        with pytest.raises(IndexError, match=r"\[0, "):
            env.reset(options={"index": env.unwrapped.num_tasks})
        assert [t.task_id for t in env.unwrapped.tasks] == [
            t.task_id for t in (*gsm8k.unwrapped.tasks, *search.unwrapped.tasks)]
        _, info = env.reset(options={"task_id": search.unwrapped.tasks[4].task_id})
        assert (info["member"], info["task_id"]) == (1, search.unwrapped.tasks[4].task_id)
        with pytest.raises(KeyError, match="no member"):
            env.reset(options={"task_id": "x"})
        for options in ({"seed": 1}, {"index": 0, "task_id": info["task_id"]}):
            with pytest.raises(ValueError, match="give one of index, task_id or state"):
                env.reset(options=options)
    finally:
        for e in (env, gsm8k, search):
            e.close()


def test_a_state_saved_in_a_mixture_restores_there_and_in_the_member_alone() -> None:
    env = mixture(GSM8K, SEARCH)
    n = env.unwrapped.parts[0].num_tasks
    try:
        env.reset(seed=2, options={"index": n + 3})
        observation, *_ = env.step("<search>capital</search>")
        state = env.unwrapped.save_state()
        assert state.env_id == "agent_gym/Search-v0"
        again = mixture(GSM8K, SEARCH)
        restored, info = again.reset(options={"state": state.to_json()})
        assert (restored, info["member"], again.unwrapped.turn) == (observation, 1, 1)
        alone, elsewhere, _ = agent_gym.make_from_state(state)
        assert elsewhere == observation
        for e in (again, alone):
            e.close()
        with pytest.raises(StateError, match="not a member"):
            mixture(GSM8K).reset(options={"state": state})
    finally:
        env.close()


def test_a_state_goes_to_the_member_with_its_settings() -> None:
    short = {"env_id": "agent_gym/Search-v0", "env_kwargs": {"protocol": "tag", "max_turns": 2}}
    env = mixture(short, SEARCH)
    n = env.unwrapped.parts[0].num_tasks
    try:
        env.reset(options={"index": n + 1})  # the 3-turn member
        env.step("<search>river</search>")
        state = env.unwrapped.save_state()
        _, info = env.reset(options={"state": state})
        assert info["member"] == 1
        other = {"env_id": "agent_gym/Search-v0", "env_kwargs": {"protocol": "tool"}}
        with pytest.raises(StateError, match="settings"):
            mixture(other).reset(options={"state": state})
    finally:
        env.close()


def test_members_that_differ_only_in_their_data_route_states_by_task() -> None:
    large = {"env_id": "agent_gym/GSM8K-v0", "env_kwargs": {"dataset": "math-large",
                                                            "split": "train"}}
    env = mixture(GSM8K, large)
    n = env.unwrapped.parts[0].num_tasks
    try:
        for index, member in ((3, 0), (n + 2, 1)):
            env.reset(seed=0, options={"index": index})
            state = env.unwrapped.save_state()
            _, info = env.reset(options={"state": state})
            assert info["member"] == member
        _, info = env.reset(options={"index": 1, "state": None})  # no state: a fresh task
        assert info["member"] == 0
        with pytest.raises(StateError, match="no member of this mixture can restore the state "
                           "\\(member 0: task"):
            mixture(large).reset(options={"state": env.unwrapped.save_state()})
    finally:
        env.close()


def test_reset_without_a_task_draws_members_by_weight_not_by_size() -> None:
    env = mixture({**GSM8K, "weight": 1}, {**SEARCH, "weight": 1})
    try:
        members = Counter(env.reset(seed=seed)[1]["member"] for seed in range(400))
        # the members hold different numbers of tasks; each gets about half the draws
        assert 150 < members[0] < 250, members
    finally:
        env.close()


@pytest.mark.parametrize(("members", "message"), [
    ([], "non-empty list"),
    ("agent_gym/GSM8K-v0", "non-empty list"),
    ([{"env_id": "agent_gym/GSM8K-v0", "weights": 2}], "unknown keys"),
    ([{"weight": 2}], "needs an env_id"),
    ([{**GSM8K, "weight": 0}], "positive number"),
    ([{**GSM8K, "weight": float("nan")}], "positive number"),
    ([{**GSM8K, "weight": True}], "positive number"),
    ([{**GSM8K, "env_kwargs": [1]}], "env_kwargs must be an object"),
    ([{"env_id": "agent_gym/Mixture-v0"}], "itself a mixture"),
    (["agent_gym/GSM8K-v0"], "must be an object"),
    ([{**GSM8K, "env_kwargs": {"render_mode": "ansi"}}], "the mixture's argument"),
    ([GSM8K, {**GSM8K, "weight": 1}], "members 0 and 1 .* both have task 'agsm-000'"),
    ([{"env_id": "agent_gym/NoSuchEnv-v0"}], r"mixture member 0 \(agent_gym/NoSuchEnv-v0\): "),
])
def test_bad_members_are_refused_in_one_line(members: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        gymnasium.make("agent_gym/Mixture-v0", members=members)


def test_a_member_the_env_refuses_fails_the_mixture_and_closes_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    closed: list[str] = []
    close = TextEnv.close

    def spy(env: TextEnv) -> None:
        closed.append(env.env_id)
        close(env)

    monkeypatch.setattr(TextEnv, "close", spy)
    with pytest.raises(ValueError, match=r"member 1 \(agent_gym/Search-v0\): .*no_such_setting"):
        mixture(GSM8K, {"env_id": "agent_gym/Search-v0", "env_kwargs": {"no_such_setting": 1}})
    assert closed == ["agent_gym/GSM8K-v0"]  # the member built before the one refused


def test_close_closes_every_member_even_when_one_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[str] = []
    close = TextEnv.close

    def failing_for_gsm8k(env: TextEnv) -> None:
        closed.append(env.env_id)
        close(env)
        if env.env_id == "agent_gym/GSM8K-v0":
            raise OSError("sandbox already gone")

    env = mixture(GSM8K, SEARCH)
    monkeypatch.setattr(TextEnv, "close", failing_for_gsm8k)
    with pytest.raises(OSError, match="sandbox already gone"):
        env.unwrapped.close()
    assert closed == ["agent_gym/GSM8K-v0", "agent_gym/Search-v0"]


def test_hostile_states_are_refused_before_any_member_replays_them() -> None:
    env = mixture(GSM8K, SEARCH)
    n = env.unwrapped.parts[0].num_tasks
    try:
        env.reset(options={"index": n})
        state = json.loads(env.unwrapped.save_state().to_json())
        deep = {**state, "actions": ["<search>x</search>"] * 4, "digests": ["0" * 16] * 5}
        for bad, message in ((deep, "member 1: the state has 4 actions"),
                             ("{not json", "not valid JSON"),
                             ({"env_id": "agent_gym/Search-v0"}, "format version None")):
            with pytest.raises(StateError, match=message):
                env.reset(options={"state": bad})
    finally:
        env.close()


def test_the_protocol_is_the_playing_members() -> None:
    env = mixture(GSM8K, SEARCH)
    n = env.unwrapped.parts[0].num_tasks
    try:
        assert env.unwrapped.protocol is None  # no episode yet
        env.reset(options={"index": n})
        assert env.unwrapped.protocol.format("river") == "<search>river</search>"
        env.reset(options={"index": 0})
        assert env.unwrapped.protocol is None  # GSM8K takes an answer, no tool
    finally:
        env.close()


def test_stepping_before_reset_is_an_error() -> None:
    env = mixture(GSM8K)
    for call in (lambda: env.unwrapped.step("x"), env.unwrapped.save_state):
        with pytest.raises(RuntimeError, match="reset"):
            call()
    env.close()


def test_weights_near_the_float_limit_are_kept_as_ratios_and_draw() -> None:
    """Two weights of 1e308 are each finite but sum to infinity: every draw divided by the
    sum and failed, as did a trainer's task sampler, which sums the parts' weights too."""
    env = mixture({**GSM8K, "weight": 1e308}, {**SEARCH, "weight": 1e308})
    try:
        assert [part.weight for part in env.unwrapped.parts] == [1.0, 1.0]
        members = Counter(env.reset(seed=seed)[1]["member"] for seed in range(100))
        assert set(members) == {0, 1}
    finally:
        env.close()


@pytest.mark.parametrize(("weight", "message"), [
    (10**400, "positive number below .* an integer of 1329 bits"),
    (10**5000, "an integer of 16610 bits"),
], ids=["1e400", "1e5000"])
def test_a_weight_past_a_floats_range_is_refused_in_one_line(weight: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mixture({**GSM8K, "weight": weight}, SEARCH)


def test_a_weight_too_small_beside_the_largest_to_be_drawn_is_refused() -> None:
    """Divided by the largest (the sum overflows), 5e-324 is 0: the member would never be
    drawn, and a trainer's task sampler refuses a part of weight 0."""
    other = {**SEARCH, "env_kwargs": {**SEARCH["env_kwargs"], "max_turns": 4}}
    with pytest.raises(ValueError, match="member 2: weight 5e-324 is too small beside"):
        mixture({**GSM8K, "weight": 1e308}, {**SEARCH, "weight": 1e308},
                {**other, "weight": 5e-324})
