"""Benchmark a policy on an env: concurrent episodes, a JSONL log you can resume, a summary.

The run directory is the unit of work. ``config.json`` pins what is measured (env, its
arguments, policy, seed); ``episodes.jsonl`` gets one line per finished episode, counted
as done only once fsynced, so a run killed at any moment (even SIGKILL) resumes where it
stopped: finished episodes are kept, a half-written last line is cut off, and only the
missing (episode, rollout) pairs run again. Episode ``i`` plays task
``order[i % n]`` of a permutation of the env's n tasks seeded by ``seed`` (every task once
before any repeats), ``rollouts_per_task`` times; rollout 0 resets with seed ``seed + i``
and rollout ``r > 0`` with ``derive_seed(seed, i, r)``: a resumed run measures exactly what
an unbroken one would.

Every setting that changes results (env, its arguments, policy, seed, reply budget,
temperature, history window) is the run's identity: a resume with another value is refused.
Asking for more episodes or more rollouts per task extends a run; asking for fewer never
shrinks it: the directory's run is every episode it holds (``EvalConfig.covering``), so
``summary.json``, ``compare`` and ``view`` all read every episode on disk, and a rerun says
what it found there.

An episode whose prompt outgrows the policy's context ends ``context_length``: it is scored
with what the env paid until then and recorded like any other, so a resume never retries
it (errors, unlike it, are retried).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import math
import os
import statistics
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import gymnasium
import numpy as np
from tqdm import tqdm

from agent_gym.actions.protocols import ActionProtocol
from agent_gym.env.base import describe_env
from agent_gym.eval.policies import ContextLengthError, Policy, PolicyInput, derive_seed
from agent_gym.render import window_messages

EPISODES_FILE = "episodes.jsonl"
ERRORS_FILE = "errors.jsonl"


class RunMismatchError(ValueError):
    """A run directory already holds a run of something else."""


@dataclass(frozen=True)
class EvalConfig:
    """What a run measures: ``episodes`` tasks, each played ``rollouts_per_task`` times.

    ``max_tokens``, ``temperature`` and ``history_window`` are the policy's settings, stated
    here so that they are recorded with the run and a resume cannot mix them; the caller
    builds the policy with the same values (the command line does).
    """

    env_id: str
    policy: str
    episodes: int
    seed: int = 0
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    rollouts_per_task: int = 1
    max_tokens: int = 256
    temperature: float = 0.0
    history_window: int | None = None

    def __post_init__(self) -> None:
        if self.episodes < 1 or self.rollouts_per_task < 1:
            raise ValueError("episodes and rollouts_per_task must be at least 1")
        if self.history_window is not None and self.history_window < 1:
            raise ValueError("a history window keeps at least 1 turn")

    def differences(self, recorded: Mapping[str, Any]) -> list[str]:
        """The identity settings in which a recorded ``config.json`` differs from this run
        (more episodes or rollouts extend a run and are no difference)."""
        mine = json.loads(json.dumps(asdict(self)))
        return [
            f"{name}={recorded.get(name, '<not recorded>')!r} (this run: {mine[name]!r})"
            for name in IDENTITY
            if recorded.get(name, _MISSING) != mine[name]
        ]

    def covering(
        self, keys: Iterable[Key], recorded: Mapping[str, Any] | None = None
    ) -> EvalConfig:
        """This run grown to the counts a ``recorded`` config asked for and to every
        (episode, rollout) in ``keys``: a run directory only ever grows, so a rerun with
        fewer ``--episodes`` can never make its summary, ``compare`` or ``view`` read
        fewer episodes than it holds."""
        recorded = recorded or {}
        episodes, rollouts = [self.episodes], [self.rollouts_per_task]
        for counts, name in ((episodes, "episodes"), (rollouts, "rollouts_per_task")):
            value = recorded.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                counts.append(value)
        for episode, rollout in keys:
            episodes.append(episode + 1)
            rollouts.append(rollout + 1)
        return replace(self, episodes=max(episodes), rollouts_per_task=max(rollouts))


IDENTITY = ("env_id", "policy", "seed", "env_kwargs", "max_tokens", "temperature",
            "history_window")
_MISSING = object()
BOOTSTRAP_SAMPLES = 2000
BOOTSTRAP_SEED = 0


def episode_seed(seed: int, episode: int, rollout: int) -> int:
    """The reset seed of one rollout: rollout 0 keeps ``seed + episode`` (what runs used
    before rollouts existed), later ones get seeds derived from all three."""
    return seed + episode if rollout == 0 else derive_seed(seed, episode, rollout)


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
                "the policy calls the tool the way the env's prompt asks"
            )
        return notes


@dataclass(frozen=True)
class Summary:
    """A run's figures; those a run with no finished episode cannot have are None (``null``
    in JSON, which has no NaN).

    Intervals are 95%. ``success_low/high`` are Wilson's over episodes with one rollout per
    task, and with several ``rate_interval`` over tasks (a task's rollouts are not
    independent draws); ``success_interval`` says which. Every ``pass_at_k`` interval is a
    ``rate_interval`` too, and ``reward_low/high`` a percentile bootstrap over tasks.
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


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval: honest at 0%, 100% and small n, unlike the normal one."""
    if trials == 0:
        return 0.0, 1.0
    return _wilson(successes / trials, trials, z)


def _wilson(p: float, trials: int, z: float = 1.96) -> tuple[float, float]:
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (
        1 + z * z / trials
    )
    return max(0.0, centre - half), min(1.0, centre + half)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of a task with ``c`` successes in ``n`` samples (Chen et al. 2021):
    ``1 - C(n-c, k) / C(n, k)``, the chance that k of the n samples drawn without
    replacement include a success.

    Computed as ``1 - prod_{i=n-c+1..n} (1 - k/i)``: c factors in [0, 1), no binomial
    that overflows a float and no difference of two huge numbers.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def bootstrap_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (one value per task),
    seeded so a summary is reproducible."""
    if not values:
        return 0.0, 1.0
    data = np.asarray(values, dtype=float)
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    means = data[rng.integers(0, len(data), (BOOTSTRAP_SAMPLES, len(data)))].mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def rate_interval(values: Sequence[float]) -> tuple[float, float]:
    """95% interval of the mean of per-task rates in [0, 1] (success, pass@k): a percentile
    bootstrap over tasks, widened to at least Wilson's interval for one draw per task.

    The bootstrap alone collapses to a point when every task scored alike: 0 successes in
    72 episodes of 18 tasks would read [0, 0]. Counting each task once (its rollouts may be
    as good as copies of each other) gives the honest floor, here [0, 0.18].
    """
    if not values:
        return 0.0, 1.0
    low, high = bootstrap_interval(values)
    floor_low, floor_high = _wilson(statistics.fmean(values), len(values))
    return min(low, floor_low), max(high, floor_high)


