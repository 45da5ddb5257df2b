"""On-Policy Distillation (OPD) on agent_gym environments, in one file.

    python -m agent_gym_train.opd --env-id agent_gym/GSM8K-v0 --teacher self --steps 20
    agent-gym train opd --env-id agent_gym/Search-v0 --teacher local:smollm2@runs/sft/... \
        --no-privileged --max-turns 4

The student samples episodes in the env (multi-turn, token-continuous, exactly as GRPO's
rollouts). The teacher scores *the student's own tokens*: one ``compute_logprobs`` call per
episode on the teacher's opening followed by everything the student's episode holds after
its opening (replies and observations, token for token). Every sampled token ``y_t`` gets

    A_t = -kl_coef * (log pi_student(y_t) - log pi_teacher(y_t)) + reward_coef * (R - mean R)

(``R`` the episode's env reward, the mean over the task's group; ``reward_coef`` is 0 by
default: pure distillation needs no reward). Observation and prompt positions are masked as
in every datum, so the teacher's opinion of the env's text never trains the student. The
sampler's logprobs are the student's own (sampling at temperature 1), so ``-A_t`` is a
per-token sample of the reverse KL the update lowers: ``reverse_kl_mean`` in the metrics is
that sample's mean over the step's sampled tokens.

**Teacher labels** (``--teacher-labels λ``, 0 by default). A sampled-token reverse KL can
only lower what the student samples: a student that never samples the teacher's tool call
is pushed off its own replies, never towards the call. With ``λ > 0`` the teacher also answers,
greedily, at every state the student's episodes visited (its opening and the student's own
history up to that reply), and the step adds ``λ`` times the mean NLL of those replies
(``cross_entropy``) to the distillation loss: DAgger's labels, on the student's own states,
so what the student is taught is still where the student goes. Cut teacher replies are not
used (counted in ``teacher_labels_cut``). What each setting measured on Search-v0:
docs/experiments/learning.md.

Teachers (``--teacher``):

* ``self``: the student's own frozen starting weights (the base model). Only useful with
  ``--privileged``: **privileged self-distillation**, where the teacher's system prompt also
  holds the env's ``info["privileged"]`` (reference answer, walkthrough, gold passages), so
  the student learns to act as if it knew what only the env knows.
* ``local:MODEL[@CHECKPOINT]`` or ``pytrio:MODEL[@CHECKPOINT]``: any sampler, e.g. an SFT
  checkpoint; ``--privileged`` adds the same information to its context too.

``--max-staleness N`` runs the student's rollouts, the teacher's scores and labels of the
next steps while the learner trains, as in GRPO (``agent_gym_train.run.pipeline``).

The teacher must share the student's tokenizer (it scores the student's token ids); that is
checked before any rollout and refused with ``TokenizerMismatchError``. Everything that is
not OPD (arguments every trainer takes, the training client, the env pool, the update,
metrics lines, checkpoints and continuing a stopped run) is in ``agent_gym_train.run.run``.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from pytrio import Datum, ModelInput, SamplingParams
from pytrio.types import TensorData

from agent_gym_train.advantages import group_advantages
from agent_gym_train.backends import BACKENDS, make_service
from agent_gym_train.run.args import OUT_HELP, RunArgs, option
from agent_gym_train.run.args import parse_args as parse_run_args
from agent_gym_train.run.clients import Sampler, ServiceClient, VersionedSampler
from agent_gym_train.run.episode import Episode, TokenSequence, build_datum, cross_entropy_datum
from agent_gym_train.run.files import Metrics, RunConfigError, checkpoint_path
from agent_gym_train.run.pipeline import (
    RolloutPipeline,
    max_importance_weight_option,
    max_staleness_option,
    off_policy_objective,
    staleness_problems,
)
from agent_gym_train.run.rollout import rollout_metrics
from agent_gym_train.run.run import Run, device_defaults, final_line, open_run

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DESCRIPTION = "On-Policy Distillation (OPD) on agent_gym environments, in one file."
SELF = "self"
PRIVILEGED_HEADER = (
    "Privileged information about this task (use it to act well, never mention it):"
)
PRIVILEGED_CHARS = 2000  # a walkthrough or gold passages fit; a whole corpus would not


class TokenizerMismatchError(RunConfigError):
    """The teacher reads token ids differently from the student."""


@dataclass
class Args(RunArgs):
    out: str = option("runs/opd", OUT_HELP)
    teacher: str = option(
        SELF, "self (the student's frozen start, with --privileged), local:MODEL[@CHECKPOINT] "
        "or pytrio:MODEL[@CHECKPOINT]")
    privileged: bool = option(True, "add the env's privileged information to the teacher's "
                                    "system prompt")
    kl_coef: float = option(1.0, "beta: weight of the per-token reverse-KL advantage")
    reward_coef: float = option(0.0, "weight of the group-centred env reward (0: pure "
                                     "distillation)")
    teacher_labels: float = option(
        0.0, "lambda: weight of a cross_entropy term on the teacher's greedy reply at each "
        "state the student visited (DAgger-style labels; 0: pure reverse KL)")
    steps: int = option(20, "training steps of the whole run")
    group_size: int = option(2, "student episodes per task (the reward is centred in it)")
    learning_rate: float = option(1e-4, "Adam learning rate")
    max_staleness: int = max_staleness_option()
    max_importance_weight: float = max_importance_weight_option()

    PRESETS: ClassVar[dict[str, dict[str, object]]] = {"cpu-demo": {
        "batch_size": 2, "group_size": 2, "max_tokens": 48, "max_turns": 4}}
    IDENTITY: ClassVar[tuple[str, ...]] = (*RunArgs.IDENTITY, "teacher")

    def problems(self) -> list[str]:
        checks = [
            (self.teacher == SELF and not self.privileged,
             "--teacher self needs --privileged: the unchanged student start is the student "
             "itself, and distilling it teaches nothing"),
            (self.teacher != SELF and self.teacher.partition(":")[0] not in BACKENDS,
             "--teacher must be self, local:MODEL[@CHECKPOINT] or pytrio:MODEL[@CHECKPOINT]"),
            (bool(self.reward_coef) and self.group_size < 2,
             "--reward-coef needs --group-size of at least 2 (the reward is centred per task)"),
            (min(self.steps, self.group_size) < 1, "--steps and --group-size must be positive"),
            (self.teacher_labels < 0, "--teacher-labels must be >= 0"),
        ]
        return [*super().problems(), *(message for failed, message in checks if failed),
                *staleness_problems(self.max_staleness, self.max_importance_weight)]

    def branches_per_task(self) -> int:
        return self.group_size


def parse_args(argv: Sequence[str] | None = None) -> Args:
    return parse_run_args(Args, argv, "agent-gym train opd", DESCRIPTION)


# --------------------------------------------------------------------- the teacher
def check_tokenizers(student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase) -> None:
    """Refuse a teacher whose token ids mean other strings than the student's.

    The teacher scores the student's token ids, so one id must be one string to both;
    a different vocabulary would make every teacher logprob a score of some other text.
    """
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    if mine == theirs:
        return
    by_id = {i: t for t, i in theirs.items()}
    differing = [(i, t, by_id.get(i)) for t, i in sorted(mine.items(), key=lambda kv: kv[1])
                 if by_id.get(i) != t]
    differing += [(i, None, t) for t, i in theirs.items() if i >= len(mine)]
    examples = ", ".join(f"id {i}: {a!r} vs {b!r}" for i, a, b in differing[:3])
    raise TokenizerMismatchError(
        f"the teacher's tokenizer differs from the student's ({len(mine)} vs {len(theirs)} "
        f"tokens, {len(differing)} ids differ, e.g. {examples}); on-policy distillation "
        "scores the student's token ids with the teacher, so both must share one vocabulary"
    )


def privileged_messages(
    messages: Sequence[Mapping[str, Any]], privileged: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """The opening chat with the env's privileged information added to its system prompt
    (or as a system prompt when the chat has none)."""
    lines = []
    for key, value in privileged.items():
        shown = "; ".join(map(str, value)) if isinstance(value, list | tuple) else str(value)
        lines.append(f"- {key}: {shown}")
    block = f"{PRIVILEGED_HEADER}\n" + "\n".join(lines)[:PRIVILEGED_CHARS]
    chat = [dict(m) for m in messages]
    if chat and chat[0].get("role") == "system":
        chat[0]["content"] = f"{chat[0].get('content') or ''}\n\n{block}"
    else:
        chat.insert(0, {"role": "system", "content": block})
    return chat


def open_teacher(args: Args, run: Run) -> Sampler:
    """A sampling client for ``args.teacher`` (``self``: the student's base weights, from
    the run's own service, whatever step the run continues from)."""
    if args.teacher == SELF:
        return run.service.create_sampling_client(args.model)
    backend, _, rest = args.teacher.partition(":")
    model, _, checkpoint = rest.partition("@")
    service = run.service if backend == args.backend else make_service(
        backend, api_key=args.api_key, device=args.device, threads=args.threads)
    try:  # CHECKPOINT: what --init-from takes (a run directory, its checkpoint.json, a path)
        path = checkpoint_path(checkpoint) if checkpoint else None
    except RunConfigError as err:
        raise RunConfigError(f"--teacher {args.teacher.removesuffix(checkpoint)}{err}") from err
    return service.create_sampling_client(model or "smollm2", path)


def teacher_openings(run: Run, args: Args, task: Mapping[str, Any]) -> tuple[list[int], list[int]]:
    """(the student's first prompt, the teacher's) for a task: the same chat, plus the
    env's privileged information in the teacher's with ``--privileged``."""
    env = run.envs()
    try:
        _, info = env.reset(options=dict(task))
    finally:
        env.close()
    chat, tools = info["messages"], info.get("tools")
    teacher_chat = privileged_messages(chat, info["privileged"]) if args.privileged else chat
    return run.renderer.prompt(chat, tools), run.renderer.prompt(teacher_chat, tools)


# --------------------------------------------------------------------- advantages
def distillation_datum(
    sequence: TokenSequence,
    teacher_logprobs: Sequence[float | None],
    kl_coef: float,
    *,
    offset: int = 0,
    reward_advantage: float = 0.0,
) -> tuple[Datum, np.ndarray]:
    """The episode's datum with per-token OPD advantages, and its per-token reverse KL
    samples (``log pi_student - log pi_teacher`` of each sampled token, in order).

    ``teacher_logprobs[p + offset]`` is the teacher's logprob of the episode's token at
    sequence position ``p`` (``offset``: how much longer the teacher's opening is than the
    student's). Only sampled positions carry an advantage; the rest stay 0.
    """
    datum = build_datum(sequence, 0.0)
    advantages = np.zeros(len(datum.model_input), dtype=np.float32)
    gaps = []
    for span in sequence.spans:
        for position, student in enumerate(span.logprobs, start=span.start):
            teacher = teacher_logprobs[position + offset]
            if teacher is None:
                raise ValueError(f"the teacher gave no logprob at position {position + offset}")
            gap = student - teacher
            gaps.append(gap)
            advantages[position - 1] = -kl_coef * gap + reward_advantage  # predicted at p - 1
    if not np.isfinite(advantages).all():
        raise ValueError("a teacher or student logprob is not finite")
    inputs = dict(datum.loss_fn_inputs)
    inputs["advantages"] = TensorData.model_construct(
        data=advantages.tolist(), dtype="float32", shape=[len(advantages)]
    )
    return Datum(model_input=datum.model_input, loss_fn_inputs=inputs), np.asarray(gaps)


async def score(teacher: Sampler, sequences: Sequence[list[int]]) -> list[list[float | None]]:
    """The teacher's logprobs of every sequence, one ``compute_logprobs`` call each."""
    return list(await asyncio.gather(
        *(teacher.compute_logprobs_async(ModelInput.from_ints(s)) for s in sequences)
    ))


@dataclass(frozen=True)
class LabelState:
    """A state the student replied at: its own context, and the teacher's view of it (the
    teacher's opening followed by the same history)."""

    student: tuple[int, ...]
    teacher: tuple[int, ...]


def label_states(
    sequence: TokenSequence, student_prompt: Sequence[int], teacher_prompt: Sequence[int]
) -> list[LabelState]:
    """One state per reply the student sampled in ``sequence``."""
    return [LabelState(sequence.tokens[: span.start],
                       (*teacher_prompt, *sequence.tokens[len(student_prompt): span.start]))
            for span in sequence.spans]


async def teacher_labels(
    teacher: Sampler, states: Sequence[LabelState], stop: Sequence[int], max_tokens: int,
    is_finished: Callable[[Sequence[int]], bool],
) -> list[TokenSequence | None]:
    """The teacher's greedy reply at each state, as the student's context followed by that
    reply (one span); ``None`` where the reply was cut by ``max_tokens``."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=list(stop), seed=0)
    answers = await asyncio.gather(*(
        teacher.sample_async(ModelInput.from_ints(list(state.teacher)), num_samples=1,
                             sampling_params=params)
        for state in states
    ))
    labels: list[TokenSequence | None] = []
    for state, answer in zip(states, answers, strict=True):
        reply = answer.sequences[0]
        labels.append(TokenSequence(state.student).extend(state.student, reply.tokens,
                                                          reply.logprobs)
                      if is_finished(reply.tokens) else None)
    return labels


# --------------------------------------------------------------------- training
@dataclass
class Collected:
    """What the sampling side of a step produced: the student's episodes that score, the
    teacher's logprobs of their tokens and its labels, and their times."""

    groups: list[list[Episode]]
    scored: list[tuple[Episode, int, float]]  # episode, teacher offset, reward advantage
    teacher_logprobs: list[list[float | None]]
    labels: list[TokenSequence | None]
    time_teacher: float
    time_labels: float


def train(args: Args, service: ServiceClient | None = None) -> list[Metrics]:
    """Run (or continue) OPD; returns this invocation's per-step metrics."""
    history: list[Metrics] = []
    args = device_defaults(args)
    with open_run(args, args.steps, service) as run:
        # ---- the teacher, checked before anything is sampled
        teacher = open_teacher(args, run)
        check_tokenizers(run.training.get_tokenizer(), teacher.get_tokenizer())
        openings: dict[int, tuple[list[int], list[int]]] = {}
        config = run.rollout_config(args.group_size)
        objective = off_policy_objective(run.objective, args.sampler, args.sampler_precision,
                                         args.max_staleness, args.max_importance_weight)

        def collect(step: int, policy: VersionedSampler) -> Collected:
            # ---- the student samples (on weights at most --max-staleness updates old)
            tasks = run.tasks(run.rng(step), args.batch_size)
            groups = run.rollouts(step, policy, tasks, config)
            t1 = time.perf_counter()

            # ---- the teacher scores the student's tokens: one call per episode, on the
            # teacher's opening followed by everything after the student's
            scored: list[tuple[Episode, int, float]] = []
            sequences: list[list[int]] = []
            states: list[LabelState] = []
            for task, group in zip(tasks, groups, strict=True):
                if task["index"] not in openings:
                    openings[task["index"]] = teacher_openings(run, args, task)
                student_prompt, teacher_prompt = openings[task["index"]]
                centred = group_advantages([episode.reward for episode in group])
                for episode, advantage in zip(group, centred if centred is not None
                                              else [0.0] * len(group), strict=True):
                    if not episode.turns:  # the opening alone filled the trajectory budget
                        continue
                    if episode.sequence.tokens[: len(student_prompt)] != tuple(student_prompt):
                        raise RuntimeError(f"task {task} opened differently when re-rendered")
                    scored.append((episode, len(teacher_prompt) - len(student_prompt),
                                   args.reward_coef * float(advantage)))
                    sequences.append([*teacher_prompt,
                                      *episode.sequence.tokens[len(student_prompt):]])
                    states += label_states(episode.sequence, student_prompt, teacher_prompt)
            teacher_logprobs = asyncio.run(score(teacher, sequences))
            t2 = time.perf_counter()

            # ---- with --teacher-labels: the teacher's own reply at every state the student
            # replied at, as cross_entropy datums
            labels: list[TokenSequence | None] = []
            if args.teacher_labels:
                labels = asyncio.run(teacher_labels(
                    teacher, states, run.renderer.stop_tokens, config.max_tokens,
                    run.renderer.is_finished))
            return Collected(groups, scored, teacher_logprobs, labels, t2 - t1,
                             time.perf_counter() - t2)

        with closing(RolloutPipeline(collect, range(run.start, run.steps), run.weights(),
                                   args.max_staleness)) as rollouts:
            for step in run.progress():
                t0 = time.perf_counter()
                sampled = rollouts.take(step)
                got = sampled.batch
                t1 = time.perf_counter()

                # ---- per-token advantages, one update; then the sampler on the new weights
                supervised = [cross_entropy_datum(label, args.teacher_labels)
                              for label in got.labels if label is not None]
                datums: list[Datum] = []
                gaps: list[np.ndarray] = []
                for (episode, offset, reward_advantage), logprobs in zip(
                    got.scored, got.teacher_logprobs, strict=True
                ):
                    datum, gap = distillation_datum(episode.sequence, logprobs, args.kl_coef,
                                                    offset=offset,
                                                    reward_advantage=reward_advantage)
                    datums.append(datum)
                    gaps.append(gap)
                trained = run.update(datums, supervised, objective=objective)
                rollouts.publish(step + 1)
                t2 = time.perf_counter()

                # ---- metrics, then checkpoint
                episodes = [episode for episode, _, _ in got.scored]
                kl = np.concatenate(gaps) if gaps else np.zeros(0)
                student = np.array([lp for e in episodes for s in e.sequence.spans
                                    for lp in s.logprobs])
                measured = kl.size > 0
                rollout_time = sampled.time_rollout - got.time_teacher - got.time_labels
                row: Metrics = {
                    "step": step, **rollout_metrics(episodes),
                    "reverse_kl_mean": float(kl.mean()) if measured else None,
                    "reverse_kl_std": float(kl.std()) if measured else None,
                    # the same tokens: teacher logprob = student logprob - gap, token by token
                    "student_logprob_mean": float(student.mean()) if measured else None,
                    "teacher_logprob_mean": (float(student.mean() - kl.mean()) if measured
                                             else None),
                    "completion_tokens_per_s": kl.size / (sampled.time_sampler + rollout_time),
                    **trained,
                    **({"teacher_labels": len(got.labels),
                        "teacher_labels_cut": sum(label is None for label in got.labels)}
                       if args.teacher_labels else {}),
                    **run.sampled_versions(step, [e for g in got.groups for e in g]),
                    "time_rollout": sampled.time_sampler + rollout_time,
                    "time_teacher": got.time_teacher, "time_labels": got.time_labels,
                    "time_waiting": t1 - t0, "time_train": t2 - t1,
                    "time_step": time.perf_counter() - t0,
                }
                run.finish(step, row,
                           shown={"kl": round(float(row["reverse_kl_mean"] or 0.0), 3)})
                history.append(row)
    return history


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    history = train(args)
    print(final_line(history, Path(args.out),
                     reverse_kl_first=history[0]["reverse_kl_mean"] if history else None,
                     reverse_kl_last=history[-1]["reverse_kl_mean"] if history else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
