"""On-Policy Distillation (OPD) on agent_gym environments, in one file.

    python -m trainers.opd --env-id agent_gym/GSM8K-v0 --teacher self --steps 20
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
loss is ``importance_sampling`` and the sampler's logprobs are the student's own (sampling
at temperature 1), so ``-A_t`` is a per-token sample of the reverse KL the update lowers:
``reverse_kl_mean`` in the metrics is that sample's mean over the step's sampled tokens.

Teachers (``--teacher``):

* ``self``: the student's own frozen starting weights (the base model). Only useful with
  ``--privileged``: **privileged self-distillation**, where the teacher's system prompt also
  holds the env's ``info["privileged"]`` (reference answer, walkthrough, gold passages), so
  the student learns to act as if it knew what only the env knows.
* ``local:MODEL[@CHECKPOINT]`` or ``pytrio:MODEL[@CHECKPOINT]``: any sampler, e.g. an SFT
  checkpoint; ``--privileged`` adds the same information to its context too.

The teacher must share the student's tokenizer (it scores the student's token ids); that is
checked before any rollout and refused with ``TokenizerMismatchError``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
from pytrio import AdamParams, Datum, ModelInput
from pytrio.types import TensorData
from tqdm import tqdm

from agent_gym.render import ChatRenderer
from trainers.backends import BACKENDS, make_service
from trainers.episode import Episode, Turn, active_tokens, build_datum
from trainers.options import options_parser
from trainers.rollout import RolloutConfig, env_factory, rollout_groups
from trainers.runfiles import append_metrics, keep_metrics_before, open_training_client, write_json

CHECKPOINT_FILE = "checkpoint.json"
METRICS_FILE = "metrics.jsonl"
SELF = "self"
PRIVILEGED_HEADER = (
    "Privileged information about this task (use it to act well, never mention it):"
)
PRIVILEGED_CHARS = 2000  # a walkthrough or gold passages fit; a whole corpus would not


class TokenizerMismatchError(ValueError):
    """The teacher reads token ids differently from the student."""


@dataclass
class Args:
    env_id: str = "agent_gym/GSM8K-v0"
    env_kwargs: dict[str, Any] = field(default_factory=dict)  # JSON on the command line
    teacher: str = SELF  # self | local:MODEL[@CHECKPOINT] | pytrio:MODEL[@CHECKPOINT]
    privileged: bool = True  # the env's privileged info in the teacher's context
    kl_coef: float = 1.0  # beta
    reward_coef: float = 0.0  # weight of the group-centred env reward
    backend: str = "local"  # local | pytrio (the student's)
    model: str = "smollm2"  # the student's base model
    lora_rank: int = 32  # 0 = full fine-tuning (local backend only)
    api_key: str | None = None  # pytrio only
    ray: str | None = None  # "local" or a cluster address: step envs in Ray actors
    steps: int = 20
    batch_size: int = 4  # tasks per step
    group_size: int = 2  # student episodes per task
    learning_rate: float = 1e-4
    grad_clip_norm: float = 1.0
    max_turns: int = 1
    max_tokens: int = 256  # per reply
    max_trajectory_tokens: int = 4096
    concurrency: int = 4  # groups rolled out at once
    seed: int = 0
    save_every: int = 5
    out: str = "runs/opd"
    resume: bool = False
    progress: bool = True


def parse_args(argv: list[str] | None = None) -> Args:
    parser = options_parser(Args, "opd", __doc__.split("\n\n")[0])
    args = Args(**vars(parser.parse_args(argv)))
    if args.backend not in BACKENDS:
        parser.error(f"--backend must be one of {BACKENDS}")
    if args.backend == "pytrio" and args.lora_rank < 1:
        parser.error("pytrio trains LoRA adapters only: --lora-rank must be positive")
    if args.teacher == SELF and not args.privileged:
        parser.error("--teacher self needs --privileged: the unchanged student start is the "
                     "student itself, and distilling it teaches nothing")
    if args.teacher != SELF and args.teacher.partition(":")[0] not in BACKENDS:
        parser.error("--teacher must be self, local:MODEL[@CHECKPOINT] or "
                     "pytrio:MODEL[@CHECKPOINT]")
    if args.reward_coef and args.group_size < 2:
        parser.error("--reward-coef needs --group-size of at least 2 (the reward is "
                     "centred per task)")
    if min(args.steps, args.batch_size, args.group_size) < 1:
        parser.error("--steps, --batch-size and --group-size must be positive")
    return args


# ---------------------------------------------------------------------------- teacher
def check_tokenizers(student: Any, teacher: Any) -> None:
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


def open_teacher(args: Args, service: Any) -> Any:
    """A sampling client for ``args.teacher`` (``self``: the student's base weights)."""
    if args.teacher == SELF:
        return service.create_sampling_client(args.model)
    backend, _, rest = args.teacher.partition(":")
    model, _, checkpoint = rest.partition("@")
    return make_service(backend, api_key=args.api_key).create_sampling_client(
        model or "smollm2", checkpoint or None
    )


# ---------------------------------------------------------------------------- advantages
def distillation_datum(
    turns: Sequence[Turn],
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
    datum = build_datum(turns, 0.0)
    advantages = np.zeros(len(datum.model_input), dtype=np.float32)
    gaps = []
    for turn in turns:
        start = len(turn.prompt_tokens)  # turn k's completion sits right after its prompt
        for j, student in enumerate(turn.logprobs):
            teacher = teacher_logprobs[start + j + offset]
            if teacher is None:
                raise ValueError(f"the teacher gave no logprob at position {start + j + offset}")
            gap = student - teacher
            gaps.append(gap)
            advantages[start + j - 1] = -kl_coef * gap + reward_advantage
    if not np.isfinite(advantages).all():
        raise ValueError("a teacher or student logprob is not finite")
    inputs = dict(datum.loss_fn_inputs)
    inputs["advantages"] = TensorData.model_construct(
        data=advantages.tolist(), dtype="float32", shape=[len(advantages)]
    )
    return Datum(model_input=datum.model_input, loss_fn_inputs=inputs), np.asarray(gaps)


# ---------------------------------------------------------------------------- training
def train(args: Args, service: Any | None = None) -> list[dict[str, Any]]:
    """Run (or resume) OPD; returns this invocation's per-step metrics."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    service = service or make_service(
        args.backend, checkpoint_dir=out / "checkpoints", api_key=args.api_key
    )
    checkpoint = out / CHECKPOINT_FILE
    training, saved = open_training_client(
        service, args, checkpoint, ("env_id", "model", "lora_rank", "backend", "teacher")
    )
    start = saved["step"] if saved else 0
    metrics_path = out / METRICS_FILE
    keep_metrics_before(metrics_path, start)

    # ---- the teacher, checked before anything is sampled
    teacher = open_teacher(args, service)
    check_tokenizers(training.get_tokenizer(), teacher.get_tokenizer())
    renderer = ChatRenderer(training.get_tokenizer())
    openings: dict[int, tuple[list[int], list[int]]] = {}

    def opening(task: int) -> tuple[list[int], list[int]]:
        """(the student's first prompt, the teacher's) for a task."""
        if task not in openings:
            _, info = probe.reset(options={"index": task})
            chat, tools = info["messages"], info.get("tools")
            teacher_chat = privileged_messages(chat, info["privileged"]) if args.privileged \
                else chat
            openings[task] = (renderer.prompt(chat, tools), renderer.prompt(teacher_chat, tools))
        return openings[task]

    make_env = env_factory(args.env_id, args.env_kwargs, args.ray)
    config = RolloutConfig(group_size=args.group_size, max_turns=args.max_turns,
                           max_tokens=args.max_tokens,
                           max_trajectory_tokens=args.max_trajectory_tokens)
    adam = AdamParams(learning_rate=args.learning_rate, grad_clip_norm=args.grad_clip_norm)
    probe = gymnasium.make(args.env_id, **args.env_kwargs)  # teacher openings, per task
    num_tasks = len(probe.unwrapped.tasks)

    history: list[dict[str, Any]] = []
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps,
               disable=not args.progress)
    try:
        for step in bar:
            t0 = time.perf_counter()
            # ---- the student samples on its current weights
            sampler = training.save_weights_and_get_sampling_client()
            rng = np.random.default_rng([args.seed, step])
            tasks = [int(i) for i in rng.choice(num_tasks, size=args.batch_size,
                                                replace=args.batch_size > num_tasks)]
            groups = asyncio.run(rollout_groups(
                make_env, [{"index": i} for i in tasks], sampler, renderer, config,
                seeds=[args.seed * 1_000_003 + step * 1_009 + g for g in range(len(tasks))],
                concurrency=args.concurrency,
            ))
            t1 = time.perf_counter()

            # ---- the teacher scores the student's tokens: one call per episode
            scored: list[tuple[Episode, int, float]] = []
            sequences = []
            for task, group in zip(tasks, groups, strict=True):
                student_prompt, teacher_prompt = opening(task)
                rewards = np.array([episode.reward for episode in group])
                for episode, reward in zip(group, rewards, strict=True):
                    if not episode.turns:  # the opening alone filled the trajectory budget
                        continue
                    if episode.turns[0].prompt_tokens != student_prompt:
                        raise RuntimeError(f"task {task} opened differently in the probe env")
                    scored.append((episode, len(teacher_prompt) - len(student_prompt),
                                   args.reward_coef * float(reward - rewards.mean())))
                    sequences.append([*teacher_prompt, *episode.tokens[len(student_prompt):]])
            teacher_logprobs = asyncio.run(_score(teacher, sequences))
            t2 = time.perf_counter()

            # ---- per-token advantages, one update
            datums, gaps = [], []
            for (episode, offset, reward_advantage), logprobs in zip(
                scored, teacher_logprobs, strict=True
            ):
                datum, gap = distillation_datum(episode.turns, logprobs, args.kl_coef,
                                                offset=offset, reward_advantage=reward_advantage)
                datums.append(datum)
                gaps.append(gap)
            loss = training.forward_backward(datums, "importance_sampling").result().metrics
            loss |= training.optim_step(adam).result().metrics
            t3 = time.perf_counter()

            # ---- metrics, then checkpoint
            episodes = [episode for episode, _, _ in scored]
            kl = np.concatenate(gaps)
            student = np.array([lp for e in episodes for t in e.turns for lp in t.logprobs])
            sampled = sum(episode.sampled_tokens for episode in episodes)
            ends = Counter(episode.end_reason for episode in episodes)
            row = {
                "step": step,
                "reverse_kl_mean": float(kl.mean()),
                "reverse_kl_std": float(kl.std()),
                # the same tokens: teacher logprob = student logprob - gap, token by token
                "student_logprob_mean": float(student.mean()),
                "teacher_logprob_mean": float(student.mean() - kl.mean()),
                "reward_mean": float(np.mean([episode.reward for episode in episodes])),
                "episodes": len(episodes),
                "sampled_tokens": sampled,
                "trained_tokens": active_tokens(datums),
                "completion_tokens_per_s": sampled / (t1 - t0),
                "cut_rate": ends["max_tokens"] / len(episodes),
                "end_reasons": dict(ends),
                "loss": loss.get("loss_mean"),
                "grad_norm": loss.get("grad_norm"),
                "time_rollout": t1 - t0, "time_teacher": t2 - t1, "time_train": t3 - t2,
                "time_step": time.perf_counter() - t0,
            }
            append_metrics(metrics_path, row)
            if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
                path = training.save_state(f"step-{step + 1:06d}", overwrite=True).result().path
                write_json(checkpoint, {"step": step + 1, "path": path,
                                        "args": dataclasses.asdict(args)})
            history.append(row)
            bar.set_postfix(kl=round(row["reverse_kl_mean"], 3))
    finally:
        probe.close()
    return history


async def _score(teacher: Any, sequences: Sequence[list[int]]) -> list[list[float | None]]:
    return list(await asyncio.gather(
        *(teacher.compute_logprobs_async(ModelInput.from_ints(s)) for s in sequences)
    ))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    history = train(args)
    if history:
        print(json.dumps({"step": history[-1]["step"],
                          "reverse_kl_first": history[0]["reverse_kl_mean"],
                          "reverse_kl_last": history[-1]["reverse_kl_mean"], "out": args.out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
