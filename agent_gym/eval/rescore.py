"""Re-scoring a saved run with the reward code as it is now.

Each finished episode is rebuilt from its saved final state (``make_from_state``), which
replays every action on a fresh env and checks each observation against the digest the
episode recorded: a rescored reward is the current code's score of exactly what the model
did and saw, or the episode is reported as not reproducible (its state corrupt or edited,
its env's behaviour changed, its data gone) — never silently scored. The recorded
transcript is checked against the replay too, so an edited transcript is caught even when
its state is intact.

The original files are never touched: the new summary and every episode's old and new
reward go to a file of their own (``rescore.json`` by default), which ``agent-gym view``
reads to show per-step rewards.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import agent_gym
from agent_gym.env.state import EnvState, StateError
from agent_gym.eval.runfiles import RESCORE_FILE, record_key
from agent_gym.eval.runs import Run
from agent_gym.eval.summary import Summary, summarize

# Rewards are sums of floats the env returns; a change below this is float noise.
REWARD_TOLERANCE = 1e-9


@dataclass(frozen=True)
class Rescored:
    """One episode's old and new outcome (``error`` when it could not be replayed)."""

    episode: int
    task_id: str
    old_reward: float
    old_success: bool
    new_reward: float | None = None
    new_success: bool | None = None
    step_rewards: list[float] | None = None
    end_reason: str | None = None
    error: str | None = None
    rollout: int = 0

    @property
    def changed(self) -> bool:
        return self.error is None and (
            abs((self.new_reward or 0.0) - self.old_reward) > REWARD_TOLERANCE
            or self.new_success != self.old_success
        )


@dataclass(frozen=True)
class RescoreResult:
    original: Summary
    rescored: Summary  # over the episodes that replayed
    episodes: list[Rescored]

    @property
    def changed(self) -> list[Rescored]:
        return [e for e in self.episodes if e.changed]

    @property
    def failed(self) -> list[Rescored]:
        return [e for e in self.episodes if e.error is not None]

    def to_json(self) -> str:
        return json.dumps({
            "original_summary": dataclasses.asdict(self.original),
            "summary": dataclasses.asdict(self.rescored),
            "changed": [e.episode for e in self.changed],
            "failed": [e.episode for e in self.failed],
            "episodes": [dataclasses.asdict(e) for e in self.episodes],
        }, indent=2, ensure_ascii=True)


def rescore_run(run: Run, host_kwargs: Mapping[str, Any] | None = None) -> RescoreResult:
    """Replay every episode of ``run`` and score it again; one that fails is reported."""
    results = []
    new_records = []
    for record in run.episodes.values():
        result = _rescore_episode(record, dict(host_kwargs or {}))
        results.append(result)
        if result.error is None:
            new_records.append({**record, "reward": result.new_reward,
                                "success": result.new_success, "end_reason": result.end_reason})
    first_error = next((r.error for r in results if r.error), None)
    rescored = summarize(run.config, new_records, len(results) - len(new_records), first_error)
    return RescoreResult(run.summary(), rescored, results)


def _rescore_episode(record: dict[str, Any], host_kwargs: dict[str, Any]) -> Rescored:
    old_reward = float(record.get("reward", 0.0))
    base = Rescored(int(record["episode"]), str(record.get("task_id")), old_reward,
                    bool(record.get("success")), rollout=record_key(record)[1])
    try:
        state = EnvState.from_dict(record.get("final_state"))
        env, _, info = agent_gym.make_from_state(state, **host_kwargs)
    except StateError as err:
        notes = " ".join(getattr(err, "__notes__", ()))
        return dataclasses.replace(base, error=" ".join(f"{err} {notes}".split()))
    except Exception as err:  # an env that cannot be rebuilt here: report, go on
        return dataclasses.replace(base, error=f"{type(err).__name__}: {err}")
    env.close()
    mismatch = _transcript_mismatch(record, [*info["messages"], *info["history"]])
    if mismatch is not None:
        return dataclasses.replace(base, error=mismatch)
    rewards = [float(r) for r in info["step_rewards"]]
    reward = sum(rewards)
    # A reply cut by the token budget never reached the env (see eval.play_episode).
    end = "max_tokens" if record.get("end_reason") == "max_tokens" else info["episode_end"] or ""
    # Success is a positive total reward, as eval.play_episode scores it.
    return dataclasses.replace(base, new_reward=reward, new_success=reward > 0,
                               step_rewards=rewards, end_reason=end)


def _transcript_mismatch(record: dict[str, Any], replayed: list[dict[str, Any]]) -> str | None:
    """Why the recorded transcript is not the replayed chat (opening messages, then each
    action and observation), or None when it is."""
    transcript = record.get("transcript")
    if not isinstance(transcript, list):
        return "the episode has no transcript"
    # A reply cut by the token budget is logged but never reached the env.
    kept = transcript[:-1] if record.get("end_reason") == "max_tokens" else transcript
    if len(kept) != len(replayed):
        return (f"the transcript has {len(kept)} messages where the replayed episode has "
                f"{len(replayed)}: the log was edited or is corrupt")
    for index, (saved, again) in enumerate(zip(kept, replayed, strict=True)):
        if not isinstance(saved, dict) or saved.get("content") != again["content"]:
            return (f"transcript message {index} ({again.get('role', 'assistant')}) differs "
                    "from the replayed episode: the log was edited or is corrupt")
    return None


def default_output(run: Run) -> Path:
    return run.path / RESCORE_FILE


def format_rescore(result: RescoreResult, out: Path) -> str:
    """What changed, for the terminal."""
    before, after = result.original, result.rescored
    lines = [
        f"rescored {len(result.episodes)} episodes of {before.tasks} tasks: "
        f"{len(result.changed)} changed, {len(result.failed)} not reproducible",
        f"success {_rate(before.success_rate)} -> {_rate(after.success_rate)}, "
        f"mean reward {_rate(before.mean_reward)} -> {_rate(after.mean_reward)}",
    ]
    for item in result.changed:
        lines.append(f"  episode {item.episode} ({item.task_id}): reward {item.old_reward:g} -> "
                     f"{item.new_reward:g}, success {item.old_success} -> {item.new_success}")
    for item in result.failed:
        lines.append(f"  episode {item.episode} ({item.task_id}) not reproducible: {item.error}")
    lines.append(f"written to {out} (the run's own files are unchanged)")
    return "\n".join(lines)


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