def percentile(values: Sequence[float], q: float) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _task_key(record: Mapping[str, Any]) -> tuple[str, int]:
    """(env, episode): the task a record is a rollout of. The env comes from the saved
    state, which a run pooled over envs (a suite's overall row) needs; a record whose state
    is unreadable (``agent-gym rescore`` reports those) still counts under its episode."""
    state = record.get("final_state")
    env_id = state.get("env_id") if isinstance(state, dict) else None
    return str(env_id), int(record["episode"])


def summarize(
    config: EvalConfig, records: list[dict[str, Any]], errors: int, first_error: str | None = None,
    *, interrupted: bool = False,
) -> Summary:
    """Figures of a run's finished episodes; a task is one (env, episode) and its rollouts
    are ``config.rollouts_per_task`` samples of it (``overall`` pools tasks of many envs)."""
    n = len(records)
    successes = sum(bool(r["success"]) for r in records)
    by_task: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        by_task[_task_key(record)].append(record)
    rollouts = config.rollouts_per_task
    pass_k: dict[str, dict[str, float | int | None]] = {}
    for k in range(1, rollouts + 1):
        values = [pass_at_k(len(rs), sum(bool(r["success"]) for r in rs), k)
                  for rs in by_task.values() if len(rs) >= k]
        low, high = rate_interval(values)
        pass_k[str(k)] = {"estimate": statistics.fmean(values) if values else None,
                          "low": low, "high": high, "tasks": len(values)}
    if rollouts == 1:
        low, high = wilson_interval(successes, n)
    else:
        low, high = pass_k["1"]["low"], pass_k["1"]["high"]
    task_rewards = [statistics.fmean(r["reward"] for r in rs) for rs in by_task.values()]
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
        success_rate=successes / n if n else None,
        success_low=float(low),
        success_high=float(high),
        mean_reward=statistics.fmean(r["reward"] for r in records) if n else None,
        mean_turns=statistics.fmean(r["turns"] for r in records) if n else None,
        mean_tokens=statistics.fmean(tokens) if tokens else None,
        latency_p50=percentile(latencies, 0.5),
        latency_p95=percentile(latencies, 0.95),
        synthetic=any(r.get("synthetic", False) for r in records),
        cut_replies=counts.cut,
        first_error=first_error,
        rollouts_per_task=rollouts,
        tasks=len(by_task),
        success_interval="wilson" if rollouts == 1 else "bootstrap over tasks, Wilson floor",
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
        notes=counts.notes(config.max_tokens) + _notes(config, replies),
        interrupted=interrupted,
        actions=counts.actions,
        invalid_actions=counts.invalid,
    )


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

    ``invalid`` is the share of actions the env refused, ``cut`` the share of episodes
    ended by the token budget (see ``ReplyCounts``)."""
    header = ("env", "policy", "n", "success [95% CI]", "reward", "turns", "tokens", "invalid",
              "cut", "latency p50/p95 s", "reply p50/p95 s", "errors")
    rows = [header]
    for s in summaries:
        counts = s.reply_counts()
        rows.append((
            s.env_id.removeprefix("agent_gym/") + (" (synthetic data)" if s.synthetic else "")
            + (" (interrupted)" if s.interrupted else ""),
            s.policy, str(s.episodes),
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


Key = tuple[int, int]  # (episode, rollout)


class RunLog:
    """The run directory: config, finished episodes, errors; durable line by line.

    ``config`` is the run the directory holds: the one asked for, grown to what it held
    before (``EvalConfig.covering``), and written back to ``config.json``; ``found`` is how
    many episodes were already there.
    """

    def __init__(self, out_dir: Path, config: EvalConfig) -> None:
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        config_path = out_dir / "config.json"
        recorded = None
        if config_path.exists():
            recorded = json.loads(config_path.read_text(encoding="utf-8"))
            differences = config.differences(recorded)
            if differences:
                raise RunMismatchError(
                    f"{out_dir} holds another run: {'; '.join(differences)}. Rerun with the "
                    "recorded settings to resume it. Use another --out directory for a new run."
                )
        self.episodes_path = out_dir / EPISODES_FILE
        self.records = self._recover(self.episodes_path)
        self.found = len(self.records)
        self.config = config.covering(self.records, recorded)
        _write_atomically(config_path, json.dumps(asdict(self.config), indent=2))
        self._errors_path = out_dir / ERRORS_FILE
        self._errors_path.unlink(missing_ok=True)  # errored episodes are retried on resume
        self.errors = 0
        self.first_error: str | None = None
        self._episodes = _GroupCommitFile(self.episodes_path)
        self._errors: _GroupCommitFile | None = None  # opened at the first error

    @staticmethod
    def _recover(path: Path) -> dict[Key, dict[str, Any]]:
        """Finished episodes; cuts off a last line a kill left half-written."""
        if not path.exists():
            return {}
        records: dict[Key, dict[str, Any]] = {}
        good_bytes = 0
        with path.open("rb") as handle:
            for line in handle:
                if not line.endswith(b"\n"):
                    break
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    break
                records.setdefault(record_key(record), record)
                good_bytes += len(line)
        if good_bytes != path.stat().st_size:
            with path.open("r+b") as handle:
                handle.truncate(good_bytes)
        return records

    def finished(self) -> list[dict[str, Any]]:
        """Every finished episode of the run, in (episode, rollout) order."""
        return [self.records[key] for key in sorted(self.records)]

    def found_note(self, asked: EvalConfig, missing: int) -> str | None:
        """What a rerun found in the directory and what it will do about it; None for a
        fresh directory."""
        if not self.found:
            return None
        planned = asked.episodes * asked.rollouts_per_task
        note = f"found {self.found} episode{'s' * (self.found != 1)} in {self.out_dir}; " + (
            f"running the {missing} missing of the {planned} asked for" if missing
            else f"the {planned} asked for are all there")
        if self.found + missing > planned:
            whole = f"--episodes {self.config.episodes}" + (
                f" --rollouts-per-task {self.config.rollouts_per_task}"
                if self.config.rollouts_per_task > 1 else "")
            note += (f"; the summary covers all {self.found + missing}, more than asked for "
                     f"({whole} resumes the whole run; another --out starts a separate one)")
        return note

    def write(self, record: dict[str, Any]) -> Awaitable[None]:
        """Log a finished episode; the returned awaitable resolves once it is durable."""
        self.records[record_key(record)] = record
        return self._episodes.append(record)

    def write_error(self, key: Key, error: BaseException) -> Awaitable[None]:
        self.errors += 1
        text = f"{type(error).__name__}: {error}"
        self.first_error = self.first_error or text
        if self._errors is None:
            self._errors = _GroupCommitFile(self._errors_path)
        return self._errors.append({"episode": key[0], "rollout": key[1], "error": text})

    def close(self) -> None:
        """Commit what is pending and stop the writers (blocks: call it off the loop)."""
        for writer in (self._episodes, self._errors):
            if writer is not None:
                writer.close()


def record_key(record: Mapping[str, Any]) -> Key:
    """An episode line's (episode, rollout); lines written before rollouts existed are
    rollout 0."""
    return int(record["episode"]), int(record.get("rollout", 0))


class _GroupCommitFile:
    """A JSONL file appended to by one writer thread, with one fsync per batch of lines.

    An fsync per finished episode, on the event loop, took a quarter of the loop's time at
    concurrency 32 and every other episode waited for it. Here the loop only hands a line
    over; the writer takes every line waiting, writes them in one call, fsyncs once, and
    only then resolves their futures, so a line is acknowledged exactly when it is durable
    and a burst of finished episodes costs one fsync. A kill mid-write leaves at most a cut
    last line, of an episode never acknowledged, which ``RunLog._recover`` removes; after a
    failed write (disk full) every later line fails too, so none lands after a cut one.
    """

    def __init__(self, path: Path) -> None:
        self._handle = path.open("ab")
        self._pending: list[tuple[bytes, concurrent.futures.Future[None]]] = []
        self._wake = threading.Condition()
        self._closing = False
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"commit {path.name}",
                                        daemon=True)
        self._thread.start()

    def append(self, record: dict[str, Any]) -> Awaitable[None]:
        line = (json.dumps(record, ensure_ascii=True) + "\n").encode()
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._wake:
            if self._closing:
                raise RuntimeError("the run log is closed")
            self._pending.append((line, done))
            self._wake.notify()
        return asyncio.wrap_future(done)

    def close(self) -> None:
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join()
        self._handle.close()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closing:
                    self._wake.wait()
                batch, self._pending = self._pending, []
            if not batch:
                return  # closing, and nothing left to commit
            # Past this call a waiter can no longer cancel; a cancelled one's line is still
            # written (its episode finished), it just has no one to tell.
            waiting = [done for _, done in batch if done.set_running_or_notify_cancel()]
            try:
                if self._failed is not None:  # nothing may follow a possibly cut line
                    raise self._failed
                self._handle.write(b"".join(line for line, _ in batch))
                self._handle.flush()
                os.fsync(self._handle.fileno())
            except BaseException as err:
                self._failed = err
                for done in waiting:
                    done.set_exception(err)
            else:
                for done in waiting:
                    done.set_result(None)


def _write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that a kill at any moment leaves the old or the new file.

    Writing in place truncates first: a run killed mid-write kept an empty ``config.json``
    and every later resume crashed on it. The text goes to a sibling temporary file, is
    synced, and is renamed over ``path`` (atomic on POSIX); the directory is synced so the
    rename survives a power cut too. One writer per run directory, so the temporary name is
    fixed: the next write replaces what a killed one left behind.
    """
    temporary = path.with_name(f".{path.name}.tmp")
    with temporary.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


