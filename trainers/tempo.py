"""TEMPO on agent_gym environments: macro-steps from saved states, judged by a generative
critic that shares the policy's weights. One file you can read top to bottom.

    python -m trainers.tempo --env-id agent_gym/ALFWorld-v0 --env-kwargs '{"max_turns": 30}'
    agent-gym train tempo --backend pytrio --model Qwen/Qwen3-4B --horizon 10
    agent-gym train plot runs/tempo          # metrics.png of a run

The method. A long episode is cut into macro-steps of H turns. A macro-step starts from a
saved state s (env state plus the exact prompt tokens there; see ``trainers.store``) or from
a fresh task, and runs N branches for H turns. The same weights, prompted as a critic with
what the actor never sees (``trainers.critic``), value where each branch ended:
V(end) = the mean of M critic samples, or 0 if the episode is over. Then, per group,

    R_n = r_n + V(end_n)          r_n: the env reward collected inside the macro-step
    G   = mean_n R_n
    A_n = (R_n - G) * w           actor advantage; w: the prefix importance weight of s
    c_k = -|V_k - G| / R_max      reward of critic sample k at s (-1 if unparsable),
                                  centred over the K samples

A group whose R_n are all equal, or whose critic rewards are all equal, teaches nothing and
is skipped (and counted). Before the TD updates, ``warmup_updates`` updates train the critic
alone on Monte Carlo returns: full episodes from fresh tasks, the critic sampled at turns H,
2H, ... with target = the reward the episode still collected after that turn. Every update
sends its actor and critic datums in one ``forward_backward`` and takes one ``optim_step``.

States come from the store: each TD update draws states (consumed, never reused), leaves
``fresh_fraction`` of its groups to fresh tasks, drops states more than ``staleness``
policy versions old, and stores every branch that stopped at the horizon with room to go on;
warm-up episodes add their states at turns H, 2H, ... A state reached by an older policy was
visited with that policy's probability, not the current one's, so the group's actor
advantages are weighted by w = min(cap, exp(sum log pi_now - sum log pi_old)) over the
prefix's sampled tokens (``--no-prefix-is`` turns it off). Restored branches are checked
against the saved chat, observation included (``trainers.rollout``).

Metrics go to ``<out>/metrics.jsonl``, checkpoints to the backend; ``<out>/checkpoint.json``
names the latest one and the store saved with it, so ``--resume`` continues a killed run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pytrio import AdamParams, ModelInput
from tqdm import tqdm

from agent_gym.core import describe_env
from agent_gym.render import ChatRenderer
from trainers.backends import BACKENDS, make_service
from trainers.critic import Critic, CriticSample, critic_rewards, gather_values
from trainers.episode import Episode, active_tokens, build_datum
from trainers.grpo import LOSSES
from trainers.options import options_parser
from trainers.rollout import (
    EnvPool,
    RolloutConfig,
    Sampler,
    env_factory,
    rollout_groups,
)
from trainers.runfiles import (
    append_metrics,
    keep_metrics_before,
    open_training_client,
    write_json,
    write_text,
)
from trainers.store import MacroState, StateStore, cut, fresh_quota

CHECKPOINT_FILE = "checkpoint.json"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"
# A branch that ended like this has no future reward: V(end) = 0. A cut reply ends the
# episode too (it is never shown to the env), so its cut reward is all it gets. A branch
# that ran out of trajectory tokens stopped for a budget, not in the game: its value is
# estimated like any other endpoint (the seed lab counted it as terminal).
TERMINAL_ENDS = frozenset({"terminated", "truncated", "max_tokens"})


@dataclass
class Args:
    env_id: str = "agent_gym/ALFWorld-v0"
    env_kwargs: dict[str, Any] = field(default_factory=dict)  # JSON on the command line
    backend: str = "local"  # local | pytrio
    model: str = "smollm2"  # local: smollm2 | tiny | a HF directory; pytrio: a model id
    lora_rank: int = 32  # 0 = full fine-tuning (local backend only)
    api_key: str | None = None  # pytrio only
    ray: str | None = None  # "local" or a cluster address: step envs in Ray actors
    warmup_updates: int = 4  # critic-only updates on Monte Carlo returns
    td_updates: int = 40
    batch_size: int = 4  # groups per update: tasks (warm-up), states or fresh tasks (TD)
    horizon: int = 10  # H: turns per macro-step
    branches: int = 4  # N: branches per group
    critic_samples: int = 4  # K: trained critic samples per start state
    endpoint_samples: int = 2  # M: critic samples averaged into V(end)
    store_capacity: int = 256
    fresh_fraction: float = 0.25  # of each TD update's groups, at least one
    staleness: int = 8  # drop stored states more than this many policy versions old
    r_max: float = 1.0  # largest reward still to come; critic values live in [0, r_max]
    prefix_is: bool = True  # weight restored groups by the prefix importance ratio
    is_cap: float = 2.0  # truncation of that ratio
    learning_rate: float = 4e-5
    grad_clip_norm: float = 1.0
    loss: str = "importance_sampling"  # importance_sampling | ppo
    ppo_clip: float = 0.2
    max_tokens: int = 512  # per actor reply
    critic_max_tokens: int = 512  # per critic reply
    max_trajectory_tokens: int = 12000
    temperature: float = 1.0
    concurrency: int = 8  # groups rolled out at once
    seed: int = 0
    save_every: int = 5
    out: str = "runs/tempo"
    resume: bool = False
    progress: bool = True


def parse_args(argv: list[str] | None = None) -> Args:
    parser = options_parser(Args, "tempo", __doc__.split("\n\n")[0])
    args = Args(**vars(parser.parse_args(argv)))
    problems = [
        (args.backend not in BACKENDS, f"--backend must be one of {BACKENDS}"),
        (args.loss not in LOSSES, f"--loss must be one of {LOSSES}"),
        (args.backend == "pytrio" and args.lora_rank < 1,
         "pytrio trains LoRA adapters only: --lora-rank must be positive"),
        (min(args.warmup_updates, args.td_updates) < 0 or args.warmup_updates + args.td_updates
         < 1, "--warmup-updates and --td-updates must be >= 0, with at least one update"),
        (min(args.batch_size, args.horizon, args.endpoint_samples, args.store_capacity) < 1,
         "--batch-size, --horizon, --endpoint-samples and --store-capacity must be positive"),
        (min(args.branches, args.critic_samples) < 2,
         "--branches and --critic-samples must be at least 2 (a group of one has no signal)"),
        (not 0 < args.fresh_fraction <= 1, "--fresh-fraction must be in (0, 1]"),
        (0 < args.fresh_fraction < 1 and fresh_quota(args.batch_size, args.fresh_fraction)
         == args.batch_size, f"--fresh-fraction {args.fresh_fraction} of --batch-size "
         f"{args.batch_size} rounds up to every group: raise the batch or pass 1"),
        (args.staleness < 1, "--staleness must be >= 1: a state is drawn at least one "
         "policy version after it was made"),
        (not (math.isfinite(args.r_max) and args.r_max > 0), "--r-max must be positive"),
        (args.is_cap < 1, "--is-cap must be at least 1"),
        (args.temperature != 1.0,
         "--temperature must be 1: the learner and compute_logprobs score the untempered "
         "policy, so importance ratios to tempered sampling logprobs would be biased"),
    ]
    for failed, message in problems:
        if failed:
            parser.error(message)
    return args


# --------------------------------------------------------------------- the method's formulas
def macro_returns(rewards: Sequence[float], end_values: Sequence[float]) -> np.ndarray:
    """R_n = r_n + V(end_n)."""
    return np.asarray(rewards, dtype=np.float64) + np.asarray(end_values, dtype=np.float64)


def centred(values: Sequence[float] | np.ndarray) -> np.ndarray | None:
    """``values - mean(values)``, or None when they are all equal (a degenerate group)."""
    array = np.asarray(values, dtype=np.float64)
    if np.ptp(array) == 0:
        return None
    return array - array.mean()


def prefix_weight(current_sum: float, old_sum: float, cap: float) -> tuple[float, bool]:
    """w = min(cap, exp(current - old)) and whether the cap cut it."""
    log_ratio = current_sum - old_sum
    if log_ratio >= math.log(cap):
        return cap, True
    return math.exp(log_ratio), False


def value_corr(values: Sequence[float], targets: Sequence[float]) -> float | None:
    """Pearson correlation of critic values and their targets (None if undefined)."""
    if len(values) < 2 or np.ptp(values) == 0 or np.ptp(targets) == 0:
        return None
    return float(np.corrcoef(values, targets)[0, 1])


def value_gap_zero_reward(
    groups: Sequence[tuple[Sequence[float], Sequence[float]]],
) -> float | None:
    """How far the critic tells apart branches the env paid nothing: per group (rewards,
    end values), the spread max - min of V(end) over its zero-reward branches, averaged over
    groups with at least two of them. 0 means the critic adds no signal where the env has
    none."""
    gaps = []
    for rewards, values in groups:
        zero = [v for r, v in zip(rewards, values, strict=True) if r == 0]
        if len(zero) >= 2:
            gaps.append(max(zero) - min(zero))
    return float(np.mean(gaps)) if gaps else None


# --------------------------------------------------------------------- one run's fixed parts
@dataclass(frozen=True)
class Run:
    """What every update of a run shares."""

    args: Args
    make_env: EnvPool
    num_tasks: int
    renderer: ChatRenderer
    critic: Critic
    full: RolloutConfig  # warm-up: whole episodes
    macro: RolloutConfig  # TD: H turns


@dataclass
class Batch:
    """One update's datums, metrics and the states it found."""

    datums: list[Any]
    metrics: dict[str, Any]
    states: list[MacroState]


