"""Two runs on the same tasks, side by side: which is better, by how much, and where.

Episodes are paired by ``(env_id, task_id, rollout)`` (see ``agent_gym.eval.runs``): only
tasks both runs played count, so a longer or a resumed run compares fairly with a short
one. The success difference gets Newcombe's interval for paired proportions (method 10 of
Newcombe 1998, *Statistics in Medicine* 17:2635), which combines the two runs' Wilson
intervals with the correlation of their outcomes on the same task: pairing is what makes a
comparison of 50 shared tasks sharp, and unlike the Wald interval it stays inside [-1, 1]
and is not degenerate at 0 or 100%.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agent_gym.eval.config import EvalConfig
from agent_gym.eval.runs import EpisodeKey, Run
from agent_gym.eval.stats import wilson_interval
from agent_gym.eval.summary import ReplyCounts


class CompareError(ValueError):
    """The runs cannot be compared (no task in common)."""


@dataclass(frozen=True)
class PairedDifference:
    """``b - a`` success rate over paired outcomes with its 95% interval.

    ``both``: tasks both solved; ``only_a``/``only_b``: solved by one run only (the flips);
    ``neither``: by none.
    """

    both: int
    only_a: int
    only_b: int
    neither: int
    difference: float
    low: float
    high: float

    @property
    def pairs(self) -> int:
        return self.both + self.only_a + self.only_b + self.neither


def paired_difference(
    both: int, only_a: int, only_b: int, neither: int, z: float = 1.96
) -> PairedDifference:
    """Newcombe's method 10: the score interval for ``p_b - p_a`` from paired outcomes."""
    n = both + only_a + only_b + neither
    if n == 0:
        raise CompareError("no paired outcomes to compare")
    p_a, p_b = (both + only_a) / n, (both + only_b) / n
    low_a, high_a = wilson_interval(both + only_a, n, z)
    low_b, high_b = wilson_interval(both + only_b, n, z)
    # The correlation of the two runs' outcomes (phi of the 2x2 table); 0 when one run's
    # outcomes are constant, where it is undefined.
    margins = (both + only_a) * (only_b + neither) * (both + only_b) * (only_a + neither)
    phi = (both * neither - only_a * only_b) / math.sqrt(margins) if margins else 0.0
    # Newcombe writes theta = p_1 - p_2 with run 1 = b here (delta: how far below, epsilon:
    # how far above theta the limits lie).
    delta = math.sqrt(max(0.0, (p_b - low_b) ** 2 - 2 * phi * (p_b - low_b) * (high_a - p_a)
                          + (high_a - p_a) ** 2))
    epsilon = math.sqrt(max(0.0, (high_b - p_b) ** 2 - 2 * phi * (high_b - p_b) * (p_a - low_a)
                            + (p_a - low_a) ** 2))
    theta = p_b - p_a
    return PairedDifference(both, only_a, only_b, neither, theta,
                            max(-1.0, theta - delta), min(1.0, theta + epsilon))


@dataclass(frozen=True)
class EnvComparison:
    """One env's paired tasks; ``counts_a/b`` tell whether a side's success rate measured
    anything (its invalid actions and cut replies, see ``ReplyCounts``)."""

    env_id: str
    success: PairedDifference
    reward_a: float
    reward_b: float
    counts_a: ReplyCounts
    counts_b: ReplyCounts
    fixed: list[EpisodeKey] = field(default_factory=list)  # failed in a, solved in b
    broken: list[EpisodeKey] = field(default_factory=list)  # solved in a, failed in b


@dataclass(frozen=True)
class Comparison:
    """Run ``b`` against baseline ``a`` over the tasks both played."""

    label_a: str
    label_b: str
    overall: PairedDifference
    reward_a: float
    reward_b: float
    envs: list[EnvComparison]
    only_in_a: int  # episodes without a partner, left out
    only_in_b: int
    counts_a: ReplyCounts
    counts_b: ReplyCounts
    notes: list[str] = field(default_factory=list)  # a side's invalid actions or cuts dominate

    @property
    def fixed(self) -> list[EpisodeKey]:
        return [key for env in self.envs for key in env.fixed]

    @property
    def broken(self) -> list[EpisodeKey]:
        return [key for env in self.envs for key in env.broken]


