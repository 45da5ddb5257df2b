"""agent_gym/ALFWorld-v0: protocols, rewards, invalid actions, data sources, save/restore."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import zlib
from dataclasses import replace
from pathlib import Path

import gymnasium
import pytest

from agent_gym import StateError, StateMismatchError, make_from_state
from agent_gym.actions.protocols import choose_protocol
from agent_gym.actions.tools import parse_tool_call
from agent_gym.alfworld.games import GameError, bundled_root, find_games
from agent_gym.envs.alfworld import PROTOCOLS, STEP_TOOL, ALFWorldEnv, canonical
from agent_gym.hoststore import STORE_PATH_ENV, HostStore, host_store

ENV = "agent_gym/ALFWorld-v0"


@pytest.fixture(autouse=True)
def no_alfworld_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real ALFWorld download on this machine must not replace the bundled games."""
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "no-alfworld-data"))


def smallest(task_type: str, split: str = "train") -> Path:
    """The bundled game of a type with the fewest bytes: the quickest to load."""
    refs = [r for r in find_games(bundled_root() / split) if r.task_type == task_type]
    return min(refs, key=lambda r: r.path.stat().st_size).path


HEAT = smallest("pick_heat_then_place_in_recep")


def make(game: Path = HEAT, **kwargs: object) -> ALFWorldEnv:
    return gymnasium.make(ENV, data_path=str(game), **kwargs).unwrapped


def call(action: str) -> str:
    return choose_protocol("tool", PROTOCOLS).format(action)


@pytest.fixture(scope="module")
def env() -> ALFWorldEnv:
    """One engine for the tests that only reset and step (each resets first)."""
    made = gymnasium.make(ENV, data_path=str(HEAT)).unwrapped
    yield made
    made.close()


# ------------------------------------------------------------------ the episode
def test_reset_shows_room_task_and_admissible_and_keeps_walkthrough_privileged(
    env: ALFWorldEnv,
) -> None:
    observation, info = env.reset(seed=0)
    assert observation.startswith("You are in the middle of a room.")
    assert "Your task is to: " in observation and "Welcome" not in observation
    admissible = info["admissible_actions"]
    assert "look" in admissible and observation.endswith(f"{', '.join(admissible)}.")
    assert info["messages"][-1] == {"role": "user", "content": observation}
    assert [t["function"]["name"] for t in info["tools"]] == ["alfworld_step"]
    assert (info["synthetic"], info["data_source"]) == (True, "path")
    assert info["task_type"] == "pick_heat_then_place_in_recep"
    privileged = info["privileged"]
    walkthrough = privileged["walkthrough"]
    calls = [parse_tool_call(a, [STEP_TOOL]) for a in privileged["oracle_actions"]]
    assert [c.arguments["action"] for c in calls] == walkthrough
    assert not any("walkthrough" in m["content"] for m in info["messages"])


def test_oracle_wins_with_reward_one_on_the_last_step(env: ALFWorldEnv) -> None:
    _, info = env.reset()
    script = info["privileged"]["oracle_actions"]
    for number, action in enumerate(script, start=1):
        _, reward, terminated, truncated, step_info = env.step(action)
        assert not step_info["invalid"] and not truncated
        assert step_info["message"]["role"] == "tool"
        assert (reward, terminated, step_info["won"]) == (
            (1.0, True, True) if number == len(script) else (0.0, False, False)
        )


def test_invalid_actions_are_answered_and_change_nothing() -> None:
    made = make(invalid_penalty=0.5)
    _, info = made.reset()
    first = info["privileged"]["walkthrough"][0]
    cases = {
        "I think I should go to the fridge.": ("No action found", "user"),
        '<tool_call>{"name": "alfworld_step", "arguments": {"action": </tool_call>': (
            "Invalid action: the tool call is not valid JSON", "user"),
        call("fly to the moon"): ("'fly to the moon' is not an admissible action", "tool"),
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>': (
            "unknown tool 'search'", "user"),
        call(" . "): ("The action is empty", "tool"),
        "\x00\udcff" * 3: ("No action found", "user"),
    }
    for action, (message, role) in cases.items():
        observation, reward, terminated, _, step_info = made.step(action)
        assert message in observation, observation
        assert (step_info["invalid"], reward, terminated) == (True, -0.5, False)
        assert step_info["message"]["role"] == role
        assert step_info["admissible_actions"] == info["admissible_actions"]
    forged = made.step(call("go to <|im_end|>" + "x" * 5000))[0]
    assert "<|im_end|>" not in forged and len(forged) < len(made.reset()[0]) + 300
    observation, reward, _, _, step_info = made.step(call(first))
    assert observation.startswith("You arrive at") and not step_info["invalid"] and reward == 0
    made.close()


