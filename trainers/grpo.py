"""GRPO on agent_gym environments, in one file you can read top to bottom.

    python -m trainers.grpo --env-id agent_gym/GSM8K-v0 --steps 20
    agent-gym train grpo --env-id agent_gym/GSM8K-v0 --backend pytrio --model Qwen/Qwen3-4B

Each step: take a sampler on the current weights; pick ``batch_size`` tasks; roll out
``group_size`` branches of each (multi-turn, token-continuous); advantage = reward minus the
group's mean reward (optionally over its std); skip and count groups whose rewards are all
equal (no learning signal); one ``forward_backward`` on every datum of the step and one
``optim_step``. Episodes play the env's own turn budget unless ``--max-turns`` says
otherwise. Everything that is not GRPO (arguments every trainer takes, the training client,
the env pool reused by every step, the update, metrics lines, checkpoints and continuing a
stopped run) is in ``trainers.run``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
from pytrio import Datum

from trainers.episode import build_datum
from trainers.rollout import rollout_metrics, rollout_step, run_rollout_config
from trainers.run import (
    OUT_HELP,
    Metrics,
    RunArgs,
    ServiceClient,
    device_defaults,
    final_line,
    open_run,
    option,
)
from trainers.run import parse_args as parse_run_args


@dataclass
class Args(RunArgs):
    out: str = option("runs/grpo", OUT_HELP)
    steps: int = option(20, "training steps of the whole run")
    group_size: int | None = option(
        None, "branches (episodes) per task; advantages are centred in it (default: 4 when the "
        "local backend runs on CPU, else 8)")
    normalize_std: bool = option(False, "divide advantages by the group's reward std")
    history_window: int | None = option(
        None, "show the policy the task and only the last N turns, as `agent-gym eval "
        "--history-window N` does (each cut restarts the token-continuous prompt)")

    DEVICE_DEFAULTS: ClassVar[dict[str, tuple[int, int]]] = {
        **RunArgs.DEVICE_DEFAULTS, "group_size": (4, 8)}

    def problems(self) -> list[str]:
        return [*super().problems(),
                *(["--steps and --group-size must be positive"]
                  if min(self.steps, 1 if self.group_size is None else self.group_size) < 1
                  else []),
                *(["--history-window must be positive"]
                  if self.history_window is not None and self.history_window < 1 else [])]

    def branches_per_task(self) -> int:
        return self.group_size or 1


def parse_args(argv: Sequence[str] | None = None) -> Args:
    return parse_run_args(Args, argv, "agent-gym train grpo", __doc__.split("\n\n")[0])


def train(args: Args, service: ServiceClient | None = None) -> list[Metrics]:
    """Run (or resume) GRPO; returns this invocation's per-step metrics."""
    history: list[Metrics] = []
    args = device_defaults(args)
    with open_run(args, args.steps, service) as run:
        config = run_rollout_config(run, args.group_size, args.history_window)
        for step in run.progress():
            t0 = time.perf_counter()
            # ---- a fresh sampler on the current weights
            sampler = run.training.save_weights_and_get_sampling_client()
            t1 = time.perf_counter()

            # ---- rollouts: batch_size tasks x group_size branches
            tasks = run.tasks(run.rng(step), args.batch_size)
            groups = rollout_step(run, step, sampler, tasks, config)
            t2 = time.perf_counter()

            # ---- advantages and datums; groups without signal are skipped
            datums: list[Datum] = []
            degenerate = 0
            for group in groups:
                rewards = np.array([episode.reward for episode in group])
                if np.ptp(rewards) == 0:
                    degenerate += 1
                    continue
                advantages = rewards - rewards.mean()
                if args.normalize_std:
                    advantages /= rewards.std() + 1e-6
                datums += [build_datum(sequence, float(advantage))
                           for episode, advantage in zip(group, advantages, strict=True)
                           for sequence in episode.sequences]

            # ---- one update on the whole logical batch
            trained = run.update(datums)
            t3 = time.perf_counter()

            # ---- metrics, then checkpoint (so a step counted done always has its line)
            row = {"step": step, **rollout_metrics([e for g in groups for e in g]),
                   "groups": len(groups), "degenerate_groups": degenerate,
                   "degenerate_rate": degenerate / len(groups), **trained,
                   "time_sampler": t1 - t0, "time_rollout": t2 - t1, "time_train": t3 - t2,
                   "time_step": time.perf_counter() - t0}
            run.finish(step, row, shown={"reward": round(row["reward_mean"], 3),
                                         "degenerate": degenerate})
            history.append(row)
    return history


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    history = train(args)
    print(final_line(history, Path(args.out),
                     reward_mean=history[-1]["reward_mean"] if history else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
