"""`agent-gym train demo`: its before/after table and its place among the train commands
(the full demo is `make run`, timed in the README)."""

from __future__ import annotations

from agent_gym.eval.stats import wilson_interval
from agent_gym.eval.summary import Summary
from agent_gym_train import sft
from agent_gym_train.cli import COMMANDS
from agent_gym_train.demo import table


def summary(successes: int, episodes: int) -> Summary:
    low, high = wilson_interval(successes, episodes)
    return Summary("agent_gym/Search-v0", "local:smollm2", episodes, 0, successes / episodes,
                   low, high, successes / episodes, 2.0, 30.0, 1.0, 2.0)


def test_the_table_shows_counts_wilson_intervals_and_nll() -> None:
    lines = table([("base", summary(0, 18), 2.034), ("after SFT", summary(10, 18), 0.076)])
    lines = lines.splitlines()
    assert lines[1].split()[:5] == ["base", "0/18", "0.00", "[0.00,", "0.18]"]
    assert lines[2].split()[2:7] == ["10/18", "0.56", "[0.34,", "0.75]", "0.076"]


def test_the_demo_is_a_train_command_and_trains_with_the_sft_preset() -> None:
    assert COMMANDS["demo"][1] == "agent_gym_train.demo"
    assert sft.Args.PRESETS["cpu-demo"]["epochs"] == 1