def pooled_episodes(runs: Sequence[Run]) -> dict[EpisodeKey, dict]:
    """The episodes of one side of a comparison (a run, or a suite's runs, one per env)."""
    episodes: dict[EpisodeKey, dict] = {}
    for run in runs:
        clash = [key for key in run.episodes if key in episodes]
        if clash:
            raise CompareError(
                f"{run.path} plays the same tasks of {run.config.env_id} as another run given "
                "with it (a suite with several policies?); compare those run directories"
            )
        episodes.update(run.episodes)
    return episodes


def compare(a: Sequence[Run], b: Sequence[Run], label_a: str, label_b: str) -> Comparison:
    """Compare side ``b`` with baseline side ``a``; ``CompareError`` without shared tasks."""
    episodes_a, episodes_b = pooled_episodes(a), pooled_episodes(b)
    shared = [key for key in episodes_a if key in episodes_b]
    if not shared:
        raise CompareError(f"{label_a} and {label_b} have no task in common to compare: "
                           f"{_why_unpaired(a, b)}")
    envs = []
    for env_id in sorted({key[0] for key in shared}):
        keys = [key for key in shared if key[0] == env_id]
        envs.append(_compare_env(env_id, keys, episodes_a, episodes_b))
    counts_a = ReplyCounts.of([episodes_a[k] for k in shared])
    counts_b = ReplyCounts.of([episodes_b[k] for k in shared])
    notes = [f"{name}: {note}"
             for name, side, counts in (("A", a, counts_a), ("B", b, counts_b))
             for note in counts.notes(side[0].config.max_tokens)]
    configs_a, configs_b = _configs(a), _configs(b)
    for env_id in sorted({key[0] for key in shared}):
        differ = _settings_differ(configs_a[env_id], configs_b[env_id])
        if differ:
            notes.append(f"A and B ran {env_id} with different settings ({'; '.join(differ)}): "
                         "a difference may be the settings', not the policies'")
    return Comparison(
        label_a, label_b,
        overall=_paired(shared, episodes_a, episodes_b),
        reward_a=statistics.fmean(episodes_a[k]["reward"] for k in shared),
        reward_b=statistics.fmean(episodes_b[k]["reward"] for k in shared),
        envs=envs,
        only_in_a=len(episodes_a) - len(shared),
        only_in_b=len(episodes_b) - len(shared),
        counts_a=counts_a, counts_b=counts_b, notes=notes,
    )


def _configs(side: Sequence[Run]) -> dict[str, EvalConfig]:
    return {run.config.env_id: run.config for run in side}


# The settings besides the policy that change what a run measures, as the command line
# names them (the env's own arguments are listed one by one).
_POLICY_SETTINGS = {"max_tokens": "--max-tokens", "temperature": "--temperature",
                    "history_window": "--history-window"}


def _settings_differ(a: EvalConfig, b: EvalConfig) -> list[str]:
    """How two runs of one env differ in settings, in the user's words; seeds are left
    out (pairing by task makes them irrelevant), as is the policy (what is compared)."""
    found = [f"{key} {_shown(a.env_kwargs, key)} in A, {_shown(b.env_kwargs, key)} in B"
             for key in sorted({*a.env_kwargs, *b.env_kwargs})
             if a.env_kwargs.get(key, _DEFAULT) != b.env_kwargs.get(key, _DEFAULT)]
    found += [f"{option} {getattr(a, name)} in A, {getattr(b, name)} in B"
              for name, option in _POLICY_SETTINGS.items() if getattr(a, name) != getattr(b, name)]
    return found


_DEFAULT = object()


def _shown(kwargs: dict[str, Any], key: str) -> str:
    return json.dumps(kwargs[key]) if key in kwargs else "(the default)"


