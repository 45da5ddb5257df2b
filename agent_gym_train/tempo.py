"""TEMPO on agent_gym environments: macro-steps from saved states, judged by a generative
critic that shares the policy's weights. One file you can read top to bottom.

    python -m agent_gym_train.tempo --env-id agent_gym/ALFWorld-v0 --env-kwargs '{"max_turns": 30}'
    agent-gym train tempo --backend pytrio --model Qwen/Qwen3-4B --horizon 10
    agent-gym train plot runs/tempo          # metrics.png of a run (agent_gym_train.plot)

The method. A long episode is cut into macro-steps of H turns. A macro-step starts from a
saved state s (a ``ResumePoint``: env state plus the exact prompt tokens there; see
``agent_gym_train.run.store``) or from a fresh task, and runs N branches for H turns. The
same weights, prompted as a critic with what the actor never sees
(``agent_gym_train.critic``), value where each branch ended: V(end), the median of the
critic's belief over the values 0, R_max/4, ..., R_max, or 0 if the episode is over. Then,
per group,

    R_n = r_n + V(end_n)          r_n: the env reward collected inside the macro-step
    G   = mean_n R_n
    A_n = (R_n - G) * w           actor advantage; w: the prefix importance weight of s

and the critic is fitted to G at s: the reply stating G trains by cross-entropy beside the
actor's datums, in one ``forward_backward`` and one ``optim_step``. A group whose R_n are
all equal teaches the actor nothing and is skipped (and counted); its critic target still
trains.

Before the TD updates, ``warmup_updates`` updates train the critic alone on Monte Carlo
returns: full episodes from fresh tasks, the critic asked at turns H, 2H, ... with target =
the reward the episode still collected after that turn, and at each task's opening (where
fresh TD groups start) with target = the mean return of its N episodes. ``--critic-replay
R`` sends R earlier warm-up targets again with every later update
(``agent_gym_train.critic.replay``). What this recipe measured, and the variants it was
chosen over: docs/experiments/tempo.md.

Cut replies. A reply cut by ``--max-tokens`` is shown to the env, which judges its text as
it stands (mostly an invalid action), and the episode goes on (``cut_replies`` counts
them): for a small model at a CPU reply budget most replies are cut, and ending an
episode at its first cut left warm-up no episode that lived to turn H. The critic's reply
is prefilled with ``<value>``, so its budget (``--critic-max-tokens``) only has to hold a
number and the closing tag.

States come from the store: each TD update draws states (consumed, never reused), leaves
``fresh_fraction`` of its groups to fresh tasks, drops states more than ``staleness``
policy versions old, and stores every branch that stopped at the horizon with room to go on;
warm-up episodes add their states at turns H, 2H, ... A state reached by an older policy was
visited with that policy's probability, not the current one's, so the group's actor
advantages are weighted by w = min(cap, exp(sum log pi_now - sum log pi_old)) over the
prefix's sampled tokens. Restored branches are checked against the saved chat,
observation included (``agent_gym_train.run.rollout``).

Everything that is not TEMPO (arguments every trainer takes, the training client, the env
pool, the update, metrics lines, checkpoints and continuing a stopped run) is in
``agent_gym_train.run``; the store is saved with every checkpoint and restored with it.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
from pytrio import Datum, ModelInput

from agent_gym_train.advantages import group_advantages
from agent_gym_train.critic import (
    Critic,
    CriticSample,
    critic_fit,
    replay,
    value_gap_zero_reward,
)
from agent_gym_train.run.args import OUT_HELP, RunArgs, option
from agent_gym_train.run.args import parse_args as parse_run_args
from agent_gym_train.run.clients import Sampler, ServiceClient
from agent_gym_train.run.episode import Episode, ResumePoint, build_datum, cross_entropy_datum
from agent_gym_train.run.files import Metrics, RunConfigError
from agent_gym_train.run.pipeline import MAX_IMPORTANCE_WEIGHT, off_policy_objective
from agent_gym_train.run.rollout import RolloutConfig, rollout_groups, rollout_metrics
from agent_gym_train.run.run import Run, device_defaults, final_line, open_run
from agent_gym_train.run.store import StateStore, cut, fresh_quota

# --help's description: the docstring's first paragraph, kept here (python -OO drops docstrings)
DESCRIPTION = ("TEMPO on agent_gym environments: macro-steps from saved states, judged by a "
               "generative\ncritic that shares the policy's weights. One file you can read top "
               "to bottom.")
# A branch that ended like this has no future reward: V(end) = 0. A branch that ran out of
# trajectory tokens stopped for a budget, not in the game: its value is estimated like any
# other endpoint (the seed lab counted it as terminal).
TERMINAL_ENDS = frozenset({"terminated", "truncated", "max_tokens"})


@dataclass
class Args(RunArgs):
    env_id: str = option("agent_gym/ALFWorld-v0", "the env to train on (see `agent-gym envs`)")
    batch_size: int | None = option(
        4, "groups per update: tasks (warm-up), states or fresh tasks (TD)")
    max_trajectory_tokens: int = option(12000, "tokens per episode, prompt included")
    out: str = option("runs/tempo", OUT_HELP)
    warmup_updates: int = option(4, "critic-only updates on Monte Carlo returns, first")
    td_updates: int = option(40, "macro-step (TD) updates after the warm-up")
    horizon: int = option(10, "H: turns per macro-step")
    branches: int = option(4, "N: branches per group")
    store_capacity: int = option(256, "saved states kept (oldest evicted first)")
    fresh_fraction: float = option(0.25, "share of each TD update's groups from fresh tasks "
                                         "(at least one)")
    staleness: int = option(8, "drop stored states more than this many policy versions old")
    r_max: float = option(1.0, "largest reward still to come; critic values live in "
                               "[0, r_max]")
    is_cap: float = option(2.0, "truncation of the prefix importance weight")
    critic_max_tokens: int = option(
        16, "tokens per critic reply: the reply is prefilled with <value>, so a number and "
        "</value> (about 8 tokens) is all a parse needs")
    critic_replay: int = option(
        8, "warm-up critic targets retrained in every later update, drawn anew each update "
        "from all earlier warm-up updates, stratified by target (saved with the state store)")

    PRESETS: ClassVar[dict[str, dict[str, object]]] = {"cpu-demo": {
        "batch_size": 2, "horizon": 2, "branches": 2, "max_tokens": 32,
        "critic_max_tokens": 8, "max_turns": 6}}

    def problems(self) -> list[str]:
        checks = [
            (min(self.warmup_updates, self.td_updates) < 0
             or self.warmup_updates + self.td_updates < 1,
             "--warmup-updates and --td-updates must be >= 0, with at least one update"),
            (min(self.horizon, self.store_capacity) < 1,
             "--horizon and --store-capacity must be positive"),
            (self.branches < 2, "--branches must be at least 2 (a group of one has no signal)"),
            (not 0 < self.fresh_fraction <= 1, "--fresh-fraction must be in (0, 1]"),
            (0 < self.fresh_fraction < 1 and self.batch_size > 0
             and fresh_quota(self.batch_size, self.fresh_fraction) == self.batch_size,
             f"--fresh-fraction {self.fresh_fraction} of --batch-size {self.batch_size} rounds "
             "up to every group: raise the batch or pass 1"),
            (self.staleness < 1, "--staleness must be >= 1: a state is drawn at least one "
             "policy version after it was made"),
            (not (math.isfinite(self.r_max) and self.r_max > 0), "--r-max must be positive"),
            (self.is_cap < 1, "--is-cap must be at least 1"),
            (self.critic_replay < 0, "--critic-replay must be >= 0"),
        ]
        return [*super().problems(), *(message for failed, message in checks if failed)]

    def branches_per_task(self) -> int:
        return self.branches


def parse_args(argv: Sequence[str] | None = None) -> Args:
    return parse_run_args(Args, argv, "agent-gym train tempo", DESCRIPTION)


# --------------------------------------------------------------------- the method's formulas
def macro_returns(rewards: Sequence[float], end_values: Sequence[float]) -> np.ndarray:
    """R_n = r_n + V(end_n)."""
    return np.asarray(rewards, dtype=np.float64) + np.asarray(end_values, dtype=np.float64)


def prefix_weight(current_sum: float, old_sum: float, cap: float) -> tuple[float, bool]:
    """w = min(cap, exp(current - old)) and whether the cap cut it."""
    log_ratio = current_sum - old_sum
    if log_ratio >= math.log(cap):
        return cap, True
    return math.exp(log_ratio), False


# --------------------------------------------------------------------- the loop
@dataclass(frozen=True)
class Tempo:
    """What every update of a TEMPO run shares beyond the run itself."""

    run: Run
    args: Args
    critic: Critic
    full: RolloutConfig  # warm-up: whole episodes
    macro: RolloutConfig  # TD: H turns


@dataclass
class Batch:
    """One update's datums (for the run's objective, and for cross-entropy), metrics and
    the states it found."""

    datums: list[Datum]
    supervised: list[Datum]
    metrics: Metrics
    states: list[ResumePoint]


def train(args: Args, service: ServiceClient | None = None) -> list[Metrics]:
    """Run (or resume) TEMPO; returns this invocation's per-update metrics."""
    history: list[Metrics] = []
    args = device_defaults(args)
    with open_run(args, args.warmup_updates + args.td_updates, service) as run:
        # ---- the state store: empty, or the one saved with the checkpoint resumed from
        store = StateStore(args.store_capacity, args.staleness)
        if run.resumed is not None:
            if run.resumed.store is None:
                raise RunConfigError(f"the checkpoint in {run.out} has no state store: it is "
                                     "not a TEMPO run")
            saved = (run.out / run.resumed.store).read_text(encoding="utf-8")
            store = StateStore.from_json(saved, args.store_capacity, args.staleness)
        budgets = {"group_size": args.branches, "max_tokens": args.max_tokens,
                   "max_trajectory_tokens": args.max_trajectory_tokens,
                   "temperature": args.temperature, "keep_states": True,
                   "cut_continues": True}
        tempo = Tempo(
            run, args, Critic(run.renderer, r_max=args.r_max, max_tokens=args.critic_max_tokens),
            full=RolloutConfig(max_turns=run.max_turns, **budgets),
            macro=RolloutConfig(max_turns=args.horizon, **budgets),
        )
        for step in run.progress():
            t0 = time.perf_counter()
            # ---- a fresh sampler on the current weights: policy version `step`
            sampler = run.training.save_weights_and_get_sampling_client()
            warmup = step < args.warmup_updates
            if warmup:
                batch = asyncio.run(warmup_batch(tempo, sampler, step, store))
            else:
                batch = asyncio.run(td_batch(tempo, sampler, step, store))
            t1 = time.perf_counter()

            # ---- one update on actor and critic datums together
            trained = run.update(batch.datums, supervised=batch.supervised,
                                 objective=off_policy_objective(
                                     run.objective, args.sampler, args.sampler_precision, 0,
                                     MAX_IMPORTANCE_WEIGHT))
            t2 = time.perf_counter()
            evicted = store.add(batch.states)

            # ---- metrics, then checkpoint (weights, optimizer and store)
            row = {"step": step, "phase": "warmup" if warmup else "td", **batch.metrics,
                   "td/stored": len(batch.states), "td/evicted": evicted,
                   "td/store_size": len(store), **trained, "time_rollout": t1 - t0,
                   "time_train": t2 - t1, "time_step": time.perf_counter() - t0}
            run.finish(step, row, store, shown={"error": row.get("critic/abs_error_mean"),
                                                "store": len(store)})
            history.append(row)
    return history


