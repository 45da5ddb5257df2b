"""GRPO end to end on the local backend: it learns, it resumes, it plays the env's turns."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agent_gym_train import grpo
from agent_gym_train.cli import register
from agent_gym_train.grpo import Args, parse_args, train
from agent_gym_train.run import run as run_module
from agent_gym_train.run.episode import Episode
from agent_gym_train.run.run import Run
from tests.helpers import grpo_toy

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return grpo_toy.save_tiny_model(tmp_path_factory.mktemp("toy-model"))


def toy_args(model: str, out: Path, **overrides: object) -> Args:
    settings: dict = {
        "env_id": grpo_toy.ENV_ID, "model": model, "lora_rank": 0, "steps": 30,
        "batch_size": 4, "group_size": 8, "learning_rate": 1e-2, "max_turns": 2,
        "max_tokens": 8, "max_trajectory_tokens": 96, "out": str(out), "progress": False,
        "save_every": 100,
    }
    return Args(**(settings | overrides))


def test_grpo_raises_reward_on_a_learnable_task(toy_model: str, tmp_path: Path) -> None:
    history = train(toy_args(toy_model, tmp_path))
    rewards = [row["reward_mean"] for row in history]
    before, after = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert after > before + 0.2, rewards
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(30))
    row = json.loads(lines[-1])
    for key in ("reward_mean", "degenerate_rate", "sampled_tokens", "trained_tokens", "loss",
                "grad_norm", "time_sampler", "time_rollout", "time_train", "end_reasons",
                "cpu_step"):
        assert key in row
    assert row["cpu_step"] > 0  # this process's CPU seconds since the previous line
    assert json.loads((tmp_path / "checkpoint.json").read_text())["step"] == 30


def test_grpo_with_ppo_and_lora(toy_model: str, tmp_path: Path) -> None:
    history = train(toy_args(toy_model, tmp_path, steps=3, loss="ppo", lora_rank=4))
    trained = [row for row in history if row["datums"]]
    assert trained and all(row["loss"] is not None for row in trained)
    assert all(0 <= row["degenerate_rate"] <= 1 for row in history)


@pytest.mark.parametrize("options", [
    {"loss": "cispo"},
    {"loss": "gspo"},
    {"loss": "gspo", "loss_aggregation": "sequence-mean", "clip_low": 0.01, "clip_high": 0.02},
    {"loss": "ppo", "loss_aggregation": "sequence-mean", "clip_high": 0.28},
])
def test_grpo_steps_with_each_loss(toy_model: str, tmp_path: Path, options: dict) -> None:
    history = train(toy_args(toy_model, tmp_path, steps=2, batch_size=2, group_size=4,
                             **options))
    trained = [row for row in history if row["datums"]]
    assert trained and all(row["loss"] is not None and row["grad_norm"] for row in trained)
    custom = options["loss"] == "gspo" or "loss_aggregation" in options
    assert all(("clip_fraction" in row) == custom for row in trained)


def test_dynamic_sampling_refills_degenerate_groups(
    toy_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups of 4 on the toy task are often degenerate (all fail): each step rolls out more
    tasks until 2 groups have a signal, or the cap on extra groups is reached."""
    calls: list[tuple[int, str]] = []
    real = Run.rollouts

    def recording(run: Run, *args: Any, purpose: str = "group", **kwargs: Any
                  ) -> list[list[Episode]]:
        calls.append((len(args[2]), purpose))  # the starts of this call
        return real(run, *args, purpose=purpose, **kwargs)

    monkeypatch.setattr(Run, "rollouts", recording)
    settings = {"batch_size": 2, "group_size": 4}
    history = train(toy_args(toy_model, tmp_path / "dapo", dynamic_sampling=True,
                             max_refill_groups=8, steps=3, **settings))
    for row in history:
        assert row["groups"] == 2 + row["refill_groups"]
        assert row["groups"] - row["degenerate_groups"] == 2, row  # the batch was filled
        assert row["datums"] == 2 * 4
    assert all(row["refill_groups"] for row in history), "every step here needs a refill"
    firsts = [n for n, purpose in calls if purpose == "group"]
    refills = [(n, purpose) for n, purpose in calls if purpose != "group"]
    assert firsts == [2, 2, 2] and all(purpose.startswith("refill-") for _, purpose in refills)
    assert sum(n for n, _ in refills) == sum(row["refill_groups"] for row in history)

    # The cap holds: with 1 extra group the first step stays short of 2 trained groups.
    capped = train(toy_args(toy_model, tmp_path / "capped", dynamic_sampling=True,
                            max_refill_groups=1, steps=1, **settings))[0]
    assert capped["refill_groups"] == 1 and capped["groups"] == 3
    assert capped["groups"] - capped["degenerate_groups"] < 2
    # Off, a step trains what its first draw gave: the same first draw.
    plain = train(toy_args(toy_model, tmp_path / "plain", steps=1, **settings))[0]
    assert plain["refill_groups"] == 0 and plain["groups"] == 2
    assert plain["degenerate_groups"] >= 1 and plain["datums"] < 2 * 4  # what was refilled