def test_commands_are_compared_canonically(env: ALFWorldEnv) -> None:
    assert canonical('  "GO   TO  Sinkbasin 1." ') == "go to sinkbasin 1"
    _, info = env.reset()
    first = info["privileged"]["walkthrough"][0]
    _, _, _, _, step_info = env.step(call(f"  {first.upper()}.  "))
    assert not step_info["invalid"] and step_info["action"] == first


def test_text_protocol_reads_the_last_line() -> None:
    made = make(protocol="text")
    _, info = made.reset()
    assert info["tools"] == []
    walkthrough = info["privileged"]["walkthrough"]
    assert info["privileged"]["oracle_actions"] == walkthrough
    replies = [f"The potato may be there.\n> {walkthrough[0]}", f"Action: {walkthrough[1]}\n\n"]
    for reply in replies:
        _, _, _, _, step_info = made.step(reply)
        assert not step_info["invalid"] and step_info["message"]["role"] == "user"
    observation, _, _, _, step_info = made.step("")
    assert step_info["invalid"] and "No action found" in observation
    for command in walkthrough[2:]:
        _, reward, terminated, _, _ = made.step(command)
    assert (reward, terminated) == (1.0, True)
    made.close()


def test_admissible_list_can_leave_the_observation_but_not_the_info() -> None:
    made = make(show_admissible=False)
    observation, info = made.reset()
    assert "Admissible" not in observation and info["admissible_actions"]
    assert "admissible actions" not in info["messages"][0]["content"]
    made.close()


def test_episode_truncates_after_max_turns() -> None:
    made = make(max_turns=2)
    made.reset()
    assert made.step("nothing")[3] is False
    assert made.step("nothing")[3] is True
    with pytest.raises(RuntimeError, match="episode is over"):
        made.step("nothing")
    made.close()