# --------------------------------------------------------------------- warm-up
async def warmup_batch(tempo: Tempo, sampler: Sampler, step: int, store: StateStore) -> Batch:
    """Full episodes; the critic learns the Monte Carlo return at the openings and at turns
    H, 2H, ..."""
    run, args, rng = tempo.run, tempo.args, tempo.run.rng(step)
    tasks = run.tasks(rng, args.batch_size)
    groups = await rollout_groups(
        run.envs, tasks, sampler, run.renderer, tempo.full,
        seeds=[run.seed(step, "warmup", g) for g in range(len(tasks))],
        concurrency=args.concurrency,
    )
    episodes = [episode for group in groups for episode in group]
    asked = monte_carlo_targets(groups, args.horizon)
    # Every boundary is stored for TD; the openings are not (TD draws fresh tasks itself).
    cuts = [cut(e, k, step) if k else None for e, k, _ in asked]
    states = [state for state in cuts if state is not None]
    # The critic is trained on at most one state per branch rolled out, a TD update's cost.
    chosen = sorted(rng.choice(len(asked), size=min(len(asked), len(episodes)), replace=False))
    prompts = [_opening_prompt(tempo, asked[i][0]) if cuts[i] is None
               else _critic_prompt(tempo, cuts[i]) for i in chosen]
    targets = [asked[i][2] for i in chosen]
    replies, supervised, metrics = await _critic_fit(tempo, sampler, prompts, targets,
                                                     run.seed(step, "critic", 0))
    replayed = _replayed(store, args, targets, rng)
    if args.critic_replay:  # one target reply per state, kept with the store
        store.critic_replay.extend((reply.sequence, target)
                                   for reply, target in zip(replies, targets, strict=True))
    metrics |= rollout_metrics(episodes)
    metrics |= {"warmup/boundary_states": len(states), "critic/replayed": len(replayed)}
    return Batch([], supervised + replayed, metrics, states)


