"""GRPO on agent_gym environments, in one file you can read top to bottom.

    python -m trainers.grpo --env-id agent_gym/GSM8K-v0 --steps 20
    agent-gym train grpo --env-id agent_gym/GSM8K-v0 --backend pytrio --model Qwen/Qwen3-4B

Each step: take a sampler on the current weights; pick ``batch_size`` tasks; roll out
``group_size`` branches of each (multi-turn, token-continuous); advantage = reward minus the
group's mean reward (optionally over its std); skip and count groups whose rewards are all
equal (no learning signal); one ``forward_backward`` on every datum of the step and one
``optim_step``. Metrics go to ``<out>/metrics.jsonl`` (one line per step), checkpoints to
the backend, and ``<out>/checkpoint.json`` names the latest one so ``--resume`` continues a
killed run from it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pytrio import AdamParams
from tqdm import tqdm

from agent_gym.core import describe_env
from agent_gym.render import ChatRenderer
from trainers.backends import BACKENDS, make_service
from trainers.episode import Episode, active_tokens, build_datum
from trainers.options import options_parser
from trainers.rollout import RolloutConfig, env_factory, rollout_groups
from trainers.runfiles import (
    append_metrics,
    keep_metrics_before,
    open_training_client,
    write_json,
)

LOSSES = ("importance_sampling", "ppo")
CHECKPOINT_FILE = "checkpoint.json"
METRICS_FILE = "metrics.jsonl"


@dataclass
class Args:
    env_id: str = "agent_gym/GSM8K-v0"
    env_kwargs: dict[str, Any] = field(default_factory=dict)  # JSON on the command line
    backend: str = "local"  # local | pytrio
    model: str = "smollm2"  # local: smollm2 | tiny | a HF directory; pytrio: a model id
    lora_rank: int = 32  # 0 = full fine-tuning (local backend only)
    api_key: str | None = None  # pytrio only
    ray: str | None = None  # "local" or a cluster address: step envs in Ray actors
    steps: int = 20
    batch_size: int = 8  # tasks (groups) per step
    group_size: int = 8  # branches per task
    learning_rate: float = 4e-5
    grad_clip_norm: float = 1.0
    loss: str = "importance_sampling"  # importance_sampling | ppo
    ppo_clip: float = 0.2
    normalize_std: bool = False
    max_turns: int = 1
    max_tokens: int = 512  # per reply
    max_trajectory_tokens: int = 4096
    temperature: float = 1.0
    concurrency: int = 8  # groups rolled out at once
    seed: int = 0
    save_every: int = 5
    out: str = "runs/grpo"
    resume: bool = False
    progress: bool = True


def parse_args(argv: list[str] | None = None) -> Args:
    parser = options_parser(Args, "grpo", __doc__.split("\n\n")[0])
    args = Args(**vars(parser.parse_args(argv)))
    if args.backend not in BACKENDS:
        parser.error(f"--backend must be one of {BACKENDS}")
    if args.loss not in LOSSES:
        parser.error(f"--loss must be one of {LOSSES}")
    if args.backend == "pytrio" and args.lora_rank < 1:
        parser.error("pytrio trains LoRA adapters only: --lora-rank must be positive")
    if args.temperature != 1.0:
        parser.error("--temperature must be 1: the learner scores the untempered policy, so "
                     "importance ratios to tempered sampling logprobs would be biased")
    if min(args.steps, args.batch_size, args.group_size) < 1:
        parser.error("--steps, --batch-size and --group-size must be positive")
    return args


def train(args: Args, service: Any | None = None) -> list[dict[str, Any]]:
    """Run (or resume) GRPO; returns this invocation's per-step metrics."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    service = service or make_service(
        args.backend, checkpoint_dir=out / "checkpoints", api_key=args.api_key
    )

    # ---- training client: fresh, or from the last checkpoint of a killed run
    checkpoint = out / CHECKPOINT_FILE
    training, saved = open_training_client(
        service, args, checkpoint, ("env_id", "model", "lora_rank", "backend")
    )
    start = saved["step"] if saved else 0
    metrics_path = out / METRICS_FILE
    keep_metrics_before(metrics_path, start)

    renderer = ChatRenderer(training.get_tokenizer())
    num_tasks, _ = describe_env(args.env_id, args.env_kwargs)
    make_env = env_factory(args.env_id, args.env_kwargs, args.ray)
    config = RolloutConfig(
        group_size=args.group_size,
        max_turns=args.max_turns,
        max_tokens=args.max_tokens,
        max_trajectory_tokens=args.max_trajectory_tokens,
        temperature=args.temperature,
    )
    loss_config = (
        {"clip_low_threshold": 1 - args.ppo_clip, "clip_high_threshold": 1 + args.ppo_clip}
        if args.loss == "ppo"
        else None
    )
    adam = AdamParams(learning_rate=args.learning_rate, grad_clip_norm=args.grad_clip_norm)

    history: list[dict[str, Any]] = []
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, disable=not args.progress)
    for step in bar:
        t0 = time.perf_counter()
        # ---- a fresh sampler on the current weights
        sampler = training.save_weights_and_get_sampling_client()
        t1 = time.perf_counter()

        # ---- rollouts: batch_size tasks x group_size branches
        rng = np.random.default_rng([args.seed, step])
        tasks = rng.choice(num_tasks, size=args.batch_size, replace=args.batch_size > num_tasks)
        groups = asyncio.run(
            rollout_groups(
                make_env,
                [{"index": int(i)} for i in tasks],
                sampler,
                renderer,
                config,
                seeds=[args.seed * 1_000_003 + step * 1_009 + g for g in range(len(tasks))],
                concurrency=args.concurrency,
            )
        )
        t2 = time.perf_counter()

        # ---- advantages and datums; groups without signal are skipped
        datums = []
        degenerate = 0
        for group in groups:
            rewards = np.array([episode.reward for episode in group])
            if np.ptp(rewards) == 0:
                degenerate += 1
                continue
            advantages = rewards - rewards.mean()
            if args.normalize_std:
                advantages /= rewards.std() + 1e-6
            datums += [
                build_datum(episode.turns, float(advantage))
                for episode, advantage in zip(group, advantages, strict=True)
            ]

        # ---- one update on the whole logical batch
        loss = {}
        if datums:
            loss = training.forward_backward(datums, args.loss, loss_config).result().metrics
            loss |= training.optim_step(adam).result().metrics
        t3 = time.perf_counter()

        # ---- metrics, then checkpoint (so a step counted done always has its line)
        row = _metrics(step, groups, degenerate, datums, loss)
        row |= {"time_sampler": t1 - t0, "time_rollout": t2 - t1, "time_train": t3 - t2,
                "time_step": time.perf_counter() - t0}
        append_metrics(metrics_path, row)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            path = training.save_state(f"step-{step + 1:06d}", overwrite=True).result().path
            latest = {"step": step + 1, "path": path, "args": dataclasses.asdict(args)}
            write_json(checkpoint, latest)
        history.append(row)
        bar.set_postfix(reward=round(row["reward_mean"], 3), degenerate=row["degenerate_groups"])
    return history


