"""GRPO on agent_gym environments, in one file you can read top to bottom.

    python -m agent_gym_train.grpo --env-id agent_gym/GSM8K-v0 --steps 20
    agent-gym train grpo --env-id agent_gym/GSM8K-v0 --backend pytrio --model Qwen/Qwen3-4B

Each step: take a sampler on the current weights; pick ``batch_size`` tasks; roll out
``group_size`` branches of each (multi-turn, token-continuous); advantage = reward minus the
group's mean reward (optionally over its std); skip and count groups whose rewards are all
equal (no learning signal); one forward-backward on every datum of the step and one
``optim_step``. Episodes play the env's own turn budget unless ``--max-turns`` says
otherwise. Everything that is not GRPO (arguments every trainer takes, the training client,
the env pool reused by every step, the update, metrics lines, checkpoints and continuing a
stopped run) is in ``agent_gym_train.run.run``.

The objective (``agent_gym_train.run.losses``), and why each option exists:

* ``--loss importance_sampling`` (default) | ``ppo`` | ``cispo``: pytrio's own losses. ppo
  clips the token ratio so a step cannot move far from the sampler; cispo (MiniMax-M1)
  clips only the ratio's weight and keeps every token's gradient, so rare tokens that
  matter ("wait", "recheck") are not silenced by the clip.
* ``--loss gspo`` (GSPO): one ratio per episode, the geometric mean of its token ratios,
  clipped as a whole: the reward is the episode's, so is the correction. Runs through
  ``forward_backward_custom``, unchanged on both backends.
* ``--clip-low``/``--clip-high`` (DAPO's clip-higher): ratios are clipped to
  ``[1 - low, 1 + high]``; a higher upper bound lets unlikely good tokens grow, which keeps
  exploration (entropy) from collapsing. Defaults per loss (see ``--help``).
* ``--dynamic-sampling`` (DAPO): a degenerate group trains nothing, so a step whose groups
  are mostly degenerate is a wasted, noisy step; with it, more tasks are rolled out until
  ``batch_size`` groups have a signal or ``--max-refill-groups`` extra groups were drawn
  (``refill_groups`` in the metrics says how many).
* ``--loss-aggregation token-mean`` (pytrio's built-in; DAPO's token-level loss: long
  replies get their full weight) | ``sequence-mean`` (GRPO's original: each episode weighs
  the same; via ``forward_backward_custom``).
* ``--task-sampler mixed``: tasks whose recent groups had mixed outcomes are drawn more
  often (``agent_gym_train.run.tasks``): at this scale most groups are all-or-nothing, and
  their rollouts teach nothing.
* ``--max-staleness N`` (default 0): the rollouts of the next steps run while the learner
  trains, on weights at most N updates old (``agent_gym_train.run.pipeline``), so neither the
  sampler nor the learner waits for the other; 0 is the synchronous loop. Each metrics
  line says which weights sampled its data (``sampler_version``, ``staleness``). The loss's
  ratio to the sampler's logprobs is the off-policy correction; ``importance_sampling``
  trains truncated at ``--max-importance-weight`` (``Objective.truncated``).
* ``--sampler-precision bfloat16`` (local backend): rollouts sample from a bfloat16 copy of
  the weights, faster where the hardware has bf16 units; the same ratio corrects the
  rounding, and ``importance_sampling`` trains truncated as with staleness.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from pytrio import Datum

from agent_gym_train.advantages import group_advantages
from agent_gym_train.run.args import OUT_HELP, RunArgs, option
from agent_gym_train.run.args import parse_args as parse_run_args
from agent_gym_train.run.clients import ServiceClient, VersionedSampler
from agent_gym_train.run.episode import Episode, build_datum, datums_digest
from agent_gym_train.run.files import Metrics
from agent_gym_train.run.pipeline import (
    RolloutPipeline,
    max_importance_weight_option,
    max_staleness_option,
    off_policy_objective,
    staleness_problems,
)
from agent_gym_train.run.rollout import rollout_metrics
from agent_gym_train.run.run import device_defaults, final_line, open_run
from agent_gym_train.run.tasks import SAMPLERS

# --help's description: the docstring's first paragraph, kept here (python -OO drops docstrings)
DESCRIPTION = "GRPO on agent_gym environments, in one file you can read top to bottom."


@dataclass
class Args(RunArgs):
    out: str = option("runs/grpo", OUT_HELP)
    steps: int = option(20, "training steps of the whole run")
    group_size: int | None = option(
        None, "branches (episodes) per task; advantages are centred in it (default: 4 when the "
        "local backend runs on CPU, else 8)")
    normalize_std: bool = option(False, "divide advantages by the group's reward std")
    dynamic_sampling: bool = option(
        False, "DAPO's dynamic sampling: roll out more tasks until --batch-size groups have a "
        "learning signal (rewards not all equal)")
    max_refill_groups: int = option(
        8, "with --dynamic-sampling: extra groups a step may roll out at most")
    max_staleness: int = max_staleness_option()
    max_importance_weight: float = max_importance_weight_option()
    task_sampler: str = option(
        "uniform", "how a step's tasks are drawn: uniform, or mixed (prefer tasks whose recent "
        "groups had mixed outcomes, the ones a group learns from)", SAMPLERS)
    history_window: int | None = option(
        None, "show the policy the task and only the last N turns, as `agent-gym eval "
        "--history-window N` does (each cut restarts the token-continuous prompt)")

    PRESETS: ClassVar[dict[str, dict[str, object]]] = {"cpu-demo": {
        "batch_size": 2, "group_size": 4, "max_tokens": 48, "max_turns": 4}}
    DEVICE_DEFAULTS: ClassVar[dict[str, tuple[int, int]]] = {
        **RunArgs.DEVICE_DEFAULTS, "group_size": (4, 8)}

    def problems(self) -> list[str]:
        return [*super().problems(),
                *(["--steps and --group-size must be positive"]
                  if min(self.steps, 1 if self.group_size is None else self.group_size) < 1
                  else []),
                *(["--max-refill-groups must not be negative"] if self.max_refill_groups < 0
                  else []),
                *staleness_problems(self.max_staleness, self.max_importance_weight),
                *(["--history-window must be positive"]
                  if self.history_window is not None and self.history_window < 1 else [])]

    def branches_per_task(self) -> int:
        return self.group_size or 1


def parse_args(argv: Sequence[str] | None = None) -> Args:
    return parse_run_args(Args, argv, "agent-gym train grpo", DESCRIPTION)


def train(args: Args, service: ServiceClient | None = None) -> list[Metrics]:
    """Run (or resume) GRPO; returns this invocation's per-step metrics."""
    history: list[Metrics] = []
    args = device_defaults(args)
    with open_run(args, args.steps, service) as run:
        config = run.rollout_config(args.group_size, args.history_window)
        objective = off_policy_objective(run.objective, args.sampler, args.sampler_precision,
                                         args.max_staleness, args.max_importance_weight)

        def collect(step: int, policy: VersionedSampler) -> Collected:
            """The step's groups: batch_size tasks x group_size branches, and the refills;
            the task sampler learns which of them had mixed outcomes."""
            rng = run.rng(step)
            tasks = run.tasks(rng, args.batch_size)
            groups = run.rollouts(step, policy, tasks, config)
            # ---- dynamic sampling: refill the degenerate groups (rewards all equal) with
            #      more tasks, up to max_refill_groups extra groups
            refills = 0
            while args.dynamic_sampling and refills < args.max_refill_groups:
                missing = args.batch_size - sum(not degenerate(g) for g in groups)
                if missing <= 0:
                    break
                more = run.tasks(rng, min(missing, args.max_refill_groups - refills))
                groups += run.rollouts(step, policy, more, config,
                                      purpose=f"refill-{refills}")
                tasks += more
                refills += len(more)
            outcomes = run.task_sampler.record(tasks, [not degenerate(g) for g in groups])
            return Collected(groups, refills, outcomes)

        # ---- rollouts on weights at most max_staleness updates old (0: the current ones)
        with closing(RolloutPipeline(collect, range(run.start, run.steps), run.weights(),
                                   args.max_staleness)) as rollouts:
            for step in run.progress():
                t0 = time.perf_counter()
                sampled = rollouts.take(step)
                groups, refills = sampled.batch.groups, sampled.batch.refills
                t1 = time.perf_counter()

                # ---- advantages and datums; groups without signal are skipped
                datums: list[Datum] = []
                for group in groups:
                    advantages = group_advantages([episode.reward for episode in group],
                                                  normalize_std=args.normalize_std)
                    if advantages is None:
                        continue
                    datums += [build_datum(sequence, float(advantage))
                               for episode, advantage in zip(group, advantages, strict=True)
                               for sequence in episode.sequences]

                # ---- one update on the whole logical batch; then the sampler on the new
                #      weights, for the rollouts that wait for them
                trained = run.update(datums, objective=objective)
                rollouts.publish(step + 1)
                t2 = time.perf_counter()

                # ---- metrics, then checkpoint (so a step counted done always has its line)
                skipped = sum(degenerate(g) for g in groups)
                episodes = [e for g in groups for e in g]
                row = {"step": step, **rollout_metrics(episodes),
                       "groups": len(groups), "degenerate_groups": skipped,
                       "degenerate_rate": skipped / len(groups), "refill_groups": refills,
                       **trained, "datums_digest": datums_digest(datums),
                       "task_outcomes": sampled.batch.outcomes,
                       **run.sampled_versions(step, episodes),
                       "time_sampler": sampled.time_sampler,
                       "time_rollout": sampled.time_rollout,
                       "time_waiting": t1 - t0, "time_train": t2 - t1,
                       "time_step": time.perf_counter() - t0}
                run.finish(step, row, shown={"reward": round(row["reward_mean"], 3),
                                             "degenerate": skipped})
                history.append(row)
    return history


@dataclass(frozen=True)
class Collected:
    """A step's rollouts: its groups, how many were refills, and which tasks had mixed
    outcomes (``TaskSampler.record``)."""

    groups: list[list[Episode]]
    refills: int
    outcomes: dict[str, int]


def degenerate(group: Sequence[Episode]) -> bool:
    """A group whose rewards are all equal: every advantage is 0, nothing to learn."""
    return len({episode.reward for episode in group}) <= 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    history = train(args)
    print(final_line(history, Path(args.out),
                     reward_mean=history[-1]["reward_mean"] if history else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
