"""TEMPO's generative critic: the policy's own weights, asked for a value in words, and
how it is fitted and judged.

There is no value head. The sampler that acts is prompted as a critic: it reads the task,
what the env reveals to critics only (``info["privileged"]``: a walkthrough, the reference
answer, the gold answers), and a condensed history of the episode so far, and answers
``<value>x</value>``: the reward still to come, between 0 and ``R_max``.

Read. A state's value is the median of the critic's distribution over the replies stating
0, R_max/4, ..., R_max, each reply scored whole by the current weights (``Critic.median``).
TEMPO's critic is judged by absolute error, which the median of a belief minimises (not
its mean, nor its mode), and no sampling noise enters the value.

Fitted. The reply that states a state's target G (``Critic.target_reply``) trains as a
demonstration, by cross-entropy in the same update as the actor: a regression onto G in
the critic's own words, where every state counts. Warm-up finds only a few states per
update, and a critic fitted on each once settles on their mean; so ``replay`` sends earlier
warm-up replies again with every later update, drawn so the update's targets are mixed as
all of warm-up's. Why this path and not the others it was compared with (a policy-gradient
rule on sampled replies, a sampled readout, no replay): docs/experiments/tempo.md.

The reply is *prefilled* with the opening tag: the critic prompt ends with ``<value>``
after the assistant header, so a reply's first tokens are already the number. The prefill
is context, not sample: it sits in the prompt, so training never credits the model for it.
``Critic.sample`` asks for replies the ordinary way (TEMPO takes one greedy reply per
state, to report whether the critic states values at all: ``critic/parse_failure_rate``).
Parsing is strict: the last ``<value>...</value>`` of a reply that ended by itself must hold
a plain decimal number in ``[0, R_max]``; anything else is a parse failure.

Judged. Each update reports the critic's absolute error against its targets beside the
best constant in hindsight on the same states (``best_constant_error``): a critic below
it tells states apart.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from pytrio import Datum, ModelInput, SamplingParams

from agent_gym.render import ChatRenderer
from agent_gym.seeding import derive_seed
from agent_gym_train.run.clients import Sampler
from agent_gym_train.run.episode import TokenSequence, cross_entropy_datum
from agent_gym_train.run.files import Metrics

SYSTEM_PROMPT = (
    "You are the critic of an agent that works on a task over several turns. You see the "
    "task, privileged information the agent cannot see (such as a walkthrough or the "
    "reference answer) and what the agent did so far. Estimate the reward the agent will "
    "still collect from this point on, between 0 and {r_max}; for a task that is either "
    "solved or not, that is the probability that the agent solves it. {answer} in a value "
    "tag: <value>{high}</value> when the history shows the agent on its way to the answer, "
    "<value>{low}</value> when it is lost, anything in between."
)
# How the system prompt asks for the value, with and without a prefilled tag.
ANSWER_NOW = "Reply with only the estimate"
THINK_FIRST = "Think briefly, then end your reply with the estimate"
VALUE_PREFILL = "<value>"
VALUE_CLOSE = "</value>"
STOPPED = "stop"  # pytrio's stop_reason for a stop token or string
# The values, as fractions of R_max, whose replies the median readout scores: TEMPO's
# targets are means of a few branches' returns, so quarters hold the N = 4 groups' exactly.
VALUE_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)
# Privileged keys that restate another key in the actor's own action format (scripted
# policies replay them); they add length, not information.
HIDDEN_PRIVILEGED = frozenset({"oracle_actions"})
# Character budgets keep every critic prompt short whatever the episode's length: a critic
# must read a 50-turn ALFWorld game in a few hundred tokens.
TASK_CHARS = 1500
PRIVILEGED_CHARS = 1500
ACTION_CHARS = 300  # replies end with the action, so the tail is kept
OBSERVATION_CHARS = 400  # observations start with what happened, so the head is kept
HISTORY_TURNS = 8  # most recent turns shown; earlier ones are counted

_VALUE_TAG = re.compile(r"<value>(.*?)</value>", re.DOTALL)
_DECIMAL = re.compile(r"\d+(?:\.\d+)?|\.\d+")


def parse_value(text: str, r_max: float) -> float | None:
    """The number in the last ``<value>`` tag if it is a plain decimal in [0, r_max]."""
    tags = _VALUE_TAG.findall(text)
    if not tags:
        return None
    body = tags[-1].strip()
    if not _DECIMAL.fullmatch(body):
        return None
    value = float(body)
    return value if 0.0 <= value <= r_max else None


def critic_messages(
    messages: Sequence[Mapping[str, Any]],
    opening: int,
    privileged: Mapping[str, Any],
    r_max: float,
    *,
    prefill: bool = True,
) -> list[dict[str, str]]:
    """The critic's chat for the point an episode reached.

    ``messages[:opening]`` is the episode's opening (system prompt and task), the rest its
    history: an assistant reply and the env's answer per turn.
    """
    task = "\n\n".join(
        str(m.get("content", "")) for m in messages[:opening] if m.get("role") != "system"
    )
    history = list(messages[opening:])
    turns = [history[i : i + 2] for i in range(0, len(history), 2)]
    shown = turns[-HISTORY_TURNS:]
    lines = []
    if len(turns) > len(shown):
        lines.append(f"({len(turns) - len(shown)} earlier turns not shown)")
    for number, turn in enumerate(shown, start=len(turns) - len(shown) + 1):
        action = _clip(_flat(turn[0].get("content")), ACTION_CHARS, keep_tail=True)
        lines.append(f"Turn {number}. Agent: {action}")
        if len(turn) > 1:
            answer = _clip(_flat(turn[1].get("content")), OBSERVATION_CHARS, keep_tail=False)
            lines.append(f"Result: {answer}")
    secrets = {k: v for k, v in privileged.items() if k not in HIDDEN_PRIVILEGED}
    # The privileged information comes after the history, next to the question: a critic
    # mostly compares the two (is the reference answer already in what the agent read?),
    # and a small model learns that more readily with the reference last (measured:
    # docs/experiments/tempo.md).
    user = (
        f"## Task\n{_clip(task, TASK_CHARS, keep_tail=False)}\n\n"
        f"## History ({len(turns)} turns so far)\n"
        + ("\n".join(lines) if lines else "(nothing yet)")
        + "\n\n## Privileged information\n"
        + _clip(_format(secrets), PRIVILEGED_CHARS, keep_tail=False)
        + f"\n\nHow much reward (0 to {_number(r_max)}) will the agent still collect?"
    )
    # Two anchors, not one example: SmolLM2 copied a single example value into every reply.
    system = SYSTEM_PROMPT.format(r_max=_number(r_max), high=_number(0.9 * r_max),
                                  low=_number(0.1 * r_max),
                                  answer=ANSWER_NOW if prefill else THINK_FIRST)
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


@dataclass
class CriticSample:
    """One critic reply: its prompt and sampled tokens (trainable as a one-span datum) and
    its value (None: parse failure)."""

    sequence: TokenSequence
    value: float | None


class Critic:
    """Prompts, samples and parses the critic on a sampler of the current weights."""

    def __init__(
        self, renderer: ChatRenderer, *, r_max: float, max_tokens: int,
        temperature: float = 0.0, prefill: bool = True,
    ) -> None:
        if not (math.isfinite(r_max) and r_max > 0):
            raise ValueError(f"r_max must be a positive number, got {r_max}")
        self.renderer = renderer
        self.r_max = r_max
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.prefill = VALUE_PREFILL if prefill else ""

    def prompt(
        self, messages: Sequence[Mapping[str, Any]], opening: int, privileged: Mapping[str, Any]
    ) -> list[int]:
        """The critic chat's tokens, ending with the prefilled tag opening (if any)."""
        chat = critic_messages(messages, opening, privileged, self.r_max,
                               prefill=bool(self.prefill))
        return [*self.renderer.prompt(chat), *self.renderer.encode(self.prefill)]

    async def sample(
        self, sampler: Sampler, prompt: list[int], n: int, seed: int
    ) -> list[CriticSample]:
        """``n`` critic replies to one prompt (one shared prefill).

        A prefilled reply also stops at ``</value>``: the answer is complete there, and a
        small model that closes the tag and then chats on would otherwise be cut and lost.
        """
        stop: list[str] | list[int] = list(self.renderer.stop_tokens)
        if self.prefill:
            stop = [VALUE_CLOSE, self.renderer.tokenizer.decode(self.renderer.stop_tokens)]
        response = await sampler.sample_async(
            ModelInput.from_ints(prompt),
            num_samples=n,
            sampling_params=SamplingParams(
                max_tokens=self.max_tokens,
                seed=derive_seed("critic", seed),
                stop=stop,
                temperature=self.temperature,
            ),
        )
        samples = []
        for sequence in response.sequences:
            tokens = list(sequence.tokens)
            value = None
            # A cut reply is a failure, whatever it says.
            ended = (sequence.stop_reason == STOPPED if self.prefill
                     else self.renderer.is_finished(tokens))
            if ended:
                value = parse_value(self.prefill + self.renderer.completion_text(tokens),
                                    self.r_max)
            sampled = TokenSequence(tuple(prompt)).extend(prompt, tokens, sequence.logprobs)
            samples.append(CriticSample(sampled, value))
        return samples

    async def target_reply(
        self, sampler: Sampler, prompt: list[int], target: float
    ) -> CriticSample:
        """The reply that states ``target`` (to two decimals, clipped to [0, R_max]), with
        the current weights' logprobs of it: what the critic is trained to say at a state
        whose target is ``target``, and one of the replies ``median`` weighs."""
        value = round(min(max(target, 0.0), self.r_max), 2)
        text = _number(value) + VALUE_CLOSE
        tokens = self.renderer.encode(text if self.prefill else VALUE_PREFILL + text)
        if not self.prefill:
            tokens.append(self.renderer.stop_tokens[0])
        scored = await sampler.compute_logprobs_async(ModelInput.from_ints([*prompt, *tokens]))
        logprobs = [float(v) for v in scored[len(prompt):]]
        sequence = TokenSequence(tuple(prompt)).extend(prompt, tokens, logprobs)
        return CriticSample(sequence, value)

    async def median(self, sampler: Sampler, prompt: list[int]) -> float:
        """The median of the critic's distribution over the replies stating each
        ``VALUE_GRID`` value, every reply scored whole (``target_reply``): one estimate, no
        sampling noise, and the one absolute error asks for."""
        replies = await asyncio.gather(*(self.target_reply(sampler, prompt, v * self.r_max)
                                         for v in VALUE_GRID))
        logprobs = np.array([sum(reply.sequence.spans[-1].logprobs) for reply in replies])
        weights = np.exp(logprobs - logprobs.max())
        below = np.cumsum(weights / weights.sum())
        return float(replies[int(np.searchsorted(below, 0.5))].value)

    async def values(
        self, sampler: Sampler, prompts: Sequence[list[int] | None]
    ) -> list[float]:
        """Many states' values at once (``median``); a ``None`` prompt is a terminal state,
        worth 0 with nothing scored."""

        async def one(prompt: list[int] | None) -> float:
            return 0.0 if prompt is None else await self.median(sampler, prompt)

        return list(await asyncio.gather(*(one(p) for p in prompts)))