def monte_carlo_targets(
    groups: Sequence[Sequence[Episode]], horizon: int
) -> list[tuple[Episode, int, float]]:
    """Where warm-up may ask the critic, as (episode, turn, target); turn 0 is the opening.

    Each task's opening is where every fresh TD group starts, so the critic must value it
    too; all N branches left from there, so its target is their mean return (a less noisy
    estimate than any one of them). Then every boundary H, 2H, ... before an episode's last
    turn: the episode went on from there, so the state is not terminal and the rewards it
    still collected are a Monte Carlo return."""
    asked = [(group[0], 0, float(np.mean([e.reward for e in group]))) for group in groups
             if group]
    asked += [(e, k, e.reward - sum(e.step_rewards[:k])) for group in groups for e in group
              for k in range(horizon, e.turns, horizon)]
    return asked


# --------------------------------------------------------------------- TD update
async def td_batch(tempo: Tempo, sampler: Sampler, step: int, store: StateStore) -> Batch:
    """Macro-steps from stored states and fresh tasks; actor and critic datums."""
    run, args, rng = tempo.run, tempo.args, tempo.run.rng(step)
    # ---- start points: stored states (consumed) and at least the fresh quota of new tasks
    restored, stale = store.draw(args.batch_size, args.fresh_fraction, step, rng)
    fresh = args.batch_size - len(restored)
    starts = [*restored, *run.tasks(rng, fresh)]

    # ---- prefix importance weights of the restored states under the current policy
    weights = [1.0] * len(starts)
    clipped = [False] * len(starts)
    scored = await asyncio.gather(*(
        sampler.compute_logprobs_async(ModelInput.from_ints(list(s.sequence.tokens)))
        for s in restored
    ))
    for i, (state, logprobs) in enumerate(zip(restored, scored, strict=True)):
        weights[i], clipped[i] = prefix_weight(
            state.sequence.score(logprobs), state.sequence.logprob_sum, args.is_cap
        )

    # ---- N branches of H turns from each start
    groups = await rollout_groups(
        run.envs, starts, sampler, run.renderer, tempo.macro,
        seeds=[run.seed(step, "td", g) for g in range(len(starts))],
        concurrency=args.concurrency,
    )

    # ---- the critic's value at every endpoint (0 where the episode is over)
    episodes = [e for g in groups for e in g]
    end_values = iter(await tempo.critic.values(sampler, [
        None if e.end_reason in TERMINAL_ENDS
        else tempo.critic.prompt(e.messages, e.opening_messages, e.privileged)
        for e in episodes
    ]))

    # ---- actor signals: R_n = r_n + V(end_n), A_n = (R_n - mean R) * w
    datums: list[Datum] = []
    targets: list[float] = []
    degenerate = 0
    paid: list[tuple[list[float], list[float]]] = []
    for group, weight in zip(groups, weights, strict=True):
        ends = [next(end_values) for _ in group]
        group_datums, target = actor_update(group, ends, weight)
        targets.append(target)
        if group_datums is None:
            degenerate += 1
        else:
            datums += group_datums
        paid.append(([e.reward for e in group], ends))

    # ---- critic signals at the start states, against G = mean R
    start_prompts = [
        _critic_prompt(tempo, g[0].start) if g[0].start is not None
        else _opening_prompt(tempo, g[0]) for g in groups
    ]
    _, supervised, metrics = await _critic_fit(tempo, sampler, start_prompts, targets,
                                               run.seed(step, "start", 0))
    replayed = _replayed(store, args, targets, rng)

    # ---- where branches stopped at the horizon with room to go on: new states
    states = [
        cut(e, e.turns, step) for e in episodes
        if e.end_reason == "max_turns" and e.next_prompt is not None
        and len(e.next_prompt) < args.max_trajectory_tokens
    ]
    weighted = weights[: len(restored)]
    metrics |= rollout_metrics(episodes)
    metrics |= {
        "actor/value_gap_zero_reward": value_gap_zero_reward(paid),
        "actor/degenerate_group_rate": degenerate / len(groups),
        "actor/return_mean": float(np.mean(targets)),
        "actor/datums": len(datums),
        "critic/replayed": len(replayed),
        "td/fresh_states": fresh,
        "td/restored_states": len(restored),
        "td/stale_dropped": stale,
        "is/weight_mean": float(np.mean(weighted)) if weighted else None,
        "is/clip_rate": float(np.mean(clipped[: len(restored)])) if restored else None,
    }
    return Batch(datums, supervised + replayed, metrics, states)


