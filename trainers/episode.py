"""Episodes as the sampler saw them, and the training ``Datum`` each one becomes.

An episode is a list of turns. Each turn keeps the exact prompt tokens the sampler was
given, the tokens it sampled, their logprobs and why sampling stopped. Because prompts grow
by extension (see ``agent_gym.render``), the last prompt plus the last completion is the
whole trajectory, and every earlier completion sits inside it at a known offset.

One episode becomes one ``pytrio.Datum`` (tinker format, next-token aligned):

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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pytrio import Datum, ModelInput
from pytrio.types import TensorData

from agent_gym.state import EnvState

IGNORE_TARGET = -100
STOP_LENGTH = "length"


class DatumError(ValueError):
    """Turns that cannot form one token-continuous training sequence."""


@dataclass
class Turn:
    """One sampling call of one branch, exactly as sent and received."""

    prompt_tokens: list[int]
    completion_tokens: list[int]
    logprobs: list[float]
    stop_reason: str

    def __post_init__(self) -> None:
        if not self.prompt_tokens:
            raise DatumError("a turn needs a non-empty prompt")
        if len(self.completion_tokens) != len(self.logprobs):
            raise DatumError(
                f"a turn has {len(self.completion_tokens)} completion tokens but "
                f"{len(self.logprobs)} logprobs"
            )

    @property
    def cut(self) -> bool:
        """Sampling stopped at ``max_tokens``: the reply is unfinished."""
        return self.stop_reason == STOP_LENGTH


@dataclass
class Episode:
    """A finished branch: its turns, total reward and why it ended.

    ``end_reason`` is ``terminated`` or ``truncated`` (the env's verdict), ``max_turns``,
    ``max_tokens`` (the last reply was cut and never shown to the env) or
    ``trajectory_budget`` (no room left for another reply).

    ``step_rewards`` holds the env's reward for each step (``reward`` adds the cut penalty,
    if any), ``opening_messages`` how many of ``messages`` the episode opened with, and
    ``privileged`` what the env revealed for critics only. Rollouts asked to keep states
    also record the env's final ``env_state`` and, for a branch stopped at its turn budget,
    ``next_prompt``: the exact prompt it would have continued from.
    """

    task_id: str
    turns: list[Turn]
    reward: float = 0.0
    end_reason: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    invalid_actions: int = 0
    step_rewards: list[float] = field(default_factory=list)
    opening_messages: int = 0
    privileged: dict[str, Any] = field(default_factory=dict)
    env_state: EnvState | None = None
    next_prompt: list[int] | None = None

    @property
    def tokens(self) -> list[int]:
        last = self.turns[-1]
        return [*last.prompt_tokens, *last.completion_tokens]

    @property
    def sampled_tokens(self) -> int:
        return sum(len(turn.completion_tokens) for turn in self.turns)


def build_datum(
    turns: Sequence[Turn], advantage: float, *, max_length: int | None = None
) -> Datum:
    """The training datum for consecutive turns of one branch.

    The first turn's prompt is context only (for a whole episode: the opening prompt; for
    a macro-step resumed from a saved state: everything before it). Raises ``DatumError``
    when a turn's prompt does not extend the previous prompt and completion, or when the
    input would exceed ``max_length`` tokens.
    """
    if not turns:
        raise DatumError("a datum needs at least one turn")
    if not np.isfinite(advantage):
        raise DatumError(f"advantage must be finite, got {advantage}")
    sequence = list(turns[0].prompt_tokens)
    spans: list[tuple[int, Sequence[float]]] = []
    for index, turn in enumerate(turns):
        if index:
            if turn.prompt_tokens[: len(sequence)] != sequence:
                raise DatumError(
                    f"turn {index}'s prompt does not extend turn {index - 1}'s prompt and "
                    "completion: the trajectory is not token-continuous"
                )
            sequence = list(turn.prompt_tokens)
        spans.append((len(sequence), turn.logprobs))
        sequence.extend(turn.completion_tokens)
    if len(sequence) < 2:
        raise DatumError("a datum needs at least two tokens")
    if max_length is not None and len(sequence) - 1 > max_length:
        raise DatumError(f"the datum has {len(sequence) - 1} input tokens, over {max_length}")

    targets = np.asarray(sequence[1:], dtype=np.int64)
    sampled = np.zeros(len(targets), dtype=bool)
    logprobs = np.zeros(len(targets), dtype=np.float32)
    for start, values in spans:
        # Token at sequence position p is predicted at input position p - 1.
        sampled[start - 1 : start - 1 + len(values)] = True
        logprobs[start - 1 : start - 1 + len(values)] = values
    if not np.isfinite(logprobs).all():
        raise DatumError("sampled logprobs must be finite")
    targets[~sampled] = IGNORE_TARGET
    advantages = np.where(sampled, np.float32(advantage), np.float32(0.0))
    return Datum(
        model_input=ModelInput.from_ints(sequence[:-1]),
        loss_fn_inputs={
            "target_tokens": _tensor(targets, "int64"),
            "logprobs": _tensor(logprobs, "float32"),
            "advantages": _tensor(advantages, "float32"),
        },
    )


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
