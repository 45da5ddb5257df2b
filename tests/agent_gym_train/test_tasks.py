"""Which tasks a step draws (agent_gym_train.run.tasks): uniformly as before, or preferring the
tasks whose recent groups had mixed outcomes; a mixture's parts by their weights; rebuilt
exactly by a continued run."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from agent_gym.env import EnvPart
from agent_gym_train.grpo import train
from agent_gym_train.run.files import Metrics, RunConfigError
from agent_gym_train.run.tasks import FLOOR, TaskSampler
from tests.agent_gym_train.test_grpo import toy_args, toy_model  # noqa: F401 (a fixture)
from tests.helpers.grpo_toy import DIGITS, ENV_ID


def test_uniform_draws_what_runs_drew_before() -> None:
    want = np.random.default_rng([0, 3]).choice(50, size=4, replace=False)
    got = TaskSampler(50).draw(np.random.default_rng([0, 3]), 4)
    assert got == [{"index": int(i)} for i in want]


def test_mixed_prefers_tasks_whose_groups_taught_something() -> None:
    sampler = TaskSampler(3, "mixed")
    for _ in range(6):  # only the last 4 are remembered
        sampler.record([{"index": 0}, {"index": 1}], [True, False])
    # each task's share is 1/3; task 2, never drawn, takes the part's odds: 6 of 12 mixed
    assert sampler.weights() * 3 == pytest.approx([5 / 6, max(FLOOR, 1 / 6), 7 / 14])
    counts = Counter(task["index"] for step in range(300)
                     for task in sampler.draw(np.random.default_rng(step), 1))
    assert counts[0] > counts[2] > counts[1] > 0  # taught > untried > all-or-nothing
    with pytest.raises(ValueError, match="not one of"):
        TaskSampler(3, "hardest")


def test_a_task_found_all_or_nothing_ranks_below_an_untried_one_when_few_groups_teach(
) -> None:
    sampler = TaskSampler(10, "mixed")
    sampler.record([{"index": i} for i in range(7)], [True] + [False] * 6)
    part = (1 + 1) / (7 + 2)  # the part's odds: 1 mixed group of 7
    weights = sampler.weights() * 10
    assert weights[7] == pytest.approx(part)  # never drawn
    assert weights[0] == pytest.approx((1 + 2 * part) / 3)
    assert weights[1] == pytest.approx(2 * part / 3)
    assert weights[0] > weights[7] > weights[1]


def test_a_continued_run_rebuilds_the_sampler_from_its_metrics_lines() -> None:
    live = TaskSampler(10, "mixed")
    rows = [{"step": s, "task_outcomes": live.record(
        [{"index": s % 10}, {"index": (3 * s) % 10}], [s % 2 == 0, s % 3 == 0])}
        for s in range(12)]
    rebuilt = TaskSampler.from_metrics(10, "mixed", rows)
    assert rebuilt.outcomes == live.outcomes
    assert rebuilt.draw(np.random.default_rng(1), 3) == live.draw(np.random.default_rng(1), 3)


@pytest.mark.parametrize("index", ["10", "-1", "x", "1.5", "\u00b2"])
def test_metrics_naming_a_task_the_env_lacks_are_refused(index: str) -> None:
    with pytest.raises(RunConfigError, match="metrics line of step 0: task index"):
        TaskSampler.from_metrics(10, "mixed", [{"step": 0, "task_outcomes": {index: 1}}])


@pytest.mark.parametrize("outcome", ["0", "no", 5, 0.5, None, [1]])
def test_an_outcome_other_than_true_false_one_or_zero_is_refused_not_read_as_mixed(
        outcome: object) -> None:
    with pytest.raises(RunConfigError, match="metrics line of step 3: a group's outcome"):
        TaskSampler.from_metrics(10, "mixed", [{"step": 3, "task_outcomes": {"2": outcome}}])
    with pytest.raises(ValueError, match="a group's outcome"):
        TaskSampler(10, "mixed").record([{"index": 2}], [outcome])  # type: ignore[list-item]


def test_outcomes_stored_as_one_and_zero_read_back_as_mixed_and_not() -> None:
    rebuilt = TaskSampler.from_metrics(10, "mixed", [
        {"step": 0, "task_outcomes": {"2": 1, "3": 0}},
        {"step": 1, "task_outcomes": {"2": True, "3": False}}])
    assert {index: list(seen) for index, seen in rebuilt.outcomes.items()} == {
        2: [True, True], 3: [False, False]}


@pytest.mark.parametrize("part", [EnvPart(0, 1.0), EnvPart(5, 0.0), EnvPart(5, float("nan"))])
def test_parts_without_tasks_or_weight_are_refused(part: EnvPart) -> None:
    with pytest.raises(ValueError, match="needs tasks and a positive weight"):
        TaskSampler(10, "uniform", (EnvPart(10 - part.num_tasks, 1.0), part))


def test_grpo_with_the_mixed_sampler_continues_as_if_never_stopped(
    toy_model: str, tmp_path: Path  # noqa: F811
) -> None:
    straight, continued = straight_and_continued(toy_model, tmp_path, {})
    assert [r["task_outcomes"] for r in continued] == [r["task_outcomes"] for r in straight]
    assert all(len(r["task_outcomes"]) >= 1 for r in straight)


def straight_and_continued(model: str, tmp_path: Path, settings: dict[str, object]
                           ) -> tuple[list[Metrics], list[Metrics]]:
    """The metrics of a 6-step GRPO run with the mixed sampler, and of the same run stopped
    after 3 steps and continued."""
    settings = {"batch_size": 2, "group_size": 4, "task_sampler": "mixed", "save_every": 1,
                **settings}
    straight = train(toy_args(model, tmp_path / "straight", steps=6, **settings))
    train(toy_args(model, tmp_path / "stopped", steps=3, **settings))
    train(toy_args(model, tmp_path / "stopped", steps=6, **settings))
    lines = (tmp_path / "stopped" / "metrics.jsonl").read_text().splitlines()
    return straight, [json.loads(line) for line in lines]


def test_uniform_gives_each_part_its_weight_whatever_its_size() -> None:
    sampler = TaskSampler(100, "uniform", (EnvPart(90, 1.0), EnvPart(10, 3.0)))
    drawn = [task["index"] for step in range(200)
             for task in sampler.draw(np.random.default_rng(step), 2)]
    assert 0.68 < sum(i >= 90 for i in drawn) / len(drawn) < 0.82  # 3 / (1 + 3)
    with pytest.raises(ValueError, match="hold 12 tasks, not 13"):
        TaskSampler(13, "uniform", (EnvPart(2, 1.0), EnvPart(10, 1.0)))


def test_mixed_moves_the_share_of_a_part_without_signal_to_one_with_it() -> None:
    sampler = TaskSampler(1000, "mixed", (EnvPart(500, 1.0), EnvPart(500, 1.0)))
    for step in range(8):  # part 0's groups are all-or-nothing, part 1's mixed
        sampler.record([{"index": step}, {"index": 500 + step}], [False, True])
    weights = sampler.weights()
    untried_0, untried_1 = weights[100], weights[600]  # tasks never drawn: their part's odds
    assert untried_0 * 500 == pytest.approx(0.5 * 1 / 10)  # (0 + 1) / (8 + 2) of its half
    assert untried_1 * 500 == pytest.approx(0.5 * 9 / 10)
    share_1 = weights[500:].sum() / weights.sum()
    assert share_1 > 0.85
    rebuilt = TaskSampler.from_metrics(
        1000, "mixed", [{"task_outcomes": {str(s): 0, str(500 + s): 1}} for s in range(8)],
        (EnvPart(500, 1.0), EnvPart(500, 1.0)))
    assert rebuilt.weights() == pytest.approx(weights)


def test_grpo_over_a_mixture_draws_both_members_and_continues_as_if_never_stopped(
    toy_model: str, tmp_path: Path  # noqa: F811
) -> None:
    members = [{"env_id": ENV_ID, "env_kwargs": {"max_turns": 2}, "weight": 3},
               {"env_id": ENV_ID, "env_kwargs": {"max_turns": 1}}]
    straight, continued = straight_and_continued(toy_model, tmp_path, {
        "env_id": "agent_gym/Mixture-v0", "env_kwargs": {"members": members}})
    assert [r["task_outcomes"] for r in continued] == [r["task_outcomes"] for r in straight]
    assert [r["datums_digest"] for r in continued] == [r["datums_digest"] for r in straight]
    drawn = {int(i) for r in straight for i in r["task_outcomes"]}
    assert min(drawn) < len(DIGITS) <= max(drawn)  # tasks of both members were played
