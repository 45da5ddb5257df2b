"""`agent-gym train demo`: its three-stage table and its place among the train commands
(the full demo is `make run`, timed in the README)."""

from __future__ import annotations

from agent_gym.eval.stats import wilson_interval
from agent_gym.eval.summary import Summary
from agent_gym_train import sft
from agent_gym_train.cli import COMMANDS
from agent_gym_train.demo import HELD_OUT, Stage, table


def summary(successes: int, episodes: int) -> Summary:
    low, high = wilson_interval(successes, episodes)
    return Summary("agent_gym/Search-v0", "local:smollm2", episodes, 0, successes / episodes,
                   low, high, successes / episodes, 2.0, 30.0, 1.0, 2.0, tasks=episodes)


def test_the_table_shows_counts_intervals_and_each_stage_against_the_one_before() -> None:
    lines = table([Stage("base", summary(0, 100), 90.0),
                   Stage("after SFT", summary(60, 100), 600.0, (0.6, 0.5, 0.7)),
                   Stage("after SFT + GRPO", summary(79, 100), 720.0, (0.19, 0.1, 0.28))]
                  ).splitlines()
    assert lines[1].split() == ["base", "0/100", "0.00", "[0.00,", "0.04]", "1.5m"]
    assert lines[2].split()[2:9] == ["60/100", "0.60", "[0.50,", "0.69]", "+0.60",
                                     "[+0.50,", "+0.70]"]
    assert lines[3].split()[5:8] == ["0.79", "[0.70,", "0.86]"]
    assert HELD_OUT == 100


def test_the_demo_is_a_train_command_and_trains_with_the_sft_preset() -> None:
    assert COMMANDS["demo"][1] == "agent_gym_train.demo"
    assert sft.Args.PRESETS["cpu-demo"]["epochs"] == 1