def train(args: Args, service: Any | None = None) -> list[dict[str, Any]]:
    """Run (or resume) TEMPO; returns this invocation's per-update metrics."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    service = service or make_service(
        args.backend, checkpoint_dir=out / "checkpoints", api_key=args.api_key
    )

    # ---- training client and state store: fresh, or from the last checkpoint
    checkpoint = out / CHECKPOINT_FILE
    training, saved = open_training_client(
        service, args, checkpoint, ("env_id", "env_kwargs", "model", "lora_rank", "backend")
    )
    start, store = 0, StateStore(args.store_capacity, args.staleness)
    if saved:
        start = saved["step"]
        store = StateStore.from_json(
            (out / saved["store"]).read_text(encoding="utf-8"), args.store_capacity,
            args.staleness,
        )
    metrics_path = out / METRICS_FILE
    keep_metrics_before(metrics_path, start)

    renderer = ChatRenderer(training.get_tokenizer())
    num_tasks, episode_turns = describe_env(args.env_id, args.env_kwargs)
    pool = EnvPool(env_factory(args.env_id, args.env_kwargs, args.ray))
    budgets = {"group_size": args.branches, "max_tokens": args.max_tokens,
               "max_trajectory_tokens": args.max_trajectory_tokens,
               "temperature": args.temperature, "keep_states": True}
    run = Run(
        args, pool, num_tasks, renderer,
        Critic(renderer, r_max=args.r_max, max_tokens=args.critic_max_tokens,
               temperature=args.temperature),
        full=RolloutConfig(max_turns=episode_turns, **budgets),
        macro=RolloutConfig(max_turns=args.horizon, **budgets),
    )
    loss_config = (
        {"clip_low_threshold": 1 - args.ppo_clip, "clip_high_threshold": 1 + args.ppo_clip}
        if args.loss == "ppo"
        else None
    )
    adam = AdamParams(learning_rate=args.learning_rate, grad_clip_norm=args.grad_clip_norm)

    total = args.warmup_updates + args.td_updates
    history: list[dict[str, Any]] = []
    bar = tqdm(range(start, total), initial=start, total=total, disable=not args.progress)
    try:
        for step in bar:
            t0 = time.perf_counter()
            # ---- a fresh sampler on the current weights: policy version `step`
            sampler = training.save_weights_and_get_sampling_client()
            rng = np.random.default_rng([args.seed, step])
            if step < args.warmup_updates:
                batch = asyncio.run(warmup_batch(run, sampler, step, rng))
            else:
                batch = asyncio.run(td_batch(run, sampler, step, rng, store))
            t1 = time.perf_counter()

            # ---- one update on actor and critic datums together
            loss: Any = {}
            if batch.datums:
                loss = training.forward_backward(batch.datums, args.loss, loss_config).result()
                loss = loss.metrics
                loss |= training.optim_step(adam).result().metrics
            t2 = time.perf_counter()
            evicted = store.add(batch.states)

            # ---- metrics, then checkpoint (weights, optimizer and store): a step counted
            # done by a checkpoint always has its line
            row = {"step": step, "phase": "warmup" if step < args.warmup_updates else "td"}
            row |= batch.metrics
            row |= {
                "td/stored": len(batch.states), "td/evicted": evicted, "td/store_size": len(store),
                "datums": len(batch.datums), "trained_tokens": active_tokens(batch.datums),
                "loss": loss.get("loss_mean"), "grad_norm": loss.get("grad_norm"),
                "time_rollout": t1 - t0, "time_train": t2 - t1,
                "time_step": time.perf_counter() - t0,
            }
            append_metrics(metrics_path, row)
            if (step + 1) % args.save_every == 0 or step + 1 == total:
                _checkpoint(out, training, store, step + 1, args)
            history.append(row)
            bar.set_postfix(error=row.get("critic/abs_error_mean"), store=len(store))
    finally:
        pool.close()  # envs are reused across updates
    return history


# --------------------------------------------------------------------- warm-up
async def warmup_batch(
    run: Run, sampler: Sampler, step: int, rng: np.random.Generator
) -> Batch:
    """Full episodes; the critic learns the Monte Carlo return at turns H, 2H, ..."""
    args = run.args
    tasks = rng.choice(run.num_tasks, size=args.batch_size, replace=args.batch_size > run.num_tasks)
    groups = await rollout_groups(
        run.make_env, [{"index": int(i)} for i in tasks], sampler, run.renderer, run.full,
        seeds=[_seed(args.seed, step, "warmup", g) for g in range(len(tasks))],
        concurrency=args.concurrency,
    )
    episodes = [episode for group in groups for episode in group]
    # Boundaries before the episode's last turn: the episode went on from there, so the
    # state is not terminal and the rest of its rewards is a Monte Carlo return.
    points = [(e, k) for e in episodes for k in range(args.horizon, len(e.turns), args.horizon)]
    states = [cut(e, k, None, step) for e, k in points]
    returns = [e.reward - sum(e.step_rewards[:k]) for e, k in points]
    # The critic is trained on at most one state per branch rolled out, a TD update's cost.
    chosen = sorted(rng.choice(len(points), size=min(len(points), len(episodes)), replace=False))
    samples = await asyncio.gather(*(
        run.critic.sample(sampler, _critic_prompt(run, states[i]), args.critic_samples,
                          _seed(args.seed, step, "critic", i))
        for i in chosen
    ))
    datums, metrics = critic_update(samples, [returns[i] for i in chosen], args.r_max)
    metrics |= _rollout_metrics(episodes)
    metrics |= {"warmup/boundary_states": len(points), "critic/parse_failure_rate":
                _failure_rate([s for group in samples for s in group])}
    return Batch(datums, metrics, states)


# --------------------------------------------------------------------- TD update
async def td_batch(
    run: Run, sampler: Sampler, step: int, rng: np.random.Generator, store: StateStore
) -> Batch:
    """Macro-steps from stored states and fresh tasks; actor and critic datums."""
    args = run.args
    # ---- start points: stored states (consumed) and at least the fresh quota of new tasks
    restored, stale = store.draw(args.batch_size, args.fresh_fraction, step, rng)
    fresh = args.batch_size - len(restored)
    tasks = rng.choice(run.num_tasks, size=fresh, replace=fresh > run.num_tasks)
    starts: list[MacroState | None] = [*restored, *([None] * fresh)]

    # ---- prefix importance weights of the restored states under the current policy
    weights = [1.0] * len(starts)
    clipped = [False] * len(starts)
    if args.prefix_is and restored:
        scored = await asyncio.gather(*(
            sampler.compute_logprobs_async(ModelInput.from_ints(s.tokens)) for s in restored
        ))
        for i, (state, logprobs) in enumerate(zip(restored, scored, strict=True)):
            weights[i], clipped[i] = prefix_weight(
                state.sampled_logprob_sum(logprobs), state.old_logprob_sum, args.is_cap
            )

    # ---- N branches of H turns from each start
    groups = await rollout_groups(
        run.make_env,
        [*(s.resume() for s in restored), *({"index": int(i)} for i in tasks)],
        sampler, run.renderer, run.macro,
        seeds=[_seed(args.seed, step, "td", g) for g in range(len(starts))],
        concurrency=args.concurrency,
    )

    # ---- critic: K trained samples at each start, M averaged samples at each endpoint
    start_prompts = [
        _critic_prompt(run, s) if s is not None else run.critic.prompt(
            g[0].messages[: g[0].opening_messages], g[0].opening_messages, g[0].privileged)
        for s, g in zip(starts, groups, strict=True)
    ]
    episodes = [e for g in groups for e in g]
    end_prompts = [
        None if e.end_reason in TERMINAL_ENDS
        else run.critic.prompt(e.messages, e.opening_messages, e.privileged)
        for e in episodes
    ]
    start_samples, end_values = await asyncio.gather(
        asyncio.gather(*(
            run.critic.sample(sampler, p, args.critic_samples, _seed(args.seed, step, "start", i))
            for i, p in enumerate(start_prompts)
        )),
        gather_values(run.critic, sampler, end_prompts, args.endpoint_samples,
                      [_seed(args.seed, step, "end", i) for i in range(len(episodes))]),
    )

    # ---- actor signals: R_n = r_n + V(end_n), A_n = (R_n - mean R) * w
    datums: list[Any] = []
    targets: list[float] = []
    degenerate = 0
    paid: list[tuple[list[float], list[float]]] = []
    values = iter(end_values)
    for group, weight in zip(groups, weights, strict=True):
        ends = [next(values)[0] for _ in group]
        group_datums, target = actor_update(group, ends, weight)
        targets.append(target)
        if group_datums is None:
            degenerate += 1
        else:
            datums += group_datums
        paid.append(([e.reward for e in group], ends))
    actor_datums = len(datums)

    # ---- critic signals at the start states, against G = mean R
    critic_datums, metrics = critic_update(start_samples, targets, args.r_max)
    datums += critic_datums

    # ---- where branches stopped at the horizon with room to go on: new states
    states = [
        cut(e, len(e.turns), start, step)
        for start, group in zip(starts, groups, strict=True) for e in group
        if e.end_reason == "max_turns" and e.next_prompt is not None
        and len(e.next_prompt) < args.max_trajectory_tokens
    ]
    all_samples = [s for g in start_samples for s in g] + [s for _, g in end_values for s in g]
    weighted = weights[: len(restored)]
    metrics |= _rollout_metrics(episodes)
    metrics |= {
        "critic/parse_failure_rate": _failure_rate(all_samples),
        "actor/value_gap_zero_reward": value_gap_zero_reward(paid),
        "actor/degenerate_group_rate": degenerate / len(groups),
        "actor/return_mean": float(np.mean(targets)),
        "actor/datums": actor_datums,
        "td/fresh_states": fresh,
        "td/restored_states": len(restored),
        "td/stale_dropped": stale,
        "is/weight_mean": float(np.mean(weighted)) if weighted and args.prefix_is else None,
        "is/clip_rate": float(np.mean(clipped[: len(restored)]))
        if restored and args.prefix_is else None,
    }
    return Batch(datums, metrics, states)


# --------------------------------------------------------------------- shared pieces
def actor_update(
    group: Sequence[Episode], end_values: Sequence[float], weight: float
) -> tuple[list[Any] | None, float]:
    """One group's actor datums, A_n = (R_n - G) * w on every token branch n sampled (None
    for a degenerate group), and G = mean R, the critic's target at the start state."""
    returns = macro_returns([e.reward for e in group], end_values)
    advantages = centred(returns)
    if advantages is None:
        return None, float(returns.mean())
    datums = [build_datum(e.turns, float(a * weight))
              for e, a in zip(group, advantages, strict=True) if e.turns]
    return datums, float(returns.mean())