def _metrics(
    step: int, groups: list[list[Episode]], degenerate: int, datums: list[Any], loss: dict
) -> dict[str, Any]:
    episodes = [episode for group in groups for episode in group]
    rewards = [episode.reward for episode in episodes]
    ends = Counter(episode.end_reason for episode in episodes)
    return {
        "step": step,
        "reward_mean": float(np.mean(rewards)),
        "reward_std": float(np.std(rewards)),
        "groups": len(groups),
        "degenerate_groups": degenerate,
        "degenerate_rate": degenerate / len(groups),
        "episodes": len(episodes),
        "datums": len(datums),
        "sampled_tokens": sum(episode.sampled_tokens for episode in episodes),
        "trained_tokens": active_tokens(datums),
        "turns_mean": float(np.mean([len(episode.turns) for episode in episodes])),
        "cut_rate": ends["max_tokens"] / len(episodes),
        "invalid_actions": sum(episode.invalid_actions for episode in episodes),
        "end_reasons": dict(ends),
        "loss": loss.get("loss_mean"),
        "loss_sum": loss.get("loss_sum"),
        "grad_norm": loss.get("grad_norm"),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    history = train(args)
    if history:
        last = history[-1]
        print(json.dumps({"step": last["step"], "reward_mean": last["reward_mean"],
                          "out": args.out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
