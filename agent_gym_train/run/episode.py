"""Episodes as the sampler saw them, the points they can resume from, and the training
``Datum`` each one becomes.

Everything here stands on one representation, ``TokenSequence``: a branch's tokens and the
spans of them a policy sampled, each with the logprobs the sampler reported. Because
prompts grow by extension (see ``agent_gym.render``), a branch's last prompt plus its last
completion is its whole trajectory, and every earlier completion sits inside it at a known
offset: a span. An episode's sequence becomes its Datum; a point to resume from keeps the
sequence up to there (its spans say which prefix tokens the importance correction scores);
a critic reply is a sequence with one span.

One sequence becomes one ``pytrio.Datum`` (tinker format, next-token aligned):

* ``model_input`` = tokens[:-1] and position ``i`` predicts token ``i + 1``;
* sampled tokens carry their target id, the sampler's logprob and the advantage;
* prompt, closing and observation tokens carry target ``-100``, logprob 0 and advantage 0.

Target ``-100`` (rather than the real id with advantage 0) matters under pytrio's
semantics: the trainer divides the batch's summed loss by the number of targets that are
not ``-100``, so masked positions left as real ids would dilute every update by the prompt
length. Send a logical batch in one ``forward_backward`` call: the SDK splits it into
requests itself and normalises by whole-batch totals, while two calls would each be
normalised by their own share.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pytrio import Datum, ModelInput
from pytrio.types import TensorData

from agent_gym.env.state import EnvState, StateError
from agent_gym_train.backends import IGNORE_TARGET


class DatumError(ValueError):
    """Tokens that cannot form one token-continuous training sequence, or a resume point
    that cannot continue one."""


@dataclass(frozen=True)
class Span:
    """Tokens ``[start, end)`` of a sequence, sampled in one call with these logprobs."""

    start: int
    logprobs: tuple[float, ...]

    @property
    def end(self) -> int:
        return self.start + len(self.logprobs)


@dataclass(frozen=True)
class TokenSequence:
    """A branch's tokens and the spans of them a policy sampled (see the module docstring).

    Spans are in order, do not overlap and lie inside ``tokens``; every logprob is finite.
    Tokens outside every span (prompt, template, observations, a resumed prefix taken as
    context) are never trained on.
    """

    tokens: tuple[int, ...]
    spans: tuple[Span, ...] = ()

    def __post_init__(self) -> None:
        previous = 0
        for span in self.spans:
            if not previous <= span.start <= span.end <= len(self.tokens):
                raise DatumError(
                    f"sampled span [{span.start}, {span.end}) is out of order or outside the "
                    f"{len(self.tokens)} tokens"
                )
            if not all(math.isfinite(value) for value in span.logprobs):
                raise DatumError("sampled logprobs must be finite")
            previous = span.end

    def extend(
        self, prompt: Sequence[int], completion: Sequence[int], logprobs: Sequence[float]
    ) -> TokenSequence:
        """This sequence continued by one sampling call on ``prompt`` (see ``grown_to``)."""
        if len(completion) != len(logprobs):
            raise DatumError(
                f"a sampling call returned {len(completion)} tokens but {len(logprobs)} logprobs"
            )
        grown = self.grown_to(prompt)
        span = Span(len(prompt), tuple(float(v) for v in logprobs))
        return TokenSequence((*grown.tokens, *completion), (*grown.spans, span))

    def grown_to(self, prompt: Sequence[int]) -> TokenSequence:
        """The same spans on ``prompt``, which must start with every token of this sequence
        (raises ``DatumError`` if a template rewrote history)."""
        if tuple(prompt[: len(self.tokens)]) != self.tokens:
            raise DatumError(
                f"the prompt after turn {len(self.spans)} does not extend the tokens before "
                "it: the trajectory is not token-continuous"
            )
        return TokenSequence(tuple(prompt), self.spans)

    def prefix(self, length: int) -> TokenSequence:
        """The first ``length`` tokens with the spans inside them; no span may be split."""
        if not 0 < length <= len(self.tokens):
            raise DatumError(f"no prefix of {length} tokens in a sequence of {len(self.tokens)}")
        if any(span.start < length < span.end for span in self.spans):
            raise DatumError(f"a prefix of {length} tokens would split a sampled span")
        return TokenSequence(self.tokens[:length], tuple(s for s in self.spans if s.end <= length))

    def as_context(self) -> TokenSequence:
        """The same tokens, none of them to be trained on (a resumed prefix)."""
        return TokenSequence(self.tokens)

    def completion(self, index: int) -> tuple[int, ...]:
        """The tokens sampled in span ``index``."""
        span = self.spans[index]
        return self.tokens[span.start : span.end]

    @property
    def sampled_tokens(self) -> int:
        return sum(len(span.logprobs) for span in self.spans)

    @property
    def logprob_sum(self) -> float:
        """The sum of the logprobs the sampling policies gave the sampled tokens."""
        return float(sum(sum(span.logprobs) for span in self.spans))

    def score(self, logprobs: Sequence[float | None]) -> float:
        """Sum of ``logprobs[i]`` over the sampled positions, ``logprobs`` being a
        ``compute_logprobs`` answer for ``tokens`` (index i: logprob of token i)."""
        if len(logprobs) != len(self.tokens):
            raise DatumError(f"got {len(logprobs)} logprobs for {len(self.tokens)} tokens")
        total = 0.0
        for span in self.spans:
            for value in logprobs[span.start : span.end]:
                if value is None:
                    raise DatumError("a sampled token has no logprob")
                total += value
        return total

    def to_dict(self) -> dict[str, list[int] | list[dict[str, int | list[float]]]]:
        return {
            "tokens": list(self.tokens),
            "spans": [{"start": s.start, "logprobs": list(s.logprobs)} for s in self.spans],
        }

    @classmethod
    def from_dict(cls, payload: object) -> TokenSequence:
        if not isinstance(payload, dict) or set(payload) != {"tokens", "spans"}:
            raise DatumError("a saved token sequence is an object with tokens and spans")
        tokens, spans = payload["tokens"], payload["spans"]
        if not (isinstance(tokens, list) and all(type(t) is int for t in tokens)):
            raise DatumError("a saved token sequence's tokens must be a list of integers")
        if not (isinstance(spans, list) and all(
            isinstance(s, dict) and set(s) == {"start", "logprobs"} and type(s["start"]) is int
            and isinstance(s["logprobs"], list)
            and all(isinstance(v, int | float) for v in s["logprobs"])
            for s in spans
        )):
            raise DatumError("a saved token sequence's spans must be {start, logprobs} objects")
        return cls(tuple(tokens), tuple(Span(s["start"], tuple(map(float, s["logprobs"])))
                                        for s in spans))


def build_datum(
    sequence: TokenSequence, advantage: float, *, max_length: int | None = None
) -> Datum:
    """The training datum of a sequence: ``advantage`` on every sampled token.

    Raises ``DatumError`` when nothing was sampled, the advantage is not finite, or the
    input would exceed ``max_length`` tokens.
    """
    if not sequence.spans:
        raise DatumError("a datum needs at least one sampled span")
    if not np.isfinite(advantage):
        raise DatumError(f"advantage must be finite, got {advantage}")
    tokens = sequence.tokens
    if len(tokens) < 2:
        raise DatumError("a datum needs at least two tokens")
    if max_length is not None and len(tokens) - 1 > max_length:
        raise DatumError(f"the datum has {len(tokens) - 1} input tokens, over {max_length}")

    targets = np.asarray(tokens[1:], dtype=np.int64)
    sampled = np.zeros(len(targets), dtype=bool)
    logprobs = np.zeros(len(targets), dtype=np.float32)
    for span in sequence.spans:
        # Token at sequence position p is predicted at input position p - 1; a span at
        # position 0 has no input before it and cannot be trained.
        if span.start == 0:
            raise DatumError("a sampled span at position 0 has no prompt to predict it from")
        sampled[span.start - 1 : span.end - 1] = True
        logprobs[span.start - 1 : span.end - 1] = span.logprobs
    targets[~sampled] = IGNORE_TARGET
    advantages = np.where(sampled, np.float32(advantage), np.float32(0.0))
    return Datum(
        model_input=ModelInput.from_ints(list(tokens[:-1])),
        loss_fn_inputs={
            "target_tokens": _tensor(targets, "int64"),
            "logprobs": _tensor(logprobs, "float32"),
            "advantages": _tensor(advantages, "float32"),
        },
    )


def cross_entropy_datum(
    sequence: TokenSequence, weight: float = 1.0, *, max_length: int | None = None
) -> Datum:
    """A ``cross_entropy`` datum: ``weight`` on every token of the sequence's spans (a
    demonstration's actions, a teacher's reply), masked elsewhere.

    Built through ``build_datum`` with advantage ``weight``, whose advantages are then
    exactly the weights, so supervised and RL datums share one alignment and one masking
    rule. pytrio divides the summed weighted NLL by the targets that are not ``-100``, so a
    weight below 1 scales a cross-entropy term against a policy loss sent in the same step.
    """
    datum = build_datum(sequence, weight, max_length=max_length)
    inputs = datum.loss_fn_inputs
    return Datum(model_input=datum.model_input,
                 loss_fn_inputs={"target_tokens": inputs["target_tokens"],
                                 "weights": inputs["advantages"]})


def _tensor(values: np.ndarray, dtype: str) -> TensorData:
    # The arrays were built here with the right dtype and shape, so pydantic's per-element
    # re-validation (most of the cost of a Datum) is skipped.
    return TensorData.model_construct(data=values.tolist(), dtype=dtype, shape=[len(values)])


def active_tokens(datums: Sequence[Datum]) -> int:
    """Targets that count in pytrio's ``token_count`` (all but ``-100``)."""
    return sum(
        sum(1 for t in d.loss_fn_inputs["target_tokens"].data if t != IGNORE_TARGET)
        for d in datums
    )