def critic_update(
    samples: Sequence[Sequence[CriticSample]], targets: Sequence[float], r_max: float
) -> tuple[list[Any], dict[str, Any]]:
    """Critic datums (rewards centred per start state) and the critic's accuracy metrics.

    ``critic/abs_error_constant`` is what predicting the update's mean target everywhere
    would have scored on the same samples: a critic below it tells states apart."""
    datums: list[Any] = []
    errors: list[float] = []
    constant: list[float] = []  # the baseline: the best constant value in hindsight
    means: list[float] = []
    matched: list[float] = []
    degenerate = 0
    mean_target = float(np.mean(targets)) if len(targets) else 0.0
    for group, target in zip(samples, targets, strict=True):
        values = [s.value for s in group]
        parsed = [v for v in values if v is not None]
        errors += [abs(v - target) for v in parsed]
        constant += [abs(mean_target - target) for _ in parsed]
        if parsed:
            means.append(float(np.mean(parsed)))
            matched.append(target)
        advantages = centred(critic_rewards(values, target, r_max))
        if advantages is None:
            degenerate += 1
            continue
        datums += [build_datum([s.turn], float(a)) for s, a in zip(group, advantages, strict=True)]
    return datums, {
        "critic/abs_error_mean": float(np.mean(errors)) if errors else None,
        "critic/abs_error_constant": float(np.mean(constant)) if constant else None,
        "critic/value_corr": value_corr(means, matched),
        "critic/value_mean": float(np.mean(means)) if means else None,
        "critic/target_mean": float(np.mean(targets)) if len(targets) else None,
        "critic/states": len(samples),
        "critic/degenerate_group_rate": degenerate / len(samples) if len(samples) else None,
        "critic/datums": len(datums),
    }


