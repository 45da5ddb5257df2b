"""Rollouts per task, pass@k and the run identity of ``agent-gym eval``."""

import asyncio
import json
import math
from fractions import Fraction
from pathlib import Path

import pytest

from agent_gym.cli.main import main
from agent_gym.eval.config import EvalConfig, episode_seed
from agent_gym.eval.policies import PolicyInput, Reply
from agent_gym.eval.run import evaluate
from agent_gym.eval.runlog import RunMismatchError
from agent_gym.eval.stats import pass_at_k, wilson_interval
from agent_gym.eval.summary import summarize
from tests.helpers.eval_runs import GSM8K, read_episodes


def test_pass_at_k_matches_hand_computed_values() -> None:
    # 1 - C(n-c, k) / C(n, k), worked by hand.
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # C(3,2)=3, C(5,2)=10
    assert pass_at_k(4, 1, 3) == pytest.approx(1 - 1 / 4)  # C(3,3)=1, C(4,3)=4
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the success rate
    assert pass_at_k(6, 2, 3) == pytest.approx(1 - 4 / 20)  # C(4,3)=4, C(6,3)=20
    assert pass_at_k(3, 0, 2) == 0.0
    assert pass_at_k(2, 1, 2) == 1.0  # fewer failures than draws: a success is certain
    assert pass_at_k(3, 3, 1) == 1.0
    # Stable where the binomials do not fit a float: compare with exact rationals.
    n, c, k = 2000, 7, 900
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)


class ByRollout:
    """GSM8K's oracle answer on rollouts below the episode index, a wrong one otherwise:
    task i succeeds on i of its rollouts."""

    name = "by-rollout"

    def __init__(self) -> None:
        self.played: list[tuple[int, int]] = []

    async def act(self, observation: PolicyInput) -> Reply:
        episode = observation.info["episode"]
        self.played.append((episode, observation.rollout))
        if observation.rollout < episode:
            return Reply(observation.privileged["oracle_actions"][0])
        return Reply("\\boxed{-12345}")


async def _run(config: EvalConfig, policy: ByRollout, out: Path) -> object:
    # The episode index reaches the policy through its seed: rollout 0 of episode i has
    # seed config.seed + i, later ones derived seeds.
    seeds = {episode_seed(config.seed, e, r): e
             for e in range(config.episodes) for r in range(config.rollouts_per_task)}

    class Tagged:
        name = policy.name

        async def act(self, observation: PolicyInput) -> Reply:
            observation.info = {**observation.info, "episode": seeds[observation.seed]}
            return await policy.act(observation)

    return await evaluate(config, Tagged(), out, concurrency=3, progress=False)


def test_rollouts_report_pass_at_k_and_resume_per_rollout(tmp_path: Path) -> None:
    config = EvalConfig(GSM8K, "by-rollout", episodes=3, rollouts_per_task=3)
    policy = ByRollout()
    summary = asyncio.run(_run(config, policy, tmp_path))
    records = read_episodes(tmp_path)
    assert sorted((r["episode"], r["rollout"]) for r in records) == [
        (e, r) for e in range(3) for r in range(3)]
    assert len({r["seed"] for r in records}) == 9  # distinct seeds
    assert all(len({r["task_id"] for r in records if r["episode"] == e}) == 1 for e in range(3))
    # Tasks succeed on 0, 1 and 2 of 3 rollouts.
    by_hand = {"1": (0 + 1 / 3 + 2 / 3) / 3, "2": (0 + (1 - 1 / 3) + 1) / 3, "3": 2 / 3}
    for k, value in by_hand.items():
        row = summary.pass_at_k[k]
        assert row["estimate"] == pytest.approx(value) and row["tasks"] == 3
        assert row["low"] <= row["estimate"] <= row["high"]
    assert summary.success_rate == pytest.approx(3 / 9)
    assert summary.success_interval == "bootstrap over tasks, Wilson floor"
    assert (summary.success_low, summary.success_high) == (
        summary.pass_at_k["1"]["low"], summary.pass_at_k["1"]["high"])
    assert summary.reward_low <= summary.mean_reward <= summary.reward_high
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["pass_at_k"]["2"]["estimate"] == pytest.approx(by_hand["2"])

    # An interrupted run: two (task, rollout) pairs are missing; exactly those run again.
    lines = (tmp_path / "episodes.jsonl").read_text().splitlines()
    kept = [line for line in lines
            if (json.loads(line)["episode"], json.loads(line)["rollout"]) not in {(1, 2), (2, 0)}]
    (tmp_path / "episodes.jsonl").write_text("\n".join(kept) + "\n")
    again = ByRollout()
    resumed = asyncio.run(_run(config, again, tmp_path))
    assert sorted(again.played) == [(1, 2), (2, 0)]
    assert resumed.pass_at_k == summary.pass_at_k
    # More rollouts extend the run: only rollout 3 of each task is new.
    more = ByRollout()
    extended = asyncio.run(_run(EvalConfig(GSM8K, "by-rollout", episodes=3,
                                           rollouts_per_task=4), more, tmp_path))
    assert sorted(more.played) == [(0, 3), (1, 3), (2, 3)]
    assert set(extended.pass_at_k) == {"1", "2", "3", "4"}