T = TypeVar("T")
P = ParamSpec("P")


def _in_thread(
    pool: concurrent.futures.Executor | None, call: Callable[P, T], *args: P.args,
    **kwargs: P.kwargs,
) -> asyncio.Future[T]:
    """``asyncio.to_thread`` on a given executor (``None``: the loop's default one)."""
    return asyncio.get_running_loop().run_in_executor(pool, functools.partial(call, *args,
                                                                              **kwargs))


def action_protocol(env: gymnasium.Env) -> ActionProtocol | None:
    """The env's action protocol, through which scripted policies phrase their commands;
    None when it has none of ours (a remote env's stays in its actor)."""
    protocol = getattr(env.unwrapped, "protocol", None)
    return protocol if isinstance(protocol, ActionProtocol) else None


async def play_episode(
    env: gymnasium.Env, policy: Policy, episode: int, seed: int, task_index: int,
    *, rollout: int = 0, history_window: int | None = None,
    pool: concurrent.futures.Executor | None = None,
) -> dict[str, Any]:
    """One episode; env calls run in threads (``pool``, else the loop's default executor)
    so sandboxes and HTTP never block the loop.

    The policy sees the chat through ``history_window`` (``agent_gym.render``) and the env's
    action protocol, when it has one of ours; a prompt that outgrows its context ends the
    episode ``context_length``, scored as it stands.
    """
    started = time.perf_counter()
    _, info = await _in_thread(pool, env.reset, seed=seed, options={"index": task_index})
    messages = list(info["messages"])
    opening = len(messages)
    tools, privileged = info["tools"], info["privileged"]
    protocol = action_protocol(env)
    synthetic = bool(info.get("synthetic", False))
    total_reward, invalid, turns = 0.0, 0, 0
    prompt_tokens: int | None = 0
    completion_tokens: int | None = 0
    replies: list[dict[str, Any]] = []
    end_reason, context_error = "", None
    while not end_reason:
        shown = window_messages(messages, opening, history_window)
        asked = time.perf_counter()
        try:
            reply = await policy.act(
                PolicyInput(shown, tools, turns, privileged, info, seed=seed, rollout=rollout,
                            protocol=protocol)
            )
        except ContextLengthError as err:
            end_reason, context_error = "context_length", str(err)
            break
        replies.append({"finish_reason": reply.finish_reason, "tool_calls": reply.tool_calls,
                        "latency_s": round(time.perf_counter() - asked, 4)})
        messages.append({"role": "assistant", "content": reply.text})
        prompt_tokens = _add(prompt_tokens, reply.prompt_tokens)
        completion_tokens = _add(completion_tokens, reply.completion_tokens)
        turns += 1
        if reply.cut:
            # As in training: an unfinished reply is never shown to the env, so a reply cut
            # mid-thought can never be scored as an answer.
            end_reason = "max_tokens"
            break
        _, reward, terminated, truncated, info = await _in_thread(pool, env.step, reply.text)
        messages.append(info["message"])
        total_reward += float(reward)
        invalid += bool(info.get("invalid"))
        end_reason = "terminated" if terminated else "truncated" if truncated else ""
    state = env.unwrapped.save_state()
    record = {
        "episode": episode,
        "rollout": rollout,
        "seed": seed,
        "task_id": state.task_id,
        "synthetic": synthetic,
        "reward": total_reward,
        "success": total_reward > 0,
        "terminated": end_reason == "terminated",
        "end_reason": end_reason,
        "turns": turns,
        "invalid_actions": invalid,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "latency_s": round(time.perf_counter() - started, 4),
        "replies": replies,
        "transcript": messages,
        "final_state": json.loads(state.to_json()),
    }
    if context_error is not None:
        record["context_error"] = context_error
    return record


