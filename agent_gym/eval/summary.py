"""A run's figures: ``Summary``, computing it from episode lines, and the run table."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent_gym.eval.config import EvalConfig
from agent_gym.eval.runfiles import (
    EPISODE_SCHEMA,
    EPISODES_FILE,
    read_log,
)
from agent_gym.eval.stats import (
    bootstrap_interval,
    pass_at_k,
    percentile,
    rate_interval,
    wilson_interval,
)

DOMINANT_SHARE = 0.5  # above it, invalid actions or cut replies are what a run measured


@dataclass(frozen=True)
class ReplyCounts:
    """What became of a run's replies: how many actions the env judged and how many of
    those it refused as invalid, and how many episodes ended on a reply that the token
    budget cut (the env never sees one).

    A success rate of 0.00 reads as a policy's skill; when most calls were malformed or
    most replies cut, it measured the protocol or the budget instead, so these are shown
    beside it and said out loud when they dominate.
    """

    episodes: int
    actions: int
    invalid: int
    cut: int

    @classmethod
    def of(cls, records: Sequence[Mapping[str, Any]]) -> ReplyCounts:
        cut = sum(r.get("end_reason") == "max_tokens" for r in records)
        # A cut reply is a turn the env never judged.
        actions = sum(int(r["turns"]) for r in records) - cut
        invalid = sum(int(r.get("invalid_actions", 0)) for r in records)
        return cls(len(records), actions, invalid, cut)

    @property
    def invalid_share(self) -> float | None:
        return self.invalid / self.actions if self.actions else None

    @property
    def cut_share(self) -> float | None:
        return self.cut / self.episodes if self.episodes else None

    def notes(self, max_tokens: int) -> list[str]:
        """A line for each of the two when it dominates the run."""
        notes = []
        if (self.cut_share or 0) > DOMINANT_SHARE:
            notes.append(
                f"most replies were cut by --max-tokens {max_tokens}: raise it ({self.cut} of "
                f"{self.episodes} episodes ended on a cut reply, which is never scored)"
            )
        if (self.invalid_share or 0) > DOMINANT_SHARE:
            notes.append(
                f"most actions were invalid ({self.invalid} of {self.actions}): the env "
                "refused them, so the success rate says little about the task; check that "
                "the policy's replies take the form the env's prompt asks for (a tool call, a "
                "command or a marked answer, whichever the env takes)"
            )
        return notes


@dataclass(frozen=True)
class Summary:
    """A run's figures; those a run with no finished episode cannot have are None (``null``
    in JSON, which has no NaN).

    ``tasks`` counts distinct tasks and ``episodes`` the episodes that played them: a task
    played again (more ``--episodes`` than the env has tasks, or rollouts) is more of the
    same task, not a new one, so ``success_rate`` and ``mean_reward`` weigh each task once
    and every interval is over tasks. Intervals are 95%. ``success_low/high`` are Wilson's
    when each task was played once, else ``rate_interval`` over the tasks' success rates;
    ``success_interval`` says which. Every ``pass_at_k`` interval is a ``rate_interval``
    too, and ``reward_low/high`` a percentile bootstrap over tasks.
    ``pass_at_k`` maps k to the unbiased estimate of Chen et al. (2021) averaged over the
    tasks with at least k finished rollouts (``tasks``). ``reply_latency`` is seconds per
    policy call (for an ``openai:`` policy: per request to its server, retries included).
    """

    env_id: str
    policy: str
    episodes: int
    errors: int
    success_rate: float | None
    success_low: float
    success_high: float
    mean_reward: float | None
    mean_turns: float | None
    mean_tokens: float | None
    latency_p50: float | None
    latency_p95: float | None
    # Generated stand-in data (the bundled ALFWorld games): never a benchmark number.
    synthetic: bool = False
    cut_replies: int = 0
    first_error: str | None = None
    rollouts_per_task: int = 1
    tasks: int = 0
    success_interval: str = "wilson"
    reward_low: float | None = None
    reward_high: float | None = None
    pass_at_k: dict[str, dict[str, float | int | None]] = field(default_factory=dict)
    context_length: int = 0
    end_reasons: dict[str, int] = field(default_factory=dict)
    finish_reasons: dict[str, int] = field(default_factory=dict)
    reply_latency_p50: float | None = None
    reply_latency_p95: float | None = None
    notes: list[str] = field(default_factory=list)
    interrupted: bool = False
    # Actions the env judged (cut replies are not) and those of them it refused.
    actions: int = 0
    invalid_actions: int = 0

    def reply_counts(self) -> ReplyCounts:
        return ReplyCounts(self.episodes, self.actions, self.invalid_actions, self.cut_replies)


def _task_key(record: Mapping[str, Any]) -> tuple[str, str]:
    """(env, task id): the task a record played, whichever episode or rollout played it.
    The env comes from the saved state, which a run pooled over envs (a suite's overall
    row) needs; a record whose state is unreadable (``agent-gym rescore`` reports those)
    still counts under its task id."""
    state = record.get("final_state")
    env_id = state.get("env_id") if isinstance(state, dict) else None
    return str(env_id), str(record["task_id"])


def summarize(
    config: EvalConfig, records: list[dict[str, Any]], errors: int, first_error: str | None = None,
    *, interrupted: bool = False,
) -> Summary:
    """Figures of a run's finished episodes; a task is one (env, task id), and every episode
    and rollout that played it is a sample of it (``overall`` pools tasks of many envs)."""
    n = len(records)
    by_task: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        by_task[_task_key(record)].append(record)
    task_rates = [statistics.fmean(bool(r["success"]) for r in rs) for rs in by_task.values()]
    task_rewards = [statistics.fmean(r["reward"] for r in rs) for rs in by_task.values()]
    rollouts = config.rollouts_per_task
    pass_k: dict[str, dict[str, float | int | None]] = {}
    for k in range(1, rollouts + 1):
        values = [pass_at_k(len(rs), sum(bool(r["success"]) for r in rs), k)
                  for rs in by_task.values() if len(rs) >= k]
        low, high = rate_interval(values)
        pass_k[str(k)] = {"estimate": statistics.fmean(values) if values else None,
                          "low": low, "high": high, "tasks": len(values)}
    once = len(by_task) == n  # each task played once: independent draws, Wilson's interval
    if once:
        low, high = wilson_interval(sum(bool(r["success"]) for r in records), n)
    else:
        low, high = rate_interval(task_rates)
    reward_low, reward_high = bootstrap_interval(task_rewards) if n else (None, None)
    tokens = [r["completion_tokens"] for r in records if r["completion_tokens"] is not None]
    latencies = [r["latency_s"] for r in records]
    replies = [reply for r in records for reply in r.get("replies", ())]
    reply_latencies = [reply["latency_s"] for reply in replies]
    ends = Counter(r.get("end_reason", "") for r in records)
    counts = ReplyCounts.of(records)
    return Summary(
        env_id=config.env_id,
        policy=config.policy,
        episodes=n,
        errors=errors,
        success_rate=statistics.fmean(task_rates) if n else None,
        success_low=float(low),
        success_high=float(high),
        mean_reward=statistics.fmean(task_rewards) if n else None,
        mean_turns=statistics.fmean(r["turns"] for r in records) if n else None,
        mean_tokens=statistics.fmean(tokens) if tokens else None,
        latency_p50=percentile(latencies, 0.5),
        latency_p95=percentile(latencies, 0.95),
        synthetic=any(r.get("synthetic", False) for r in records),
        cut_replies=counts.cut,
        first_error=first_error,
        rollouts_per_task=rollouts,
        tasks=len(by_task),
        success_interval="wilson" if once else "bootstrap over tasks, Wilson floor",
        reward_low=reward_low,
        reward_high=reward_high,
        pass_at_k=pass_k,
        context_length=ends["context_length"],
        end_reasons=dict(sorted(ends.items())),
        finish_reasons=dict(sorted(Counter(
            reply["finish_reason"] for reply in replies if reply.get("finish_reason")
        ).items())),
        reply_latency_p50=percentile(reply_latencies, 0.5),
        reply_latency_p95=percentile(reply_latencies, 0.95),
        notes=[*_repeat_notes(records, len(by_task)), *counts.notes(config.max_tokens),
               *_notes(config, replies)],
        interrupted=interrupted,
        actions=counts.actions,
        invalid_actions=counts.invalid,
    )


def _repeat_notes(records: Sequence[Mapping[str, Any]], tasks: int) -> list[str]:
    """A line when episodes played tasks again (more ``--episodes`` than the env has): the
    count that reads as "n" is not the count of independent evidence."""
    episodes = len({(_task_key(r)[0], int(r["episode"])) for r in records})
    if episodes <= tasks:
        return []
    return [f"{episodes} episodes played {tasks} distinct tasks (episodes past the env's "
            f"tasks play them again): each task counts once in the figures and the "
            f"interval is over the {tasks} tasks"]


def _notes(config: EvalConfig, replies: Sequence[Mapping[str, Any]]) -> list[str]:
    """What a user should know about how the server answered."""
    offered = [reply["tool_calls"] for reply in replies if reply.get("tool_calls") is not None]
    if offered and not any(offered):
        base = config.policy.partition("#")[0]
        return [
            f"tools were offered natively on {len(offered)} replies and none carried "
            "tool_calls: the server may ignore tools (llama-cpp-python's does unless started "
            "with a function-calling chat format such as --chat_format "
            "chatml-function-calling); describe them in the prompt with --policy "
            f"'{base}#text'"
        ]
    return []


def format_table(summaries: Sequence[Summary]) -> str:
    """The run table, then (when a run has several rollouts per task) its pass@k table.
    Episodes and distinct tasks are columns of their own: the interval is over the tasks.

    ``invalid`` is the share of actions the env refused, ``cut`` the share of episodes
    ended by the token budget (see ``ReplyCounts``)."""
    header = ("env", "policy", "episodes", "tasks", "success [95% CI over tasks]", "reward",
              "turns", "tokens", "invalid", "cut", "latency p50/p95 s", "reply p50/p95 s",
              "errors")
    rows = [header]
    for s in summaries:
        counts = s.reply_counts()
        rows.append((
            s.env_id.removeprefix("agent_gym/") + (" (synthetic data)" if s.synthetic else "")
            + (" (interrupted)" if s.interrupted else ""),
            s.policy, str(s.episodes), str(s.tasks),
            _figure(s.success_rate, ".2f") + f" [{s.success_low:.2f}, {s.success_high:.2f}]",
            _figure(s.mean_reward, ".3f"), _figure(s.mean_turns, ".1f"),
            _figure(s.mean_tokens, ".0f"),
            _figure(counts.invalid_share, ".2f"), _figure(counts.cut_share, ".2f"),
            f"{_figure(s.latency_p50, '.2f')}/{_figure(s.latency_p95, '.2f')}",
            f"{_figure(s.reply_latency_p50, '.2f')}/{_figure(s.reply_latency_p95, '.2f')}",
            str(s.errors),
        ))
    text = _aligned(rows)
    multi = [s for s in summaries if s.rollouts_per_task > 1]
    if multi:
        rows = [("env", "policy", "k", "pass@k [95% CI over tasks]", "tasks")]
        for s in multi:
            for k, row in s.pass_at_k.items():
                rows.append((s.env_id.removeprefix("agent_gym/"), s.policy, k,
                             _figure(row["estimate"], ".3f")
                             + f" [{row['low']:.3f}, {row['high']:.3f}]", str(row["tasks"])))
        text += "\n\n" + _aligned(rows)
    return text


def _aligned(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _figure(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def overall_summary(runs: Sequence[tuple[EvalConfig, Summary, Path]]) -> Summary:
    """One policy's figures over several envs' runs (a suite): every task of every env
    counts once, and ``summarize`` computes the intervals over all of those tasks; as each
    env's summary does, it covers every episode their directories hold (read, never
    changed, as every reader of a run reads them: ``agent_gym.eval.runfiles.read_log``)."""
    first = runs[0][0]
    records = []
    for _, _, out_dir in runs:
        kept = read_log(out_dir / EPISODES_FILE, EPISODE_SCHEMA).by_episode()[0]
        records += [kept[key] for key in sorted(kept)]
    config = EvalConfig("overall", first.policy, max(c.episodes for c, _, _ in runs),
                        rollouts_per_task=min(s.rollouts_per_task for _, s, _ in runs),
                        max_tokens=first.max_tokens)
    errors = sum(summary.errors for _, summary, _ in runs)
    first_error = next((s.first_error for _, s, _ in runs if s.first_error), None)
    return summarize(config, records, errors, first_error,
                     interrupted=any(s.interrupted for _, s, _ in runs))
