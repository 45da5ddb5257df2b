"""Which tasks a step draws (agent_gym_train.tasks): uniformly as before, or preferring the
tasks whose recent groups had mixed outcomes; rebuilt exactly by a continued run."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from agent_gym_train.grpo import train
from agent_gym_train.tasks import FLOOR, TaskSampler
from tests.agent_gym_train.test_grpo import toy_args, toy_model  # noqa: F401 (a fixture)


def test_uniform_draws_what_runs_drew_before() -> None:
    want = np.random.default_rng([0, 3]).choice(50, size=4, replace=False)
    got = TaskSampler(50).draw(np.random.default_rng([0, 3]), 4)
    assert got == [{"index": int(i)} for i in want]


def test_mixed_prefers_tasks_whose_groups_taught_something() -> None:
    sampler = TaskSampler(3, "mixed")
    for _ in range(6):  # only the last 4 are remembered
        sampler.record([{"index": 0}, {"index": 1}], [True, False])
    assert sampler.weights() == pytest.approx([5 / 6, max(FLOOR, 1 / 6), 0.5])
    counts = Counter(task["index"] for step in range(300)
                     for task in sampler.draw(np.random.default_rng(step), 1))
    assert counts[0] > counts[2] > counts[1] > 0  # taught > untried > all-or-nothing
    with pytest.raises(ValueError, match="not one of"):
        TaskSampler(3, "hardest")


def test_a_continued_run_rebuilds_the_sampler_from_its_metrics_lines() -> None:
    live = TaskSampler(10, "mixed")
    rows = [{"step": s, "task_outcomes": live.record(
        [{"index": s % 10}, {"index": (3 * s) % 10}], [s % 2 == 0, s % 3 == 0])}
        for s in range(12)]
    rebuilt = TaskSampler.from_metrics(10, "mixed", rows)
    assert rebuilt.outcomes == live.outcomes
    assert rebuilt.draw(np.random.default_rng(1), 3) == live.draw(np.random.default_rng(1), 3)


def test_grpo_with_the_mixed_sampler_continues_as_if_never_stopped(
    toy_model: str, tmp_path: Path  # noqa: F811
) -> None:
    settings = {"batch_size": 2, "group_size": 4, "task_sampler": "mixed", "save_every": 1}
    straight = train(toy_args(toy_model, tmp_path / "straight", steps=6, **settings))
    train(toy_args(toy_model, tmp_path / "stopped", steps=3, **settings))
    train(toy_args(toy_model, tmp_path / "stopped", steps=6, **settings))
    lines = (tmp_path / "stopped" / "metrics.jsonl").read_text().splitlines()
    continued = [json.loads(line) for line in lines]
    assert [r["task_outcomes"] for r in continued] == [r["task_outcomes"] for r in straight]
    assert all(len(r["task_outcomes"]) >= 1 for r in straight)