# --------------------------------------------------------------------- fitting and judging
Item = TypeVar("Item")


def critic_fit(
    replies: Sequence[CriticSample], estimates: Sequence[float], targets: Sequence[float],
    greedy: Sequence[CriticSample],
) -> tuple[list[Datum], Metrics]:
    """The critic's datums for one update, one per state: the reply stating its target,
    trained by cross-entropy; and the critic's accuracy metrics, its ``estimates`` (the
    median readout, one per state) against the ``targets``, with the parse rate of its
    ``greedy`` replies.

    ``critic/abs_error_constant`` is what the best constant in hindsight would have scored
    on the same states (``best_constant_error``). It is fitted to this update alone;
    ``critic/per_state`` ([target, 1, estimate] per state) lets a reader pool updates and
    fit one constant to all of them, the best constant predictor of the whole run."""
    per_state: list[list[float | int | None]] = [
        [float(t), 1, float(e)] for t, e in zip(targets, estimates, strict=True)]
    errors = [abs(e - t) for t, e in zip(targets, estimates, strict=True)]
    datums = [cross_entropy_datum(reply.sequence) for reply in replies]
    return datums, {
        "critic/abs_error_mean": float(np.mean(errors)) if errors else None,
        "critic/abs_error_constant": best_constant_error(per_state),
        "critic/parsed": len(errors),
        "critic/value_corr": value_corr(estimates, targets),
        "critic/value_mean": float(np.mean(estimates)) if len(estimates) else None,
        "critic/target_mean": float(np.mean(targets)) if len(targets) else None,
        "critic/states": len(targets),
        "critic/datums": len(datums),
        "critic/samples": len(greedy),
        "critic/parse_failure_rate": failure_rate(greedy),
        "critic/per_state": per_state,
    }