def test_resume_after_a_killed_run_matches_an_uninterrupted_one(
    toy_model: str, tmp_path: Path
) -> None:
    argv = [
        "--env-id", f"tests.helpers.grpo_toy:{grpo_toy.ENV_ID}", "--model", toy_model, "--lora-rank", "0",
        "--steps", "24", "--batch-size", "2", "--group-size", "4", "--learning-rate", "1e-2",
        "--max-turns", "2", "--max-tokens", "4", "--max-trajectory-tokens", "64",
        "--save-every", "2", "--no-progress",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    killed_out = tmp_path / "killed"
    command = [sys.executable, "-m", "agent_gym_train.grpo", *argv, "--out", str(killed_out)]
    process = subprocess.Popen(command, env=env, cwd=ROOT, stderr=subprocess.DEVNULL)
    checkpoint = killed_out / "checkpoint.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if checkpoint.is_file() and json.loads(checkpoint.read_text())["step"] >= 4:
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    assert process.wait(timeout=60) == -signal.SIGKILL, "the run ended before it was killed"
    stopped_at = json.loads(checkpoint.read_text())["step"]
    assert stopped_at < 24

    resumed = subprocess.run(command, env=env, cwd=ROOT, timeout=300,
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = [json.loads(line) for line in (killed_out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(24))

    straight = train(parse_args([*argv, "--out", str(tmp_path / "straight")]))
    assert [row["reward_mean"] for row in rows] == [row["reward_mean"] for row in straight]
    # Losses of near-degenerate steps sit at float noise (1e-8): compare them absolutely.
    assert [row["loss"] for row in rows] == pytest.approx([row["loss"] for row in straight],
                                                           abs=1e-6)


def test_grpo_plays_the_envs_own_turn_budget_unless_told_otherwise(
    toy_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Search-v0 allows 6 replies; GRPO without --max-turns gives each episode all 6 (the
    toy model's replies are invalid searches, so episodes run until the env truncates)."""
    budgets: list[int] = []
    real = run_module.rollout_groups

    async def recording(*args: Any, **kwargs: Any) -> list[list[Episode]]:
        budgets.append(args[4].max_turns)
        return await real(*args, **kwargs)

    monkeypatch.setattr(run_module, "rollout_groups", recording)  # as a run's steps call it
    args = parse_args(["--env-id", "agent_gym/Search-v0", "--model", toy_model, "--lora-rank",
                       "0", "--steps", "1", "--batch-size", "1", "--group-size", "4",
                       "--max-tokens", "64", "--out", str(tmp_path / "six"), "--no-progress"])
    assert args.max_turns is None
    row = train(args)[0]
    assert budgets == [6]
    assert "max_turns" not in row["end_reasons"] and row["turns_mean"] > 1
    budgets.clear()
    row = train(dataclasses.replace(args, max_turns=2, out=str(tmp_path / "two")))[0]
    assert budgets == [2]
    assert set(row["end_reasons"]) <= {"max_turns", "max_tokens"} and row["turns_mean"] <= 2


def test_the_last_line_counts_steps_from_one_and_points_only_at_printed_warnings(
    toy_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A group of one is always degenerate, so these runs train nothing: one step warns in
    the last line alone, IDLE_WARNING steps warn first and the last line points there."""
    from agent_gym_train.run.run import IDLE_WARNING

    argv = ["--env-id", grpo_toy.ENV_ID, "--model", toy_model, "--lora-rank", "0",
            "--batch-size", "1", "--group-size", "1", "--max-turns", "2", "--max-tokens",
            "4", "--max-trajectory-tokens", "64", "--no-progress"]
    for steps in (1, IDLE_WARNING):
        assert grpo.main([*argv, "--steps", str(steps), "--out", str(tmp_path / str(steps))]) == 0
        out, err = capsys.readouterr()
        line = json.loads(out.splitlines()[-1])
        assert (line["step"], line["steps"], line["steps_that_trained_nothing"]) == (steps,) * 3
        assert line["warning"].startswith("no step trained anything")
        warned = "trained nothing" in err
        assert warned == (steps == IDLE_WARNING)
        assert ("see the warning above" in line["warning"]) == warned


def test_cli_and_argument_errors() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    parsed = parser.parse_args(["train", "grpo", "--steps", "3", "--help"])
    assert parsed.argv == ["--steps", "3", "--help"]
    with pytest.raises(SystemExit):
        parse_args(["--backend", "nowhere"])
    with pytest.raises(SystemExit):
        parse_args(["--backend", "pytrio", "--lora-rank", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--loss", "dpo"])
    with pytest.raises(SystemExit):
        parse_args(["--group-size", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--loss-aggregation", "mean"])
    with pytest.raises(SystemExit):
        parse_args(["--clip-high", "0.3"])  # importance_sampling clips nothing
    with pytest.raises(SystemExit):
        parse_args(["--dynamic-sampling", "--max-refill-groups", "-1"])
    parsed = parse_args(["--loss", "gspo", "--loss-aggregation", "sequence-mean",
                         "--clip-low", "3e-4", "--clip-high", "4e-4", "--dynamic-sampling"])
    assert (parsed.loss, parsed.loss_aggregation, parsed.clip_low, parsed.clip_high,
            parsed.dynamic_sampling) == ("gspo", "sequence-mean", 3e-4, 4e-4, True)
    assert parse_args(["--env-kwargs", '{"max_turns": 3}']).env_kwargs == {"max_turns": 3}
    assert parse_args(["--max-turns", "3"]).max_turns == 3


def test_tempered_sampling_is_refused() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--temperature", "0.7"])
