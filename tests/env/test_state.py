import json
import socket

import gymnasium
import pytest

from agent_gym import EnvState, StateError, StateMismatchError, make_from_state


def _played_env(turns: int = 3) -> gymnasium.Env:
    env = gymnasium.make("agent_gym/GSM8K-v0", max_turns=turns + 1)
    env.reset(seed=7)
    for turn in range(turns):
        env.step(f"thinking about it, step {turn}")
    return env


def test_json_round_trip_keeps_every_field() -> None:
    state = _played_env().unwrapped.save_state()
    again = EnvState.from_json(state.to_json())
    assert again == state
    assert again.depth == 3
    assert len(again.digests) == 4


def test_corrupt_json_is_a_clear_state_error() -> None:
    text = _played_env().unwrapped.save_state().to_json()
    with pytest.raises(StateError, match="not valid JSON"):
        EnvState.from_json(text[: len(text) // 2])
    with pytest.raises(StateError, match="JSON object"):
        EnvState.from_json("[1, 2]")


def test_unknown_version_and_bad_fields_are_rejected() -> None:
    payload = json.loads(_played_env().unwrapped.save_state().to_json())
    with pytest.raises(StateError, match="format version 99"):
        EnvState.from_dict({**payload, "version": 99})
    with pytest.raises(StateError, match="'actions'"):
        EnvState.from_dict({**payload, "actions": "not a list"})
    with pytest.raises(StateError, match="one digest per action"):
        EnvState.from_dict({**payload, "digests": payload["digests"][:-1]})
    with pytest.raises(StateError, match="unknown fields"):
        EnvState.from_dict({**payload, "surprise": 1})


def test_booleans_are_neither_versions_nor_seeds() -> None:
    """JSON ``true`` is a Python bool, and ``bool`` is an ``int``: it must not pass as 1."""
    payload = json.loads(_played_env().unwrapped.save_state().to_json())
    with pytest.raises(StateError, match="format version True"):
        EnvState.from_dict({**payload, "version": True})
    with pytest.raises(StateError, match="'seed'"):
        EnvState.from_dict({**payload, "seed": True})
    assert EnvState.from_dict({**payload, "seed": 3}).seed == 3


def test_state_of_another_env_id_or_configuration_is_refused() -> None:
    state = _played_env().unwrapped.save_state()
    other = EnvState.from_dict({**json.loads(state.to_json()), "env_id": "agent_gym/Other-v0"})
    env = gymnasium.make("agent_gym/GSM8K-v0", max_turns=4)
    with pytest.raises(StateError, match="belongs to 'agent_gym/Other-v0'"):
        env.reset(options={"state": other})
    differently_built = gymnasium.make("agent_gym/GSM8K-v0", max_turns=9)
    with pytest.raises(StateError, match="make_from_state"):
        differently_built.reset(options={"state": state})


def test_make_from_state_rebuilds_the_env_from_json() -> None:
    env = _played_env()
    state = env.unwrapped.save_state()
    rebuilt, observation, info = make_from_state(state.to_json())
    assert info["turn"] == 3 and info["restored_depth"] == 3
    assert rebuilt.unwrapped.save_state() == state
    assert observation == env.unwrapped._transcript[-1]


def test_tampered_digest_names_the_first_differing_step() -> None:
    state = _played_env().unwrapped.save_state()
    digests = list(state.digests)
    digests[2] = "0" * 16
    tampered = EnvState.from_dict({**json.loads(state.to_json()), "digests": digests})
    env = gymnasium.make("agent_gym/GSM8K-v0", max_turns=4)
    with pytest.raises(StateMismatchError) as caught:
        env.reset(options={"state": tampered})
    assert caught.value.step == 2
    assert caught.value.expected == "0" * 16
    assert "step 2" in str(caught.value)
    with pytest.raises(RuntimeError, match="call reset"):  # not a half-replayed episode
        env.unwrapped.step("carry on")


def test_tampered_action_is_caught_at_its_step() -> None:
    env = gymnasium.make("agent_gym/GSM8K-v0", max_turns=4)
    env.reset(seed=7)
    env.step("no answer yet")
    env.step("still thinking")
    env.step("the answer is \\boxed{1}")
    state = env.unwrapped.save_state()
    actions = list(state.actions)
    actions[1] = "\\boxed{2}"  # ends the episode a step early, with another observation
    tampered = EnvState.from_dict({**json.loads(state.to_json()), "actions": actions})
    with pytest.raises(StateMismatchError) as caught:
        env.reset(options={"state": tampered})
    assert caught.value.step == 2


@pytest.mark.parametrize("seed", [7, None])
def test_a_restored_env_draws_the_next_task_as_the_original_would(seed: int | None) -> None:
    """Its generator is the original's after the reset, so the next unseeded reset agrees."""
    original = gymnasium.make("agent_gym/GSM8K-v0", max_turns=4)
    original.reset(seed=seed)
    original.step("thinking")
    state = EnvState.from_json(original.unwrapped.save_state().to_json())
    restored = gymnasium.make("agent_gym/GSM8K-v0", max_turns=4)
    restored.reset(options={"state": state})
    for _ in range(3):
        assert restored.reset()[1]["task_id"] == original.reset()[1]["task_id"]


def test_a_version_1_state_still_restores() -> None:
    env = _played_env()
    payload = json.loads(env.unwrapped.save_state().to_json())
    del payload["rng"], payload["faults"]
    old = EnvState.from_dict({**payload, "version": 1})
    assert old.rng is None and old.faults == ()
    assert gymnasium.make("agent_gym/GSM8K-v0", max_turns=4).reset(options={"state": old})[1][
        "restored_depth"] == 3
    with pytest.raises(StateError, match="unknown fields"):  # version 1 had no such fields
        EnvState.from_dict({**payload, "version": 1, "faults": []})


def test_recorded_failures_and_generators_are_checked() -> None:
    payload = json.loads(_played_env().unwrapped.save_state().to_json())
    assert payload["faults"] == [] and payload["rng"].startswith("pcg64:")
    faulted = EnvState.from_dict({**payload, "faults": [[2, "HTTP 503"]]})
    assert faulted.faults == ((2, "HTTP 503"),)
    assert EnvState.from_json(faulted.to_json()) == faulted
    assert faulted.prefix(1).faults == () and faulted.prefix(2).faults == ((2, "HTTP 503"),)
    assert faulted.prefix(1).digests == faulted.digests[:2]
    for bad in ([[4, "x"]], [[0, "x"]], [[2, "x"], [1, "y"]], [[1, "x"], [1, "y"]]):
        with pytest.raises(StateError, match="backend failures at steps"):
            EnvState.from_dict({**payload, "faults": bad})
    for bad in ("x", [[True, "x"]], [[1, 2]], [[1, "x" * 5000]], [[1]]):
        with pytest.raises(StateError, match="'faults' must be"):
            EnvState.from_dict({**payload, "faults": bad})
    for bad in ("pcg64:1:2", "mt19937:1:2:0:0", "pcg64:zz:1:0:0", 5, "pcg64:" + "f" * 300):
        with pytest.raises(StateError, match="'rng'"):
            EnvState.from_dict({**payload, "rng": bad})


def test_make_from_state_takes_no_host_setting_and_reports_the_reward_settings(
    tmp_path,
) -> None:
    env = gymnasium.make("agent_gym/GSM8K-v0", max_turns=2, reward_correct=5.0)
    env.reset(seed=1)
    env.step("thinking")
    payload = json.loads(env.unwrapped.save_state().to_json())
    payload["env_kwargs"]["math_timeout"] = 3600.0  # a host setting: never from a state
    rebuilt, _, info = make_from_state(json.dumps(payload))
    assert rebuilt.unwrapped.math_timeout == env.unwrapped.math_timeout
    assert info["host_settings_not_taken"] == {"math_timeout": 3600.0}
    assert info["reward_settings"] == {
        "reward_correct": 5.0, "reward_incorrect": 0.0, "invalid_penalty": 0.0}
    rebuilt, _, info = make_from_state(json.dumps(payload), math_timeout=3.0)  # the caller's
    assert rebuilt.unwrapped.math_timeout == 3.0
    with pytest.raises(StateError, match="make_from_state"):  # episode settings must agree
        make_from_state(json.dumps(payload), max_turns=9)
    data = tmp_path / "mine.jsonl"
    data.write_text(json.dumps({"id": "mine-1", "question": "1+1?", "answer": "#### 2"}) + "\n")
    own = gymnasium.make("agent_gym/GSM8K-v0", data_path=str(data))
    own.reset(seed=0)
    state = own.unwrapped.save_state()
    with pytest.raises(StateError, match="not in this env's data") as caught:
        make_from_state(state)  # the state's data_path is not followed...
    assert "never taken from a state" in " ".join(caught.value.__notes__)
    assert make_from_state(state, data_path=str(data))[2]["task_id"] == "mine-1"  # ...the caller's is


def test_a_restore_reports_what_this_code_scores_each_replayed_step() -> None:
    env = gymnasium.make("agent_gym/GSM8K-v0", max_turns=3, invalid_penalty=0.25)
    _, info = env.reset(seed=3)
    env.step("no answer here")  # invalid: the penalty
    env.step(info["privileged"]["oracle_actions"][0])  # right: 1
    state = env.unwrapped.save_state()
    env.close()
    restored, _, info = make_from_state(state)
    assert info["step_rewards"] == [-0.25, 1.0] and info["episode_end"] == "terminated"
    restored.close()
    restored, _, info = make_from_state(state.prefix(1))  # mid-episode
    assert info["step_rewards"] == [-0.25] and info["episode_end"] is None
    restored.close()


def test_deeply_nested_json_is_a_state_error_not_a_crash() -> None:
    payload = json.loads(_played_env().unwrapped.save_state().to_json())
    for depth in (100, 100_000):
        nested = "[" * depth + "]" * depth
        text = json.dumps({**payload, "env_kwargs": {"deep": "@"}}).replace('"@"', nested)
        with pytest.raises(StateError, match="nested deeper"):
            EnvState.from_json(text)
    deep: list = []
    for _ in range(200):  # a state parsed elsewhere, handed over as a dict
        deep = [deep]
    with pytest.raises(StateError, match="nested deeper"):
        EnvState.from_dict({**payload, "env_kwargs": {"deep": deep}})
    with pytest.raises(StateError, match="non-finite"):
        EnvState.from_json(json.dumps(payload).replace('"seed": 7', '"seed": NaN'))
    with pytest.raises(StateError, match="not UTF-8"):
        EnvState.from_json(b"\xff" + json.dumps(payload).encode())


@pytest.mark.parametrize("setting", ["max_turns", "reward_correct", "reward_incorrect",
                                     "invalid_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_settings_are_refused(setting: str, value: float) -> None:
    with pytest.raises(ValueError, match=setting):
        gymnasium.make("agent_gym/GSM8K-v0", **{setting: value})
    payload = json.loads(_played_env().unwrapped.save_state().to_json())
    payload["env_kwargs"][setting] = value  # a state's settings are checked the same way
    with pytest.raises(StateError, match=setting):
        make_from_state(EnvState.from_dict(payload))


def test_max_turns_is_a_whole_number() -> None:
    for bad in (2.5, True, "3", 0):
        with pytest.raises(ValueError, match="max_turns"):
            gymnasium.make("agent_gym/GSM8K-v0", max_turns=bad)


def test_a_state_never_chooses_where_to_connect_or_an_env_that_keeps_no_states() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.3)
    port = listener.getsockname()[1]
    remote = EnvState(env_id="agent_gym/Remote-v0",
                      env_kwargs={"url": f"http://127.0.0.1:{port}", "token": "stolen"},
                      task_id="t", seed=None, actions=(), digests=("0" * 16,))
    with listener:
        with pytest.raises(StateError, match="not an env that saves"):
            make_from_state(remote)
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing connected
    other = EnvState(env_id="CartPole-v1", env_kwargs={}, task_id="t", seed=None, actions=(),
                     digests=("0" * 16,))
    with pytest.raises(StateError, match="'CartPole-v1'"):
        make_from_state(other)
    wrong_kwarg = json.loads(_played_env().unwrapped.save_state().to_json())
    wrong_kwarg["env_kwargs"]["no_such_setting"] = 1
    with pytest.raises(StateError, match="refuses the state's settings"):
        make_from_state(EnvState.from_dict(wrong_kwarg))