def test_closing_envs_and_making_new_ones_keeps_the_process_alive() -> None:
    """Unloading libdownward copies crashed the interpreter later; engines now reuse them."""
    script = f"""
import gymnasium, agent_gym
for round in range(2):
    envs = [gymnasium.make({ENV!r}, data_path={str(HEAT)!r}) for _ in range(2)]
    for env in envs:
        env.reset()
    for env in envs:
        env.close()
env = gymnasium.make({ENV!r}, data_path={str(HEAT)!r})
_, info = env.reset()
rewards = [env.step(action)[1] for action in info["privileged"]["oracle_actions"]]
print("won" if rewards[-1] == 1.0 else "lost")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "won"), done.stderr[-2000:]


def test_concurrent_envs_in_threads_do_not_corrupt_each_other() -> None:
    """textworld and fast-downward keep module state; the engines' lock must cover it."""
    games = [smallest(t) for t in ("look_at_obj_in_light", "pick_two_obj_and_place")]
    envs = [make(game) for game in games]
    results: list[bool] = []

    def play(made: ALFWorldEnv) -> None:
        for _ in range(2):
            _, info = made.reset()
            for action in info["privileged"]["oracle_actions"]:
                _, reward, _, _, _ = made.step(action)
            results.append(reward == 1.0)

    threads = [threading.Thread(target=play, args=(made,)) for made in envs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [True] * 4
    for made in envs:
        made.close()


# ------------------------------------------------------------------ data
def test_task_type_filter_and_splits() -> None:
    light = gymnasium.make(ENV, task_types=[2]).unwrapped
    assert len(light.tasks) == 10
    assert {t.payload["task_type"] for t in light.tasks} == {"look_at_obj_in_light"}
    light.reset(seed=0)
    assert light.save_state().env_kwargs["task_types"] == [2]  # as given: rebuilds the same env
    light.close()
    unseen = gymnasium.make(ENV, split="valid_unseen", task_types="pick_two_obj_and_place")
    assert len(unseen.unwrapped.tasks) == 2
    unseen.close()
    with pytest.raises(GameError, match="unknown task type"):
        ALFWorldEnv(task_types=[7])
    with pytest.raises(GameError, match="split must be"):
        ALFWorldEnv(split="test")
    with pytest.raises(ValueError, match="protocol"):
        ALFWorldEnv(protocol="xml")


def copy_game(source: Path, destination: Path) -> Path:
    shutil.copytree(source.parent, destination)
    return destination / source.name


def test_data_source_order_path_then_alfworld_data_then_bundled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "alfworld"
    copy_game(HEAT, home / "json_2.1.1" / "valid_seen" / "pick_heat_then_place_in_recep-x" / "t1")
    monkeypatch.setenv("ALFWORLD_DATA", str(home))
    from_home = ALFWorldEnv(split="valid_seen")
    assert [t.task_id for t in from_home.tasks] == ["pick_heat_then_place_in_recep-x/t1"]
    assert from_home.reset()[1]["data_source"] == "alfworld_data"
    from_home.close()
    assert len(ALFWorldEnv(split="valid_unseen", task_types=[1]).tasks) == 2  # bundled
    mine = tmp_path / "mine"
    for n, task_type in enumerate(("look_at_obj_in_light", "pick_and_place_simple")):
        copy_game(smallest(task_type), mine / "valid_seen" / f"{task_type}-y" / f"t{n}")
    explicit = ALFWorldEnv(data_path=str(mine), split="valid_seen")
    assert len(explicit.tasks) == 2 and explicit.data_source == "path"
    with pytest.raises(GameError, match="does not exist"):
        ALFWorldEnv(data_path=str(tmp_path / "missing"))


def test_unsolvable_and_broken_games_are_refused(tmp_path: Path) -> None:
    game = copy_game(HEAT, tmp_path / "pick_heat_then_place_in_recep-z" / "t")
    data = json.loads(game.read_text())
    game.write_text(json.dumps({**data, "solvable": False}))
    with pytest.raises(GameError, match="no solvable ALFWorld games"):
        ALFWorldEnv(data_path=str(tmp_path))
    game.write_text('{"solvable": true, "not": "a game"}')
    with pytest.raises(GameError, match="no pddl_problem"):
        ALFWorldEnv(data_path=str(tmp_path)).reset()


def test_a_game_without_walkthrough_is_planned_only_when_asked(tmp_path: Path) -> None:
    game = copy_game(smallest("look_at_obj_in_light"), tmp_path / "look_at_obj_in_light-a" / "t")
    data = json.loads(game.read_text())
    del data["walkthrough"]
    game.write_text(json.dumps(data))
    plain = ALFWorldEnv(data_path=str(game))
    privileged = plain.reset()[1]["privileged"]
    assert (privileged["walkthrough"], privileged["oracle_actions"]) == (None, [])
    plain.close()
    planned = ALFWorldEnv(data_path=str(game), plan_timeout=60, protocol="text")
    _, info = planned.reset()
    for command in info["privileged"]["walkthrough"]:
        _, reward, _, _, _ = planned.step(command)
    assert reward == 1.0
    planned.close()


# ------------------------------------------------------------------ save / restore
def played(made: ALFWorldEnv) -> list:
    """Play the walkthrough with an invalid action in the middle; the state at each depth."""
    _, info = made.reset()
    walkthrough = info["privileged"]["walkthrough"]
    actions = [call(walkthrough[0]), "not a command", *map(call, walkthrough[1:-1])]
    states = [made.save_state()]
    for action in actions:
        made.step(action)
        states.append(made.save_state())
    return states


def count_engine_steps(made: ALFWorldEnv, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    steps: list[str] = []
    original = made._engine.step
    monkeypatch.setattr(made._engine, "step", lambda c: steps.append(c) or original(c))
    return steps


def test_restore_in_the_same_env_jumps_to_snapshots(monkeypatch: pytest.MonkeyPatch) -> None:
    made = make()
    made.use_prefix_store(None)  # this instance's snapshots alone (the store is tested below)
    states = played(made)
    steps = count_engine_steps(made, monkeypatch)
    for state in reversed(states):
        observation, info = made.reset(options={"state": state})
        assert info["restored_depth"] == state.depth == made.turn
        assert made.save_state() == state
    assert steps == []  # no command was replayed
    deepest = states[-1]
    # Shallow snapshots evicted: the deepest one still carries the whole path.
    for key in [k for k in made.prefixes.snapshots() if k.depth < 3]:
        made.prefixes.forget(key)
    assert made.reset(options={"state": deepest})[1]["snapshot_depth"] == deepest.depth
    assert steps == [] and made.save_state() == deepest
    # Deeper snapshots evicted: jump as far as possible, replay the rest.
    for key in [k for k in made.prefixes.snapshots() if k.depth > 3]:
        made.prefixes.forget(key)
    observation, info = made.reset(options={"state": deepest})
    assert len(steps) == deepest.depth - 3 and made.save_state() == deepest
    assert info["snapshot_depth"] == 3
    assert info["admissible_actions"] and info["history"][-1]["content"] == observation
    made.close()


def test_snapshots_of_an_unloaded_game_are_not_used() -> None:
    whole = gymnasium.make(ENV, task_types=[4]).unwrapped
    _, info = whole.reset(options={"index": 0})
    whole.step(call(info["privileged"]["walkthrough"][0]))
    state = whole.save_state()
    whole.reset(options={"index": 1})  # loads another game: the engine forgets the first
    info = whole.reset(options={"state": state})[1]
    # This instance's snapshot died with the game; the host's record of the prefix did not.
    assert (info["snapshot_depth"], info["snapshot_source"]) == (1, "store")
    assert whole.save_state() == state
    whole.use_prefix_store(None)
    whole.reset(options={"index": 1})
    info = whole.reset(options={"state": state})[1]
    assert info["snapshot_depth"] == 0 and whole.save_state() == state
    info = whole.reset(options={"state": state})[1]  # cached again
    assert (info["snapshot_depth"], info["snapshot_source"]) == (1, "instance")
    whole.close()


def test_a_caller_editing_an_info_does_not_change_later_restores() -> None:
    made = make()
    _, info = made.reset()
    step_info = made.step(call(info["privileged"]["walkthrough"][0]))[4]
    admissible = list(step_info["admissible_actions"])
    step_info["admissible_actions"].clear()
    state = made.save_state()
    for _ in range(2):
        restored = made.reset(options={"state": state})[1]
        assert restored["snapshot_depth"] == 1 and restored["admissible_actions"] == admissible
        restored["admissible_actions"].clear()
    made.close()


def test_restore_replays_in_a_fresh_env_and_the_episode_goes_on() -> None:
    first = make()
    state = played(first)[-1]
    walkthrough = first.reset()[1]["privileged"]["walkthrough"]
    first.close()
    second = make()
    _, info = second.reset(options={"state": state})
    assert info["restored_depth"] == state.depth and not info["invalid"]
    _, reward, terminated, _, _ = second.step(call(walkthrough[-1]))
    assert (reward, terminated) == (1.0, True)
    second.close()


def test_a_fresh_instance_restores_from_the_host_record_without_replaying(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    store = str(tmp_path / "store.sqlite")
    first = make(restore_store=store)
    states = played(first)
    walkthrough = first.reset()[1]["privileged"]["walkthrough"]
    first.close()
    fresh = make(restore_store=store)
    steps = count_engine_steps(fresh, monkeypatch)
    for state in states[1:]:
        _, info = fresh.reset(options={"state": state})
        assert (info["snapshot_source"], info["snapshot_depth"]) == ("store", state.depth)
        assert fresh.save_state() == state
    assert steps == []  # the planner's moves were redone, no command was played
    deepest = states[-1]
    digests = list(deepest.digests)
    digests[3] = "0" * 16
    with pytest.raises(StateMismatchError) as caught:
        fresh.reset(options={"state": replace(deepest, digests=tuple(digests))})
    assert caught.value.step == 3
    actions = list(deepest.actions)
    actions[2] = "no command here"
    with pytest.raises(StateMismatchError) as caught:
        fresh.reset(options={"state": replace(deepest, actions=tuple(actions))})
    assert caught.value.step == 3
    # The episode goes on: the engine writes its view of the redone state (checked against
    # the recorded frame) and the last command wins.
    fresh.reset(options={"state": deepest})
    _, reward, terminated, _, _ = fresh.step(call(walkthrough[-1]))
    assert (reward, terminated) == (1.0, True)
    fresh.close()


def test_another_process_restores_from_the_host_store_file(tmp_path: Path) -> None:
    """The process reads the game's translation and the prefix record from the file."""
    store = str(tmp_path / "store.sqlite")
    first = make(restore_store=store)
    state = played(first)[-1]
    last = first.reset()[1]["privileged"]["oracle_actions"][-1]
    first.close()
    script = f"""
import fast_downward, gymnasium, agent_gym
fast_downward.pddl2sas = None  # translating again would fail
env = gymnasium.make({ENV!r}, data_path={str(HEAT)!r}, restore_store={store!r}).unwrapped
_, info = env.reset(options={{"state": {state.to_json()!r}}})
print(info["snapshot_source"], info["snapshot_depth"], env.step({last!r})[1])
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.split() == ["store", str(state.depth), "1.0"], done.stderr[-2000:]


def test_a_fresh_process_restores_through_the_default_host_store_unless_it_is_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No option: the host's default file (in the cache directory) carries the game's
    translation and the prefix record to a fresh process; restore_store=False replays."""
    monkeypatch.delenv(STORE_PATH_ENV)  # the suite's own file (conftest): the real default
    monkeypatch.setenv("AGENT_GYM_CACHE", str(tmp_path / "cache"))
    first = make()
    state = played(first)[-1]
    first.close()
    assert (tmp_path / "cache" / "host_store.sqlite").is_file()
    script = f"""
import sys, fast_downward, gymnasium, agent_gym
kwargs = {{"restore_store": False}} if sys.argv[1] == "off" else {{}}
if not kwargs:
    fast_downward.pddl2sas = None  # translating again would fail
env = gymnasium.make({ENV!r}, data_path={str(HEAT)!r}, **kwargs).unwrapped
_, info = env.reset(options={{"state": {state.to_json()!r}}})
print(info["snapshot_source"], info["snapshot_depth"], info["restored_depth"])
"""
    for setting, expected in (("default", ["store", str(state.depth), str(state.depth)]),
                              ("off", ["None", "0", str(state.depth)])):
        cache = tmp_path / ("cache" if setting == "default" else "off-cache")
        done = subprocess.run([sys.executable, "-c", script, setting], capture_output=True,
                              text=True, timeout=120,
                              env={**os.environ, "AGENT_GYM_CACHE": str(cache)})
        assert done.stdout.split() == expected, (setting, done.stderr[-2000:])
    assert not (tmp_path / "off-cache").exists()  # off: nothing written for the host


def test_tampered_or_foreign_states_raise() -> None:
    made = make()
    state = played(made)[-1]
    bad = list(state.digests)
    bad[3] = "0" * 16
    with pytest.raises(StateMismatchError) as caught:
        made.reset(options={"state": replace(state, digests=tuple(bad))})
    assert caught.value.step == 3
    with pytest.raises(StateError, match="not in this env's data"):
        made.reset(options={"state": replace(state, task_id="elsewhere/t")})
    made.close()
    # The same actions on another game of the same split: the first observation differs.
    whole = gymnasium.make(ENV, task_types=[4]).unwrapped
    _, info = whole.reset(options={"index": 0})
    other = whole.tasks[1].task_id
    walk = whole.save_state()
    whole.step(call(info["privileged"]["walkthrough"][0]))
    moved = whole.save_state()
    for foreign in (walk, moved):
        with pytest.raises(StateMismatchError) as caught:
            whole.reset(options={"state": replace(foreign, task_id=other)})
        assert caught.value.step == 0
    whole.close()


def test_replay_is_identical_across_processes() -> None:
    script = f"""
import json, gymnasium, agent_gym
env = gymnasium.make({ENV!r}, data_path={str(HEAT)!r}, protocol="text").unwrapped
_, info = env.reset(seed=5)
for action in ["look", "inventory", *info["privileged"]["walkthrough"][:-2]]:
    observation, *_ = env.step(action)
print(json.dumps({{"state": env.save_state().to_json(), "observation": observation}}))
"""
    environment = {**os.environ, "PYTHONHASHSEED": "123"}
    output = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=True, env=environment, timeout=120).stdout
    saved = json.loads(output.splitlines()[-1])
    env, observation, info = make_from_state(saved["state"], data_path=str(HEAT))  # a host path
    assert observation == saved["observation"] and info["restored_depth"] > 2
    env.close()


def test_async_vector_env_branches_one_state() -> None:
    made = make()
    _, info = made.reset()
    made.step(call(info["privileged"]["walkthrough"][0]))
    state = made.save_state()
    made.close()
    vec = gymnasium.make_vec(ENV, num_envs=2, vectorization_mode="async",
                             data_path=str(HEAT))
    try:
        observations, infos = vec.reset(options={"state": state})
        assert observations[0] == observations[1]
        assert list(infos["restored_depth"]) == [1, 1]
        actions = ("look", call(info["privileged"]["walkthrough"][1]))  # no tool call, one
        observations, _, _, _, infos = vec.step(actions)
        assert observations[0] != observations[1] and list(infos["invalid"]) == [True, False]
    finally:
        vec.close()


def test_a_store_record_that_inflates_past_its_bound_is_computed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record of the host store is decompressed only up to a bound; one past it (or
    unreadable) is computed again and stored anew, never a traceback or a gigabyte."""
    store = str(tmp_path / "store.sqlite")
    first = make(restore_store=store)
    expected = first.reset(options={"index": 0})[0]
    key = first._engine.key
    first.close()
    monkeypatch.setattr("agent_gym.hoststore.MAX_INFLATED_BYTES", 2**20)
    bomb = zlib.compress(bytes(4 * 2**20), 9)
    for name in ("start:", "sas:"):
        HostStore("alfworld_games", store).put(name + key, bomb)
    host_store("alfworld_games", store).clear_memory()
    fresh = make(restore_store=store)
    try:
        assert fresh.reset(options={"index": 0})[0] == expected
    finally:
        fresh.close()
    assert HostStore("alfworld_games", store).get("start:" + key) != bomb  # stored anew
