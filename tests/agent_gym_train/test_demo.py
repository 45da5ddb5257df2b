"""`agent-gym train demo`: its three-stage table and its place among the train commands
(the full demo is `make run`, timed in the README)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from agent_gym.eval.runs import read_run
from agent_gym.eval.stats import wilson_interval
from agent_gym.eval.summary import Summary
from agent_gym_train import sft
from agent_gym_train.backends.runtime import native_bf16
from agent_gym_train.cli import COMMANDS
from agent_gym_train.demo import HELD_OUT, HeldOut, Players, Stage, grpo_recipe, table


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


def test_grpo_is_the_demos_recipe_on_the_players_sampler(tmp_path: Path) -> None:
    """The benchmark of the same recipe (benchmarks/bench_search_rl.py) builds its runs here
    too: 4 tasks x 8 branches at lr 1e-4 with the mixed task sampler; the local sampler
    reads a bfloat16 copy where the CPU has bf16 units, and so trains truncated."""
    players = Players(tmp_path, argparse.Namespace(sampler="local", device="cpu", threads=1,
                                                   progress=False))
    args = grpo_recipe(tmp_path / "sft", tmp_path / "grpo", 3, players, seed=2)
    assert (args.batch_size, args.group_size, args.task_sampler, args.steps, args.seed) == (
        4, 8, "mixed", 3, 2)
    assert args.learning_rate == pytest.approx(1e-4)  # the value given, not a computed one
    assert (args.init_from, args.sampler, args.vllm_url) == (str(tmp_path / "sft"), "local", None)
    assert args.sampler_precision == (
        "bfloat16" if native_bf16(torch.device("cpu")) else "float32")


def test_the_players_play_the_held_out_set_they_are_given(tmp_path: Path) -> None:
    """benchmarks/bench_alfworld_sft.py plays ALFWorld's test games through the same players:
    the env, its kwargs and the reply length are the given set's, recorded with the run."""
    test = HeldOut("agent_gym/GSM8K-v0", {"max_turns": 1}, 4)
    players = Players(tmp_path, argparse.Namespace(sampler="local", device="cpu", threads=1,
                                                   progress=False), test)
    summary, _ = players.held_out(None, tmp_path / "eval", 2)
    config = read_run(tmp_path / "eval").config
    assert (config.env_id, config.env_kwargs, config.max_tokens, summary.tasks) == (
        "agent_gym/GSM8K-v0", {"max_turns": 1}, 4, 2)
