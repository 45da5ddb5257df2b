"""TEMPO's critic, fitted and judged: its datums and accuracy metrics (``critic_update``,
``critic_fit`` by ``--critic-loss``), the replay of warm-up replies (``--critic-replay``) and
the measures a critic is held to (``best_constant_error``, ``value_corr``,
``value_gap_zero_reward``). The method and its loop are ``agent_gym_train.tempo``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np
from pytrio import Datum

from agent_gym_train.critic import CriticSample, critic_rewards
from agent_gym_train.episode import build_datum, cross_entropy_datum
from agent_gym_train.runfiles import Metrics, RunConfigError

if TYPE_CHECKING:
    from agent_gym_train.tempo import Args

Item = TypeVar("Item")


def centred(values: Sequence[float] | np.ndarray) -> np.ndarray | None:
    """``values - mean(values)``, or None when they are all equal (a degenerate group)."""
    array = np.asarray(values, dtype=np.float64)
    if np.ptp(array) == 0:
        return None
    return array - array.mean()


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


def replay(
    pool: Sequence[tuple[Item, float]], count: int, targets: Sequence[float],
    rng: np.random.Generator,
) -> list[Item]:
    """``count`` of the earlier warm-up critic replies in ``pool`` (``--critic-replay``;
    each with its target), drawn so that with this update's own ``targets`` the update
    fits targets distributed as all of the pool's.

    Warm-up finds a few states per update and fits each once; a critic fitted on ~100
    states once each settles on their mean, not on what tells them apart. A cross-entropy
    datum needs no fresh logprobs, so an old state trains again for a forward-backward.
    The draw is stratified by target because one update's few states are mostly one
    outcome or the other, and fitting them swings the critic's overall level (on Search-v0
    it answered 0, then 1, then 0.5 everywhere): the level moved more between updates than
    the value between the states of one. Each target value gets its share of the update's
    datums (less what the update holds already); leftover places are drawn at random."""
    count = min(count, len(pool))
    if not count:  # no draw: a run without replay keeps its random stream
        return []
    by_target: dict[float, list[int]] = {}
    for index, (_, target) in enumerate(pool):
        by_target.setdefault(target, []).append(index)
    total = count + len(targets)
    chosen: list[int] = []
    for target, indices in sorted(by_target.items()):
        share = round(total * len(indices) / len(pool)) - sum(t == target for t in targets)
        take = min(max(share, 0), len(indices), count - len(chosen))
        chosen += [int(i) for i in rng.choice(indices, take, replace=False)]
    rest = np.setdiff1d(np.arange(len(pool)), chosen)
    chosen += [int(i) for i in rng.choice(rest, count - len(chosen), replace=False)]
    return [pool[i][0] for i in sorted(chosen)]


def best_constant_error(per_state: Sequence[Sequence[float | int | None]]) -> float | None:
    """The mean absolute error of the best constant in hindsight on the parsed critic samples
    of some states (``[target, parsed samples, mean value]`` each, as ``critic_update``
    reports them): every parsed sample is scored against its state's target, and the
    constant is the median of those targets, which minimises the mean absolute error (the
    mean does not: on targets 0, 0, 1 it scores 0.44, the median 0.33). None: nothing
    parsed."""
    scored = [float(target) for target, parsed, _ in per_state for _ in range(int(parsed))]
    if not scored:
        return None
    return float(np.mean(np.abs(np.subtract(scored, np.median(scored)))))


def critic_update(
    samples: Sequence[Sequence[CriticSample]], targets: Sequence[float], r_max: float,
    target_replies: Sequence[CriticSample] | None = None,
    estimates: Sequence[float] | None = None,
) -> tuple[list[Datum], Metrics]:
    """Critic datums (rewards centred per start state) and the critic's accuracy metrics.

    ``target_replies`` (one per state, ``Critic.target_reply``) join their state's group
    for training only: the metrics are the sampled replies' alone.

    ``estimates`` (one per state): the critic's value read otherwise than from these
    samples (``--critic-readout median``). The accuracy metrics are then the estimates',
    one value per state (``critic/parsed`` counts them); the samples still train (under the
    reward rule) and give the parse rate.

    ``critic/abs_error_constant`` is what the best constant in hindsight would have scored
    on the same parsed samples (``best_constant_error``); a critic below it tells states
    apart. It is fitted to this update alone; ``critic/per_state`` ([target, parsed
    samples, their mean value] per state) lets a reader pool updates and fit one constant
    to all of them, the best constant predictor of the whole run."""
    datums: list[Datum] = []
    errors: list[float] = []
    means: list[float] = []
    matched: list[float] = []
    per_state: list[list[float | int | None]] = []
    degenerate = 0
    shown = target_replies if target_replies is not None else [None] * len(samples)
    read = [[e] for e in estimates] if estimates is not None else [None] * len(samples)
    for group, target, reply, estimate in zip(samples, targets, shown, read, strict=True):
        parsed = estimate if estimate is not None else [s.value for s in group
                                                         if s.value is not None]
        errors += [abs(v - target) for v in parsed]
        mean = float(np.mean(parsed)) if parsed else None
        per_state.append([float(target), len(parsed), mean])
        if mean is not None:
            means.append(mean)
            matched.append(target)
        trained = [*group, reply] if reply is not None else list(group)
        advantages = centred(critic_rewards([s.value for s in trained], target, r_max))
        if advantages is None:
            degenerate += 1
            continue
        datums += [build_datum(s.sequence, float(a))
                   for s, a in zip(trained, advantages, strict=True)]
    return datums, {
        "critic/abs_error_mean": float(np.mean(errors)) if errors else None,
        "critic/abs_error_constant": best_constant_error(per_state),
        "critic/parsed": len(errors),
        "critic/value_corr": value_corr(means, matched),
        "critic/value_mean": float(np.mean(means)) if means else None,
        "critic/target_mean": float(np.mean(targets)) if len(targets) else None,
        "critic/states": len(samples),
        "critic/degenerate_group_rate": degenerate / len(samples) if len(samples) else None,
        "critic/datums": len(datums),
        "critic/per_state": per_state,
    }


def critic_fit(
    samples: Sequence[Sequence[CriticSample]], targets: Sequence[float], args: Args,
    target_replies: Sequence[CriticSample] | None, estimates: Sequence[float] | None = None,
) -> tuple[list[Datum], list[Datum], Metrics]:
    """The critic's datums by ``--critic-loss``: (policy-loss datums, cross-entropy datums,
    metrics). Either way the metrics are those of ``critic_update``: the sampled replies',
    or the ``estimates`` where the value is read otherwise.

    ``cross_entropy`` is regression onto G in the critic's own words: every state trains,
    where the reward rule learns nothing from a state whose samples all agree with G and
    little from one they nearly match."""
    if args.critic_loss == "reward":
        datums, metrics = critic_update(samples, targets, args.r_max, target_replies,
                                        estimates)
        return datums, [], metrics
    if target_replies is None:
        raise RunConfigError("--critic-loss cross_entropy needs the target replies")
    _, metrics = critic_update(samples, targets, args.r_max, estimates=estimates)
    supervised = [cross_entropy_datum(reply.sequence) for reply in target_replies]
    return [], supervised, metrics | {"critic/datums": len(supervised),
                                      "critic/degenerate_group_rate": None}


def failure_rate(samples: Sequence[CriticSample]) -> float | None:
    """The share of critic replies that stated no value."""
    return sum(s.value is None for s in samples) / len(samples) if samples else None