# --------------------------------------------------------------------- shared pieces
def actor_update(
    group: Sequence[Episode], end_values: Sequence[float], weight: float
) -> tuple[list[Datum] | None, float]:
    """One group's actor datums, A_n = (R_n - G) * w on every token branch n sampled (None
    for a degenerate group), and G = mean R, the critic's target at the start state."""
    returns = macro_returns([e.reward for e in group], end_values)
    advantages = group_advantages(returns)
    if advantages is None:
        return None, float(returns.mean())
    datums = [build_datum(e.sequence, float(a * weight))
              for e, a in zip(group, advantages, strict=True) if e.turns]
    return datums, float(returns.mean())


def _replayed(
    store: StateStore, args: Args, targets: Sequence[float], rng: np.random.Generator
) -> list[Datum]:
    """This update's ``--critic-replay`` datums, beside its own ``targets``."""
    return [cross_entropy_datum(sequence)
            for sequence in replay(store.critic_replay, args.critic_replay, targets, rng)]


def _critic_prompt(tempo: Tempo, state: ResumePoint) -> list[int]:
    return tempo.critic.prompt(state.messages, state.opening, state.privileged)


async def _critic_fit(
    tempo: Tempo, sampler: Sampler, prompts: Sequence[list[int]], targets: Sequence[float],
    seed: int,
) -> tuple[list[CriticSample], list[Datum], Metrics]:
    """At each state: the reply stating its target (returned, and trained as a datum), the
    critic's estimate (the median readout) and one greedy reply, whose parse rate says
    whether the critic states values at all; with the critic's metrics."""
    critic = tempo.critic
    replies, estimates, greedy = await asyncio.gather(
        asyncio.gather(*(critic.target_reply(sampler, prompt, target)
                         for prompt, target in zip(prompts, targets, strict=True))),
        critic.values(sampler, prompts),
        asyncio.gather(*(critic.sample(sampler, prompt, 1, seed + i)
                         for i, prompt in enumerate(prompts))),
    )
    datums, metrics = critic_fit(replies, estimates, targets, [s for g in greedy for s in g])
    return list(replies), datums, metrics


def _opening_prompt(tempo: Tempo, episode: Episode) -> list[int]:
    """The critic's prompt at a fresh episode's start: its opening, no history yet."""
    opening = episode.opening_messages
    return tempo.critic.prompt(episode.messages[:opening], opening, episode.privileged)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    history = train(args)
    last = history[-1] if history else {}
    print(final_line(history, Path(args.out), critic_abs_error=last.get("critic/abs_error_mean"),
                     store=last.get("td/store_size")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