def _critic_prompt(run: Run, state: MacroState) -> list[int]:
    return run.critic.prompt(state.messages, state.opening, state.privileged)


def _rollout_metrics(episodes: Sequence[Episode]) -> dict[str, Any]:
    return {
        "reward_mean": float(np.mean([e.reward for e in episodes])) if episodes else None,
        "episodes": len(episodes),
        "sampled_tokens": sum(e.sampled_tokens for e in episodes),
        "invalid_actions": sum(e.invalid_actions for e in episodes),
        "end_reasons": dict(Counter(e.end_reason for e in episodes)),
    }


def _failure_rate(samples: Sequence[CriticSample]) -> float | None:
    return sum(s.value is None for s in samples) / len(samples) if samples else None


def _seed(*parts: object) -> int:
    """Sampling seeds depend on (run seed, update, purpose, index) only, so a resumed run
    draws what an uninterrupted one would."""
    key = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(key, "little") & 0x7FFFFFFF


def _checkpoint(out: Path, training: Any, store: StateStore, step: int, args: Args) -> None:
    """Weights, optimizer and the store of one step; checkpoint.json is written last, so a
    kill at any point leaves the previous checkpoint whole."""
    path = training.save_state(f"step-{step:06d}", overwrite=True).result().path
    store_file = f"store-{step:06d}.json"
    write_text(out / store_file, store.to_json())
    write_json(out / CHECKPOINT_FILE,
                {"step": step, "path": path, "store": store_file, "args": dataclasses.asdict(args)})
    for old in out.glob("store-*.json"):
        if old.name != store_file:
            old.unlink()


