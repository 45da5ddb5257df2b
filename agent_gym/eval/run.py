"""Benchmark a policy on an env: concurrent episodes, a JSONL log you can resume, a summary.

The run directory is the unit of work. ``config.json`` pins what is measured (env, its
arguments, policy, seed); ``episodes.jsonl`` gets one line per finished episode, counted
as done only once fsynced, so a run killed at any moment (even SIGKILL) resumes where it
stopped: finished episodes are kept, a half-written last line (or any line that cannot be
read) is moved aside to ``episodes.jsonl.quarantined``, and only the missing (episode,
rollout) pairs run again; one eval writes a run directory at a time (``RunLog`` locks it).
Episode ``i`` plays task ``order[i % n]`` of a permutation of the env's n tasks seeded by
``seed`` (every task once before any repeats), ``rollouts_per_task`` times; rollout 0
resets with seed ``seed + i`` and rollout ``r > 0`` with ``derive_seed(seed, i, r)``: a
resumed run measures exactly what an unbroken one would.

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
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import gymnasium
import numpy as np
from tqdm import tqdm

from agent_gym.actions.protocols import ActionProtocol
from agent_gym.env.base import describe_env
from agent_gym.eval.config import EvalConfig, Key, episode_seed
from agent_gym.eval.policies import ContextLengthError, Policy, PolicyInput
from agent_gym.eval.runlog import RunLog, RunWriteError
from agent_gym.eval.summary import Summary, summarize
from agent_gym.render import window_messages

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
    None when it has none of ours (a Ray actor's env hands its protocol over, see
    ``agent_gym.serve.distributed.RemoteEnv``)."""
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

    ``notify`` is told, before anything runs, what a rerun found in ``out_dir`` (and set
    aside, when lines of its log could not be read).

    ``make_env`` builds one env per concurrent episode slot; by default
    ``gymnasium.make`` in this process (``agent_gym.serve.distributed.RemoteEnv`` puts it in a
    Ray actor instead). A run cancelled (Ctrl-C, SIGTERM through the command line) still
    writes ``summary.json`` of its finished episodes, marked ``interrupted``. A run whose
    log cannot be written (disk full) stops at once with a ``RunWriteError`` saying how
    many episodes are saved; only saved episodes are counted, by the progress bar too. The
    policy's connections (``aclose``) are closed when the run ends: they belong to this
    event loop.
    """
    try:
        log = RunLog(out_dir, config)  # holds the directory until closed
        try:
            return await _run(config, policy, log, concurrency, progress, make_env, notify)
        finally:
            await asyncio.to_thread(log.close)
    finally:
        close = getattr(policy, "aclose", None)
        if close is not None:
            await close()


async def _run(
    config: EvalConfig, policy: Policy, log: RunLog, concurrency: int, progress: bool,
    make_env: Callable[[], Any] | None, notify: Callable[[str], None] | None,
) -> Summary:
    """``evaluate`` while it holds the run directory (``log``): plan, play, summarise."""
    if make_env is None:
        def make_env() -> Any:
            return gymnasium.make(config.env_id, **config.env_kwargs)

    shape = await asyncio.to_thread(describe_env, config.env_id, config.env_kwargs)
    num_tasks = shape.num_tasks
    order = np.random.default_rng(config.seed).permutation(num_tasks)
    todo: asyncio.Queue[Key] = asyncio.Queue()
    planned = config.episodes * config.rollouts_per_task
    for episode in range(config.episodes):
        for rollout in range(config.rollouts_per_task):
            if (episode, rollout) not in log.records:
                todo.put_nowait((episode, rollout))
    if notify is not None:
        for note in [*log.notes, log.found_note(config, todo.qsize())]:
            if note is not None:
                notify(note)
    bar = tqdm(
        total=planned, initial=planned - todo.qsize(), disable=not progress,
        desc=f"{config.env_id.removeprefix('agent_gym/')} / {config.policy}", unit="ep",
    )

    # Lines being committed: a worker goes on to its next episode meanwhile, and an
    # episode counts as done (the bar, the summary) only once its line is durable. Failed
    # episodes (retried on resume) are shown beside the count, never in it.
    commits: list[asyncio.Future[None]] = []

    def saved(future: asyncio.Future[None]) -> None:
        if not future.cancelled() and future.exception() is None:
            bar.update()

    def committed(commit: Awaitable[None], *, episode: bool = True) -> None:
        future = asyncio.ensure_future(commit)
        if episode:
            future.add_done_callback(saved)
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
            # After a failed write nothing more can be saved: play no further episode.
            while not todo.empty() and log.failure is None:
                episode, rollout = key = todo.get_nowait()
                try:
                    record = await play_episode(
                        env, policy, episode, episode_seed(config.seed, episode, rollout),
                        int(order[episode % num_tasks]), rollout=rollout,
                        history_window=config.history_window, pool=pool,
                    )
                except Exception as err:  # one broken episode must not sink the run
                    committed(log.write_error(key, err), episode=False)
                    bar.set_postfix(errors=log.errors)
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
    except RunWriteError as err:
        raise RunWriteError(
            f"{err}; the run stopped with {len(log.records)} finished episodes saved in "
            f"{log.out_dir}: rerun the same command to resume once it can be written"
        ) from err
    finally:
        pool.shutdown(wait=False)
        await asyncio.to_thread(log.drain)
        bar.close()
        summary = summarize(log.config, log.finished(), log.errors, log.first_error,
                            interrupted=not finished)
        try:
            log.write_summary(json.dumps(asdict(summary), indent=2))
        except RunWriteError:
            if finished:
                raise
            # The run is already failing or interrupted: that is what to report.
    return summary