def datums_digest(datums: Sequence[Datum]) -> str:
    """A fingerprint of what a step trains: every datum's tokens, targets and advantages,
    in order (16 hex chars of SHA-256). The sampler's logprobs are left out: they carry
    float noise from how rows were batched. Two runs whose steps have the same digests
    trained on the same episodes with the same advantages."""
    hashed = hashlib.sha256()
    for datum in datums:
        inputs = datum.loss_fn_inputs
        hashed.update(json.dumps([datum.model_input.to_ints(), inputs["target_tokens"].data,
                                  inputs["advantages"].data]).encode())
    return hashed.hexdigest()[:16]


@dataclass(frozen=True)
class ResumePoint:
    """A point inside an episode to continue branches from: the one resume type of the
    trainers (rollouts resume from it, TEMPO's store keeps it).

    ``state`` is the env's recipe to rebuild itself there (``agent_gym.env.state``);
    ``sequence`` the exact prompt tokens the policy had there, ending with a generation
    prompt, with the spans every earlier reply sampled (what the prefix importance weight
    scores); ``messages`` the chat those tokens render, whose first ``opening`` messages
    are the task and whose last is the observation the saved episode showed;
    ``privileged`` what the env revealed for critics; ``version`` the policy version that
    reached the point.
    """

    state: EnvState
    sequence: TokenSequence
    messages: tuple[Mapping[str, Any], ...]
    opening: int
    privileged: Mapping[str, Any]
    version: int

    def __post_init__(self) -> None:
        if not self.sequence.tokens:
            raise DatumError("a resume point needs its prompt tokens")
        if not 0 < self.opening < len(self.messages) or "content" not in self.messages[-1]:
            raise DatumError(
                f"a resume point's chat needs its opening ({self.opening} messages) and a "
                f"history after it ending with an observation, got {len(self.messages)} messages"
            )

    @property
    def turn(self) -> int:
        """Env steps taken before this point."""
        return self.state.depth

    @property
    def observation(self) -> str:
        return str(self.messages[-1]["content"])

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": json.loads(self.state.to_json()),
            "sequence": self.sequence.to_dict(),
            "messages": [dict(m) for m in self.messages],
            "opening": self.opening,
            "privileged": dict(self.privileged),
            "version": self.version,
        }

    @classmethod
    def from_dict(cls, payload: object) -> ResumePoint:
        names = {"state", "sequence", "messages", "opening", "privileged", "version"}
        if not isinstance(payload, dict) or set(payload) != names:
            got = sorted(payload) if isinstance(payload, dict) else type(payload).__name__
            raise DatumError(f"a saved resume point has fields {got}, expected {sorted(names)}")
        try:
            state = EnvState.from_dict(payload["state"])
        except StateError as err:
            raise DatumError(f"a saved resume point has a bad env state: {err}") from err
        messages, privileged = payload["messages"], payload["privileged"]
        if not (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)):
            raise DatumError("a saved resume point's messages must be a list of objects")
        if not isinstance(privileged, dict):
            raise DatumError("a saved resume point's privileged information must be an object")
        if type(payload["opening"]) is not int or type(payload["version"]) is not int:
            raise DatumError("a saved resume point's opening and version must be integers")
        return cls(state, TokenSequence.from_dict(payload["sequence"]), tuple(messages),
                   payload["opening"], privileged, payload["version"])


