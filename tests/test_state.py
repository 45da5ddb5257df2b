import json

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
