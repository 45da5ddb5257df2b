"""TEMPO's generative critic: the policy's own weights, asked for a value in words.

There is no value head. The same sampler that acts is prompted as a critic: it reads the
task, what the env reveals to critics only (``info["privileged"]``: a walkthrough, the
reference answer, the gold answers), and a condensed history of the episode so far, then
reasons briefly and ends with ``<value>x</value>``: the reward still to come, between 0 and
``R_max``. Because the critic is the policy, it is trained by the same policy-gradient
update on its own sampled replies: a reply is rewarded ``-|V_k - G| / R_max`` against a
target ``G`` (a Monte Carlo return in warm-up, the mean macro-step return in TD updates),
centred over the K replies to one prompt and the reply that states ``G`` itself (scored by
the current weights, not sampled: ``Critic.target_reply``). Without that reply a critic
whose K samples agree gets K equal rewards and no gradient, wrong or not.

By default the reply is *prefilled* with the opening tag: the critic prompt ends with
``<value>`` after the assistant header, so the model's first sampled tokens are already the
number, and sampling stops at ``</value>``: a parse needs about four tokens (``0.5</value>``).
Small models asked to "reason, then end with a tag" ramble past any CPU-sized budget: the
untrained SmolLM2-135M parsed 0 of 32 replies of 64 tokens that way, and 17 of 32 replies
of 8 tokens prefilled (ALFWorld-v0 and GSM8K-v0 critic prompts). The prefill is
context, not sample: it sits in the sampled turn's prompt tokens, so training never
credits the model for it. ``prefill=False`` restores the reasoning critic for models that
can afford it.

How a state's value is read (``readout``). ``samples``: the mean of M sampled replies that
parse. ``median``: the median of the critic's distribution over the replies stating 0,
R_max/4, ..., R_max, each scored whole by the current weights (``Critic.median``). TEMPO's
critic is judged by absolute error, which the median of a belief minimises, not its mean
or its mode; and reading a value token by token favours the decimals, whose replies
share the first token "0" against "1" alone. Measured on Search-v0 (README, TEMPO), it
is no cure for a critic whose fit has collapsed to one value: it reads that value too.

Parsing is strict: the last ``<value>...</value>`` of a reply (prefill included) that ended
by itself must hold a plain decimal number in ``[0, R_max]``. Anything else (no tag, a cut
reply, "0.5%", "1e-1", a value out of range) is a parse failure: it is counted, it earns the
worst critic reward (-1) when trained, and it contributes nothing to a value estimate.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pytrio import ModelInput, SamplingParams

from agent_gym.render import ChatRenderer
from agent_gym.seeding import derive_seed
from agent_gym_train.clients import Sampler
from agent_gym_train.episode import TokenSequence

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
# How a state's value is read (the module's docstring), and the values, as fractions of
# R_max, whose replies the median readout scores: TEMPO's targets are means of a few
# branches' returns, so quarters hold the N = 4 groups' exactly.
READOUTS = ("samples", "median")
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


def critic_rewards(values: Sequence[float | None], target: float, r_max: float) -> np.ndarray:
    """Uncentred critic rewards: ``-|V_k - target| / r_max``, -1 for a parse failure."""
    return np.array(
        [-1.0 if v is None else -abs(v - target) / r_max for v in values], dtype=np.float64
    )


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
    # and a small model learns that more readily with the reference last. bench_critic on
    # the same Search-v0 states (SmolLM2 from the 3-epoch SFT checkpoint, one
    # cross-entropy epoch at lr 3e-4): with the reference first the critic said 0 on every
    # held-out state (abs error 0.598 against 0.403 for the best constant,
    # benchmarks/experiments/critic-layout/); with it last it beat the constant (0.348, gain
    # interval [0.02, 0.095], same folder).
    user = (
        f"## Task\n{_clip(task, TASK_CHARS, keep_tail=False)}\n\n"
        f"## History ({len(turns)} turns so far)\n"
        + ("\n".join(lines) if lines else "(nothing yet)")
        + "\n\n## Privileged information\n"
        + _clip(_format(secrets), PRIVILEGED_CHARS, keep_tail=False)
        + f"\n\nHow much reward (0 to {_number(r_max)}) will the agent still collect?"
    )
    # Two anchors, not one example: SmolLM2 copied a single example value into every
    # reply, so the K replies to a state were all alike, earned the same critic reward,
    # and the centred update had nothing to learn from (every critic group degenerate).
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
        self, renderer: ChatRenderer, *, r_max: float, max_tokens: int, temperature: float,
        prefill: bool = True, readout: str = "samples",
    ) -> None:
        if not (math.isfinite(r_max) and r_max > 0):
            raise ValueError(f"r_max must be a positive number, got {r_max}")
        if readout not in READOUTS:
            raise ValueError(f"readout must be one of {READOUTS}, got {readout!r}")
        self.readout = readout
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
        """The reply that states ``target`` (to two decimals, clipped to [0, R_max]), scored
        by the current weights, so it trains like a sampled reply with importance ratio 1.

        Sampled replies alone teach nothing once they agree: a critic that answers the same
        number at every state (SmolLM2 on Search-v0 settled on 0.0 within three warm-up
        updates) gets K equal rewards, the centred group is degenerate, and its mistakes
        are never corrected. Trained with the K samples, the target's own reply earns the
        best reward of its group whenever the samples miss, so the group is never stuck.
        """
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

    async def value(
        self, sampler: Sampler, prompt: list[int], n: int, seed: int
    ) -> tuple[float, list[CriticSample]]:
        """An endpoint's value and the replies sampled for it. ``samples``: the mean of the
        parsed values of ``n`` replies, 0 when none parses (no estimate is no evidence of
        future reward). ``median``: ``median``, nothing sampled."""
        if self.readout == "median":
            return await self.median(sampler, prompt), []
        samples = await self.sample(sampler, prompt, n, seed)
        parsed = [s.value for s in samples if s.value is not None]
        return (float(np.mean(parsed)) if parsed else 0.0), samples


async def gather_values(
    critic: Critic, sampler: Sampler, prompts: Sequence[list[int] | None], n: int,
    seeds: Sequence[int],
) -> list[tuple[float, list[CriticSample]]]:
    """Values of many endpoints at once; a ``None`` prompt is a terminal endpoint (0)."""

    async def one(prompt: list[int] | None, seed: int) -> tuple[float, list[CriticSample]]:
        if prompt is None:
            return 0.0, []
        return await critic.value(sampler, prompt, n, seed)

    return list(await asyncio.gather(*(one(p, s) for p, s in zip(prompts, seeds, strict=True))))


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
