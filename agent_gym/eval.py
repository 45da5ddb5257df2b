"""Benchmark a policy on an env: concurrent episodes, a JSONL log you can resume, a summary.

The run directory is the unit of work. ``config.json`` pins what is measured (env, its
arguments, policy, seed); ``episodes.jsonl`` gets one line per finished episode, counted
as done only once fsynced, so a run killed at any moment (even SIGKILL) resumes where it
stopped: finished episodes are kept, a half-written last line is cut off, and only the
missing episode indices run again. Episode ``i`` plays task
``order[i % n]`` of a permutation of the env's n tasks seeded by ``seed`` (every task once
before any repeats), reset with seed ``seed + i``: a resumed run measures exactly what an
unbroken one would.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import os
import statistics
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
from tqdm import tqdm

from agent_gym.core import describe_env
from agent_gym.policies import Policy, PolicyInput

EPISODES_FILE = "episodes.jsonl"
ERRORS_FILE = "errors.jsonl"


class RunMismatchError(ValueError):
    """A run directory already holds a run of something else."""


@dataclass(frozen=True)
class EvalConfig:
    env_id: str
    policy: str
    episodes: int
    seed: int = 0
    env_kwargs: dict[str, Any] = field(default_factory=dict)

    def same_run(self, other: EvalConfig) -> bool:
        """Whether ``other`` measures the same thing (it may ask for more episodes)."""
        return (self.env_id, self.policy, self.seed, self.env_kwargs) == (
            other.env_id, other.policy, other.seed, other.env_kwargs
        )


@dataclass(frozen=True)
class Summary:
    """A run's figures; those a run with no finished episode cannot have are None (``null``
    in JSON, which has no NaN)."""

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


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval: honest at 0%, 100% and small n, unlike the normal one."""
    if trials == 0:
        return 0.0, 1.0
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (
        1 + z * z / trials
    )
    return max(0.0, centre - half), min(1.0, centre + half)


def percentile(values: Sequence[float], q: float) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(
    config: EvalConfig, records: list[dict[str, Any]], errors: int, first_error: str | None = None
) -> Summary:
    n = len(records)
    successes = sum(bool(r["success"]) for r in records)
    low, high = wilson_interval(successes, n)
    tokens = [r["completion_tokens"] for r in records if r["completion_tokens"] is not None]
    latencies = [r["latency_s"] for r in records]
    return Summary(
        env_id=config.env_id,
        policy=config.policy,
        episodes=n,
        errors=errors,
        success_rate=successes / n if n else None,
        success_low=low,
        success_high=high,
        mean_reward=statistics.fmean(r["reward"] for r in records) if n else None,
        mean_turns=statistics.fmean(r["turns"] for r in records) if n else None,
        mean_tokens=statistics.fmean(tokens) if tokens else None,
        latency_p50=percentile(latencies, 0.5),
        latency_p95=percentile(latencies, 0.95),
        synthetic=any(r.get("synthetic", False) for r in records),
        cut_replies=sum(r.get("end_reason") == "max_tokens" for r in records),
        first_error=first_error,
    )