# --------------------------------------------------------------------- plot
PLOTTED = (
    "critic/abs_error_mean", "critic/value_corr", "critic/parse_failure_rate", "reward_mean",
    "actor/value_gap_zero_reward", "actor/degenerate_group_rate", "td/fresh_states",
    "td/store_size", "is/weight_mean", "is/clip_rate",
)


def plot(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw a run's TEMPO metrics, one panel each, warm-up shaded; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    source = Path(run_dir) / METRICS_FILE
    if not source.is_file():
        raise FileNotFoundError(f"{source} does not exist: is {run_dir} a training run?")
    rows = [json.loads(line) for line in source.read_text(encoding="utf-8").splitlines() if line]
    shown = [k for k in PLOTTED if any(row.get(k) is not None for row in rows)]
    if not shown:
        raise ValueError(f"{source} holds none of the metrics {PLOTTED}")
    columns = 5
    figure, axes = plt.subplots(
        math.ceil(len(shown) / columns), columns, figsize=(16, 3 * math.ceil(len(shown) / columns)),
        squeeze=False,
    )
    warmup = [row["step"] for row in rows if row.get("phase") == "warmup"]
    for axis, key in zip(axes.flat, shown, strict=False):
        points = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
        axis.plot(*zip(*points, strict=True), marker="o", markersize=3, label="critic")
        if key == "critic/abs_error_mean":
            baseline = [(row["step"], row["critic/abs_error_constant"]) for row in rows
                        if row.get("critic/abs_error_constant") is not None]
            if baseline:
                axis.plot(*zip(*baseline, strict=True), linestyle="--", color="0.4",
                          label="best constant")
                axis.legend(fontsize=7)
        if warmup:
            axis.axvspan(min(warmup) - 0.5, max(warmup) + 0.5, color="0.9")
        axis.set_title(key, fontsize=9)
        axis.set_xlabel("update", fontsize=8)
        axis.tick_params(labelsize=7)
    for axis in list(axes.flat)[len(shown):]:
        axis.set_visible(False)
    figure.tight_layout()
    target = Path(out) if out else Path(run_dir) / PLOT_FILE
    figure.savefig(target, dpi=100)
    plt.close(figure)
    return target


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plot"]:
        parser = argparse.ArgumentParser(prog="tempo plot", description=plot.__doc__)
        parser.add_argument("run_dir")
        parser.add_argument("--out", default=None, help="PNG path (default RUN_DIR/metrics.png)")
        options = parser.parse_args(argv[1:])
        try:
            print(plot(options.run_dir, options.out))
        except (FileNotFoundError, ValueError) as err:
            parser.error(str(err))
        return 0
    args = parse_args(argv)
    history = train(args)
    if history:
        last = history[-1]
        print(json.dumps({"step": last["step"], "critic_abs_error": last.get(
            "critic/abs_error_mean"), "store": last["td/store_size"], "out": args.out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
