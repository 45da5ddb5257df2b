"""Eval runs made inside a test with the real eval code: the oracle, and the oracle made
wrong on chosen tasks (so two runs differ exactly where a test says); a run another process
is writing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import Collection, Iterator
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


@contextlib.contextmanager
def run_held_by_another_process(run: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process that holds ``run`` as its writer (``RunLog``) until the block ends."""
    holder = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys\n"
            "from pathlib import Path\n"
            "from agent_gym.eval.config import EvalConfig\n"
            "from agent_gym.eval.runlog import RunLog\n"
            "log = RunLog(Path(sys.argv[1]), EvalConfig('agent_gym/GSM8K-v0', 'oracle', 2))\n"
            "print('holding', flush=True)\n"
            "sys.stdin.read()\n"
            "log.close()\n"
        ), str(run)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        yield holder
    finally:
        holder.communicate("", timeout=60)
