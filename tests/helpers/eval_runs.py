"""Eval runs made inside a test with the real eval code: the oracle, and the oracle made
wrong on chosen tasks (so two runs differ exactly where a test says)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

from agent_gym.eval.config import EvalConfig
from agent_gym.eval.policies import OraclePolicy, PolicyInput, Reply
from agent_gym.eval.run import evaluate
from agent_gym.eval.summary import Summary

GSM8K = "agent_gym/GSM8K-v0"


def read_episodes(run: Path) -> list[dict[str, Any]]:
    """The episode records of a run directory, in the order they were written."""
    return [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]


class WrongOnPolicy:
    """The oracle, except on the tasks in ``wrong``, where it answers a number no task has."""

    def __init__(self, wrong: Collection[str]) -> None:
        self.name = "oracle-wrong"
        self.wrong = set(wrong)
        self.oracle = OraclePolicy()

    async def act(self, observation: PolicyInput) -> Reply:
        if observation.info.get("task_id") in self.wrong:
            return Reply("The answer is \\boxed{-987654321}.")
        return await self.oracle.act(observation)


def make_run(out: Path, policy: Any = None, episodes: int = 6, seed: int = 0,
             env_id: str = GSM8K, env_kwargs: dict[str, Any] | None = None,
             rollouts_per_task: int = 1) -> Summary:
    policy = policy or OraclePolicy()
    config = EvalConfig(env_id, policy.name, episodes, seed, env_kwargs or {},
                        rollouts_per_task=rollouts_per_task)
    return asyncio.run(evaluate(config, policy, out, concurrency=2, progress=False))


def episodes(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]


def write_episodes(run: Path, records: list[dict[str, Any]]) -> None:
    (run / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