def _why_unpaired(a: Sequence[Run], b: Sequence[Run]) -> str:
    """What to change so two sides share tasks: the env, the seed, or the env's settings."""
    configs_a, configs_b = _configs(a), _configs(b)
    common = sorted(configs_a.keys() & configs_b.keys())
    if not common:
        return (f"A plays {', '.join(sorted(configs_a))} and B {', '.join(sorted(configs_b))}; "
                "compare runs of the same env")
    first_a, first_b = configs_a[common[0]], configs_b[common[0]]
    if first_a.seed != first_b.seed:
        return (f"A ran with --seed {first_a.seed} and B with --seed {first_b.seed}, and the "
                "seed chooses which tasks the episodes play; rerun B with "
                f"--seed {first_a.seed} (or more --episodes) to play A's tasks")
    differ = _settings_differ(first_a, first_b)
    if differ:
        return f"their settings differ ({'; '.join(differ)}) and choose other tasks"
    return "their task ids differ (the env's data changed between them?)"


def _compare_env(env_id: str, keys: list[EpisodeKey], a: dict, b: dict) -> EnvComparison:
    return EnvComparison(
        env_id, _paired(keys, a, b),
        reward_a=statistics.fmean(a[k]["reward"] for k in keys),
        reward_b=statistics.fmean(b[k]["reward"] for k in keys),
        counts_a=ReplyCounts.of([a[k] for k in keys]),
        counts_b=ReplyCounts.of([b[k] for k in keys]),
        fixed=[k for k in keys if not a[k]["success"] and b[k]["success"]],
        broken=[k for k in keys if a[k]["success"] and not b[k]["success"]],
    )


def _paired(keys: list[EpisodeKey], a: dict, b: dict) -> PairedDifference:
    outcomes = [(bool(a[k]["success"]), bool(b[k]["success"])) for k in keys]
    return paired_difference(
        both=outcomes.count((True, True)), only_a=outcomes.count((True, False)),
        only_b=outcomes.count((False, True)), neither=outcomes.count((False, False)),
    )


def format_comparison(comparison: Comparison, max_flips: int = 20) -> str:
    """The terminal view: per-env table, overall line, notes, and the tasks that flipped."""
    header = ("env", "pairs", "success A", "success B", "B - A [95% CI, Newcombe paired]",
              "reward A", "reward B", "invalid A/B", "cut A/B", "fixed", "broken")
    rows = [header]
    for env in comparison.envs:
        rows.append(_row(env.env_id.removeprefix("agent_gym/"), env.success, env.reward_a,
                         env.reward_b, env.counts_a, env.counts_b, len(env.fixed),
                         len(env.broken)))
    if len(comparison.envs) > 1:
        rows.append(_row("all", comparison.overall, comparison.reward_a, comparison.reward_b,
                         comparison.counts_a, comparison.counts_b, len(comparison.fixed),
                         len(comparison.broken)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [f"A = {comparison.label_a}", f"B = {comparison.label_b}"]
    table = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    table.insert(1, "  ".join("-" * w for w in widths))
    lines += table
    if comparison.only_in_a or comparison.only_in_b:
        lines.append(f"unpaired episodes left out: {comparison.only_in_a} of A, "
                     f"{comparison.only_in_b} of B")
    lines += [f"note: {note}" for note in comparison.notes]
    for title, keys in (("fixed (failed in A, solved in B)", comparison.fixed),
                        ("broken (solved in A, failed in B)", comparison.broken)):
        if keys:
            lines.append(f"{title}: {len(keys)}")
            lines += [f"  {_key_text(key)}" for key in keys[:max_flips]]
            if len(keys) > max_flips:
                lines.append(f"  ... and {len(keys) - max_flips} more (all in the HTML report)")
    return "\n".join(lines)


def _row(name: str, d: PairedDifference, reward_a: float, reward_b: float,
         counts_a: ReplyCounts, counts_b: ReplyCounts, fixed: int, broken: int
         ) -> tuple[str, ...]:
    n = d.pairs
    return (name, str(n), f"{(d.both + d.only_a) / n:.3f}", f"{(d.both + d.only_b) / n:.3f}",
            f"{d.difference:+.3f} [{d.low:+.3f}, {d.high:+.3f}]", f"{reward_a:.3f}",
            f"{reward_b:.3f}", f"{_share(counts_a.invalid_share)}/{_share(counts_b.invalid_share)}",
            f"{_share(counts_a.cut_share)}/{_share(counts_b.cut_share)}", str(fixed), str(broken))


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _key_text(key: EpisodeKey) -> str:
    env_id, task_id, rollout = key
    return f"{env_id.removeprefix('agent_gym/')} {task_id}" + (f" #{rollout}" if rollout else "")