def best_constant_error(per_state: Sequence[Sequence[float | int | None]]) -> float | None:
    """The mean absolute error of the best constant in hindsight on some states'
    estimates (``[target, estimates, mean estimate]`` each, as ``critic_fit`` reports
    them): every estimate is scored against its state's target, and the constant is the
    median of those targets, which minimises the mean absolute error (the mean does not:
    on targets 0, 0, 1 it scores 0.44, the median 0.33). None: no estimate."""
    scored = [float(target) for target, parsed, _ in per_state for _ in range(int(parsed))]
    if not scored:
        return None
    return float(np.mean(np.abs(np.subtract(scored, np.median(scored)))))


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
    outcome or the other, and fitting them swings the critic's overall level: the level
    moved more between updates than the value between the states of one. Each target
    value gets its share of the update's datums (less what the update holds already);
    leftover places are drawn at random."""
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


def failure_rate(samples: Sequence[CriticSample]) -> float | None:
    """The share of critic replies that stated no value."""
    return sum(s.value is None for s in samples) / len(samples) if samples else None


def _flat(content: Any) -> str:
    """One line: a turn of the history reads as one entry."""
    return " ".join(str(content or "").split())


def _clip(text: str, limit: int, *, keep_tail: bool) -> str:
    if len(text) <= limit:
        return text
    return "..." + text[-limit:] if keep_tail else text[:limit] + "..."


def _format(privileged: Mapping[str, Any]) -> str:
    if not privileged:
        return "(none)"
    lines = []
    for key, value in privileged.items():
        if isinstance(value, list | tuple):
            shown = "; ".join(str(v) for v in value)
        elif isinstance(value, str):
            shown = value
        else:
            shown = json.dumps(value, ensure_ascii=False)
        lines.append(f"- {key}: {shown}")
    return "\n".join(lines)


def _number(value: float) -> str:
    return f"{value:g}"