def test_summary_groups_rollouts_by_task() -> None:
    def record(episode: int, success: bool) -> dict:
        return {"episode": episode, "task_id": f"t{episode}", "success": success,
                "reward": float(success), "turns": 1,
                "completion_tokens": None, "latency_s": 0.1,
                "final_state": {"env_id": GSM8K}}

    records = [record(0, s) for s in (True, True, False, False)]
    records += [record(1, False)] * 4 + [record(2, True)] * 4
    summary = summarize(EvalConfig(GSM8K, "p", 3, rollouts_per_task=4), records, errors=0)
    assert summary.pass_at_k["1"]["estimate"] == pytest.approx(0.5)
    assert summary.pass_at_k["2"]["estimate"] == pytest.approx((1 - 1 / 6 + 0 + 1) / 3)
    assert summary.tasks == 3 and summary.episodes == 12


@pytest.mark.parametrize("success", [False, True])
def test_tasks_that_all_scored_alike_still_get_an_interval(success: bool) -> None:
    """A bootstrap over 18 identical tasks is a point; the interval must not claim that
    72 episodes pinned the rate down exactly. Its floor counts each task once."""
    records = [{"episode": e, "task_id": f"t{e}", "success": success,
                "reward": float(success), "turns": 1,
                "completion_tokens": None, "latency_s": 0.1, "final_state": {"env_id": GSM8K}}
               for e in range(18) for _ in range(4)]
    summary = summarize(EvalConfig(GSM8K, "p", 18, rollouts_per_task=4), records, errors=0)
    floor = wilson_interval(18 * success, 18)
    assert (summary.success_low, summary.success_high) == pytest.approx(floor)
    assert summary.success_high - summary.success_low > 0.15
    for row in summary.pass_at_k.values():
        assert (row["low"], row["high"]) == pytest.approx(floor)


def test_cli_rollouts_print_pass_at_k_and_settings_are_the_run_identity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    args = ["eval", GSM8K, "--episodes", "2", "--rollouts-per-task", "2", "--quiet",
            "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    # Both tasks always succeed: the interval still says that two tasks were seen.
    assert "pass@k [95% CI over tasks]" in printed and "1.000 [0.342, 1.000]" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["max_tokens"] == 256 and config["rollouts_per_task"] == 2
    for flag, value, recorded in [("--max-tokens", "64", "max_tokens=256"),
                                  ("--temperature", "0.7", "temperature=0.0"),
                                  ("--history-window", "3", "history_window=None")]:
        assert main([*args, flag, value]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and recorded in err[0] and "another --out" in err[0], err
    with pytest.raises(SystemExit) as usage:
        main([*args, "--rollouts-per-task", "0"])
    assert usage.value.code == 2 and "at least 1" in capsys.readouterr().err
    with pytest.raises(RunMismatchError, match="max_tokens=256 \\(this run: 64\\)"):
        asyncio.run(evaluate(EvalConfig(GSM8K, "oracle", 2, rollouts_per_task=2,
                                        max_tokens=64), ByRollout(), out, progress=False))


def test_a_config_recorded_before_the_identity_grew_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"env_id": GSM8K, "policy": "oracle", "episodes": 2, "seed": 0, "env_kwargs": {}}))
    with pytest.raises(RunMismatchError, match="max_tokens='<not recorded>'"):
        asyncio.run(evaluate(EvalConfig(GSM8K, "oracle", 2), ByRollout(), tmp_path,
                             progress=False))