def format_table(summaries: Sequence[Summary]) -> str:
    header = ("env", "policy", "n", "success [95% CI]", "reward", "turns", "tokens",
              "latency p50/p95 s", "errors")
    rows = [header]
    for s in summaries:
        rows.append((
            s.env_id.removeprefix("agent_gym/") + (" (synthetic data)" if s.synthetic else ""),
            s.policy, str(s.episodes),
            _figure(s.success_rate, ".2f") + f" [{s.success_low:.2f}, {s.success_high:.2f}]",
            _figure(s.mean_reward, ".3f"), _figure(s.mean_turns, ".1f"),
            _figure(s.mean_tokens, ".0f"),
            f"{_figure(s.latency_p50, '.2f')}/{_figure(s.latency_p95, '.2f')}", str(s.errors),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _figure(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


class RunLog:
    """The run directory: config, finished episodes, errors; durable line by line."""

    def __init__(self, out_dir: Path, config: EvalConfig) -> None:
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        config_path = out_dir / "config.json"
        if config_path.exists():
            previous = EvalConfig(**json.loads(config_path.read_text(encoding="utf-8")))
            if not previous.same_run(config):
                raise RunMismatchError(
                    f"{out_dir} holds a run of {previous}; this is {config}. "
                    "Use another --out directory."
                )
        _write_atomically(config_path, json.dumps(asdict(config), indent=2))
        self.episodes_path = out_dir / EPISODES_FILE
        self.records = self._recover(self.episodes_path)
        self._errors_path = out_dir / ERRORS_FILE
        self._errors_path.unlink(missing_ok=True)  # errored episodes are retried on resume
        self.errors = 0
        self.first_error: str | None = None
        self._episodes = _GroupCommitFile(self.episodes_path)
        self._errors: _GroupCommitFile | None = None  # opened at the first error

    @staticmethod
    def _recover(path: Path) -> dict[int, dict[str, Any]]:
        """Finished episodes; cuts off a last line a kill left half-written."""
        if not path.exists():
            return {}
        records: dict[int, dict[str, Any]] = {}
        good_bytes = 0
        with path.open("rb") as handle:
            for line in handle:
                if not line.endswith(b"\n"):
                    break
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    break
                records.setdefault(int(record["episode"]), record)
                good_bytes += len(line)
        if good_bytes != path.stat().st_size:
            with path.open("r+b") as handle:
                handle.truncate(good_bytes)
        return records

    def write(self, record: dict[str, Any]) -> Awaitable[None]:
        """Log a finished episode; the returned awaitable resolves once it is durable."""
        self.records[record["episode"]] = record
        return self._episodes.append(record)

    def write_error(self, episode: int, error: BaseException) -> Awaitable[None]:
        self.errors += 1
        text = f"{type(error).__name__}: {error}"
        self.first_error = self.first_error or text
        if self._errors is None:
            self._errors = _GroupCommitFile(self._errors_path)
        return self._errors.append({"episode": episode, "error": text})

    def close(self) -> None:
        """Commit what is pending and stop the writers (blocks: call it off the loop)."""
        for writer in (self._episodes, self._errors):
            if writer is not None:
                writer.close()


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


async def play_episode(
    env: gymnasium.Env, policy: Policy, episode: int, seed: int, task_index: int
) -> dict[str, Any]:
    """One episode; env calls run in threads so sandboxes and HTTP never block the loop."""
    started = time.perf_counter()
    _, info = await asyncio.to_thread(env.reset, seed=seed, options={"index": task_index})
    messages = list(info["messages"])
    tools, privileged = info["tools"], info["privileged"]
    synthetic = bool(info.get("synthetic", False))
    total_reward, invalid, turns = 0.0, 0, 0
    prompt_tokens: int | None = 0
    completion_tokens: int | None = 0
    end_reason = ""
    while not end_reason:
        reply = await policy.act(PolicyInput(list(messages), tools, turns, privileged, info))
        messages.append({"role": "assistant", "content": reply.text})
        prompt_tokens = _add(prompt_tokens, reply.prompt_tokens)
        completion_tokens = _add(completion_tokens, reply.completion_tokens)
        turns += 1
        if reply.cut:
            # As in training: an unfinished reply is never shown to the env, so a reply cut
            # mid-thought can never be scored as an answer.
            end_reason = "max_tokens"
            break
        _, reward, terminated, truncated, info = await asyncio.to_thread(env.step, reply.text)
        messages.append(info["message"])
        total_reward += float(reward)
        invalid += bool(info.get("invalid"))
        end_reason = "terminated" if terminated else "truncated" if truncated else ""
    state = env.unwrapped.save_state()
    return {
        "episode": episode,
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
        "transcript": messages,
        "final_state": json.loads(state.to_json()),
    }


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
) -> Summary:
    """Run the missing episodes of ``config`` into ``out_dir`` and summarise all of them.

    ``make_env`` builds one env per concurrent episode slot; by default
    ``gymnasium.make`` in this process (``agent_gym.distributed.RemoteEnv`` puts it in a
    Ray actor instead).
    """
    if make_env is None:
        def make_env() -> Any:
            return gymnasium.make(config.env_id, **config.env_kwargs)

    log = RunLog(out_dir, config)
    num_tasks, _ = await asyncio.to_thread(describe_env, config.env_id, config.env_kwargs)
    order = np.random.default_rng(config.seed).permutation(num_tasks)
    todo: asyncio.Queue[int] = asyncio.Queue()
    for episode in range(config.episodes):
        if episode not in log.records:
            todo.put_nowait(episode)
    bar = tqdm(
        total=config.episodes, initial=config.episodes - todo.qsize(), disable=not progress,
        desc=f"{config.env_id.removeprefix('agent_gym/')} / {config.policy}", unit="ep",
    )

    # Lines being committed: a worker goes on to its next episode meanwhile, and an
    # episode counts as done (the bar, the summary) only once its line is durable.
    commits: list[asyncio.Future[None]] = []

    def committed(commit: Awaitable[None]) -> None:
        future = asyncio.ensure_future(commit)
        future.add_done_callback(lambda _: bar.update())
        commits.append(future)

    async def worker() -> None:
        env = await asyncio.to_thread(make_env)
        try:
            while not todo.empty():
                episode = todo.get_nowait()
                try:
                    record = await play_episode(
                        env, policy, episode, config.seed + episode,
                        int(order[episode % num_tasks]),
                    )
                except Exception as err:  # one broken episode must not sink the run
                    committed(log.write_error(episode, err))
                    # The env may be mid-episode in an unknown state: start a fresh one.
                    await asyncio.to_thread(env.close)
                    env = await asyncio.to_thread(make_env)
                else:
                    committed(log.write(record))
        finally:
            await asyncio.to_thread(env.close)

    try:
        await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, todo.qsize())))))
        await asyncio.gather(*commits)
    finally:
        await asyncio.to_thread(log.close)
        bar.close()
    finished = [log.records[i] for i in sorted(log.records) if i < config.episodes]
    summary = summarize(config, finished, log.errors, log.first_error)
    _write_atomically(out_dir / "summary.json", json.dumps(asdict(summary), indent=2))
    return summary
