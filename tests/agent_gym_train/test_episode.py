"""Token sequences to Datums: shifting, masking, continuity, prefixes and length checks."""

from __future__ import annotations

import math

import pytest
from pytrio import Datum

from agent_gym_train.run.episode import (
    DatumError,
    Episode,
    Span,
    TokenSequence,
    active_tokens,
    build_datum,
)

# Turn 1: prompt [1 2 3], sampled [4 5]; the env's reply adds [6 7]; turn 2 samples [8 9].
OPENING = TokenSequence((1, 2, 3))
FIRST = OPENING.extend([1, 2, 3], [4, 5], [-0.1, -0.2])
BOTH = FIRST.extend([1, 2, 3, 4, 5, 6, 7], [8, 9], [-0.3, -0.4])


def columns(datum: Datum) -> tuple[list[int], list[int], list[float], list[float]]:
    inputs = datum.loss_fn_inputs
    return (
        datum.model_input.to_ints(),
        inputs["target_tokens"].data,
        inputs["logprobs"].data,
        inputs["advantages"].data,
    )


def test_extending_records_the_sampled_spans() -> None:
    assert BOTH.tokens == (1, 2, 3, 4, 5, 6, 7, 8, 9)
    assert BOTH.spans == (Span(3, (-0.1, -0.2)), Span(7, (-0.3, -0.4)))
    assert [span.end for span in BOTH.spans] == [5, 9]
    assert BOTH.completion(1) == (8, 9) and BOTH.sampled_tokens == 4
    assert BOTH.logprob_sum == pytest.approx(-1.0)


def test_two_turn_datum_is_shifted_and_masked() -> None:
    tokens, targets, logprobs, advantages = columns(build_datum(BOTH, 0.5))
    assert tokens == [1, 2, 3, 4, 5, 6, 7, 8]
    assert targets == [-100, -100, 4, 5, -100, -100, 8, 9]
    assert logprobs == pytest.approx([0, 0, -0.1, -0.2, 0, 0, -0.3, -0.4])
    assert advantages == [0, 0, 0.5, 0.5, 0, 0, 0.5, 0.5]
    for column in (targets, logprobs, advantages):
        assert len(column) == len(tokens)


def test_datum_types_are_pytrio_tensors() -> None:
    datum = build_datum(FIRST, -1.0)
    inputs = datum.loss_fn_inputs
    assert inputs["target_tokens"].dtype == "int64"
    assert inputs["logprobs"].dtype == inputs["advantages"].dtype == "float32"
    assert Datum.model_validate(datum.model_dump()) == datum
    assert active_tokens([datum, build_datum(BOTH, 1.0)]) == 2 + 4


def test_a_resumed_prefix_is_context_only() -> None:
    resumed = BOTH.prefix(7).as_context().extend([1, 2, 3, 4, 5, 6, 7], [8, 9], [-0.3, -0.4])
    _, targets, _, advantages = columns(build_datum(resumed, 1.0))
    assert targets == [-100] * 6 + [8, 9]
    assert advantages == [0.0] * 6 + [1.0, 1.0]


def test_prefixes_keep_the_spans_inside_them() -> None:
    assert BOTH.prefix(7) == TokenSequence((1, 2, 3, 4, 5, 6, 7), (Span(3, (-0.1, -0.2)),))
    assert BOTH.prefix(3).spans == ()
    assert BOTH.grown_to([*BOTH.tokens, 10, 11]).spans == BOTH.spans
    with pytest.raises(DatumError, match="split a sampled span"):
        BOTH.prefix(4)
    with pytest.raises(DatumError, match="no prefix of 10"):
        BOTH.prefix(10)


def test_scoring_the_sampled_tokens_under_other_logprobs() -> None:
    logprobs = [None, -9.0, -9.0, -1.0, -2.0, -9.0, -9.0, -3.0, -4.0]
    assert BOTH.score(logprobs) == -10.0
    with pytest.raises(DatumError, match="9 tokens"):
        BOTH.score(logprobs[:-1])
    with pytest.raises(DatumError, match="no logprob"):
        BOTH.score([*logprobs[:3], None, *logprobs[4:]])


def test_broken_continuity_and_bad_lengths_raise() -> None:
    with pytest.raises(DatumError, match="not token-continuous"):
        FIRST.extend([1, 2, 3, 4, 99, 6, 7], [8], [-0.5])
    with pytest.raises(DatumError, match="2 tokens but 1 logprobs"):
        OPENING.extend([1, 2, 3], [4, 5], [-0.1])
    with pytest.raises(DatumError, match="over 5"):
        build_datum(BOTH, 1.0, max_length=5)
    with pytest.raises(DatumError, match="at least one sampled span"):
        build_datum(OPENING, 1.0)
    with pytest.raises(DatumError, match="finite"):
        build_datum(FIRST, float("nan"))
    with pytest.raises(DatumError, match="logprobs must be finite"):
        OPENING.extend([1, 2, 3], [4], [-math.inf])
    with pytest.raises(DatumError, match="out of order"):
        TokenSequence((1, 2, 3), (Span(2, (-0.1, -0.1)),))


def test_sequences_round_trip_through_json_values() -> None:
    assert TokenSequence.from_dict(BOTH.to_dict()) == BOTH
    with pytest.raises(DatumError, match="spans must be"):
        TokenSequence.from_dict({"tokens": [1, 2], "spans": [[1, 2]]})
    with pytest.raises(DatumError, match="tokens must be"):
        TokenSequence.from_dict({"tokens": [1, "2"], "spans": []})


def test_episode_views() -> None:
    episode = Episode("t", BOTH, reward=1.0, end_reason="terminated")
    assert episode.turns == 2 and episode.sampled_tokens == 4