def _add(total: int | None, value: int | None) -> int | None:
    return None if total is None or value is None else total + value


async def evaluate(
    config: EvalConfig,
    policy: Policy,
    out_dir: Path,
    *,
    concurrency: int = 4,
    progress: bool = True,
    make_env: Callable[[], Any] | None = None,
    notify: Callable[[str], None] | None = None,
) -> Summary:
    """Run the missing (episode, rollout) pairs of ``config`` into ``out_dir`` and summarise
    every episode the directory holds (never fewer than it held: see ``RunLog``).

    ``notify`` is told, before anything runs, what a rerun found in ``out_dir``.

    ``make_env`` builds one env per concurrent episode slot; by default
    ``gymnasium.make`` in this process (``agent_gym.serve.distributed.RemoteEnv`` puts it in a
    Ray actor instead). A run cancelled (Ctrl-C, SIGTERM through the command line) still
    writes ``summary.json`` of its finished episodes, marked ``interrupted``. The policy's
    connections (``aclose``) are closed when the run ends: they belong to this event loop.
    """
    if make_env is None:
        def make_env() -> Any:
            return gymnasium.make(config.env_id, **config.env_kwargs)

    log = RunLog(out_dir, config)
    num_tasks, _ = await asyncio.to_thread(describe_env, config.env_id, config.env_kwargs)
    order = np.random.default_rng(config.seed).permutation(num_tasks)
    todo: asyncio.Queue[Key] = asyncio.Queue()
    planned = config.episodes * config.rollouts_per_task
    for episode in range(config.episodes):
        for rollout in range(config.rollouts_per_task):
            if (episode, rollout) not in log.records:
                todo.put_nowait((episode, rollout))
    note = log.found_note(config, todo.qsize())
    if note is not None and notify is not None:
        notify(note)
    bar = tqdm(
        total=planned, initial=planned - todo.qsize(), disable=not progress,
        desc=f"{config.env_id.removeprefix('agent_gym/')} / {config.policy}", unit="ep",
    )

    # Lines being committed: a worker goes on to its next episode meanwhile, and an
    # episode counts as done (the bar, the summary) only once its line is durable.
    commits: list[asyncio.Future[None]] = []

    def committed(commit: Awaitable[None]) -> None:
        future = asyncio.ensure_future(commit)
        future.add_done_callback(lambda _: bar.update())
        commits.append(future)

    # One thread per episode slot: asyncio's default executor has min(32, cpus + 4) threads
    # (6 here), and at concurrency 32 env calls queued behind each other. With it (and
    # integer answers compared without math-verify, see rewards.math_equal) bench_eval's
    # concurrency 32 went from 19.2x to 24.4x sequential on GSM8K-v0, 21.9x to 24.5x on
    # Search-v0.
    workers = max(1, min(concurrency, todo.qsize()))
    pool = concurrent.futures.ThreadPoolExecutor(workers + 1, thread_name_prefix="eval-env")

    async def worker() -> None:
        env = await _in_thread(pool, make_env)
        try:
            while not todo.empty():
                episode, rollout = key = todo.get_nowait()
                try:
                    record = await play_episode(
                        env, policy, episode, episode_seed(config.seed, episode, rollout),
                        int(order[episode % num_tasks]), rollout=rollout,
                        history_window=config.history_window, pool=pool,
                    )
                except Exception as err:  # one broken episode must not sink the run
                    committed(log.write_error(key, err))
                    # The env may be mid-episode in an unknown state: start a fresh one.
                    await _in_thread(pool, env.close)
                    env = await _in_thread(pool, make_env)
                else:
                    committed(log.write(record))
        finally:
            await _in_thread(pool, env.close)

    finished = False
    try:
        await asyncio.gather(*(worker() for _ in range(workers)))
        await asyncio.gather(*commits)
        finished = True
    finally:
        pool.shutdown(wait=False)
        await asyncio.to_thread(log.close)
        bar.close()
        summary = summarize(log.config, log.finished(), log.errors, log.first_error,
                            interrupted=not finished)
        _write_atomically(out_dir / "summary.json", json.dumps(asdict(summary), indent=2))
        close = getattr(policy, "aclose", None)
        if close is not None:
            await close()
    return summary


def overall_summary(runs: Sequence[tuple[EvalConfig, Summary, Path]]) -> Summary:
    """One policy's figures over several envs' runs (a suite): every task of every env
    counts once, and ``summarize`` computes the intervals over all of those tasks; as each
    env's summary does, it covers every episode their directories hold."""
    first = runs[0][0]
    records = [
        record
        for _, _, out_dir in runs
        for _, record in sorted(RunLog._recover(out_dir / EPISODES_FILE).items())
    ]
    config = EvalConfig("overall", first.policy, max(c.episodes for c, _, _ in runs),
                        rollouts_per_task=min(s.rollouts_per_task for _, s, _ in runs),
                        max_tokens=first.max_tokens)
    errors = sum(summary.errors for _, summary, _ in runs)
    first_error = next((s.first_error for _, s, _ in runs if s.first_error), None)
    return summarize(config, records, errors, first_error,
                     interrupted=any(s.interrupted for _, s, _ in runs))


def read_summary(out_dir: Path) -> Summary:
    """A run's ``summary.json`` as written by ``evaluate``."""
    return Summary(**json.loads((out_dir / "summary.json").read_text(encoding="utf-8")))