@dataclass
class Episode:
    """A finished branch: its token sequence, total reward and why it ended.

    ``sequence`` holds the opening prompt (or, resumed from ``start``, the prefix there, as
    context only) and every reply this episode sampled, one span each, so it is the
    episode's Datum as it stands. ``end_reason`` is ``terminated`` or ``truncated`` (the
    env's verdict), ``max_turns``, ``max_tokens`` (the last reply was cut and never shown
    to the env) or ``trajectory_budget`` (no room left for another reply). ``cut_replies``
    counts the cut replies that were shown to the env anyway (``RolloutConfig.cut_continues``).

    ``step_rewards`` holds the env's reward for each step (``reward`` adds the cut penalty,
    if any), ``opening_messages`` how many of ``messages`` the episode opened with, and
    ``privileged`` what the env revealed for critics only. Rollouts asked to keep states
    also record the env's final ``env_state`` and, for a branch stopped at its turn budget,
    ``next_prompt``: the exact prompt it would have continued from.

    Under a history window (``RolloutConfig.history_window``) every cut restarts the
    token-continuous prompt: ``earlier`` holds the sequences closed by cuts, in order, and
    ``sequences`` all of them; each becomes a Datum with the episode's advantage.
    """

    task_id: str
    sequence: TokenSequence
    reward: float = 0.0
    end_reason: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    invalid_actions: int = 0
    step_rewards: list[float] = field(default_factory=list)
    opening_messages: int = 0
    privileged: dict[str, Any] = field(default_factory=dict)
    env_state: EnvState | None = None
    next_prompt: list[int] | None = None
    start: ResumePoint | None = None
    earlier: tuple[TokenSequence, ...] = ()
    cut_replies: int = 0
    version: int | None = None  # the weights that sampled it, when the run counts versions

    @property
    def sequences(self) -> tuple[TokenSequence, ...]:
        """Every token-continuous piece of the episode: ``earlier``, then ``sequence``."""
        return (*self.earlier, self.sequence)

    @property
    def turns(self) -> int:
        """Replies sampled in this episode."""
        return sum(len(s.spans) for s in self.sequences)

    @property
    def sampled_tokens(self) -> int:
        return sum(s.sampled_tokens for s in self.sequences)
