"""Episodes to Datums: shifting, masking, continuity and length checks."""

from __future__ import annotations

import pytest
from pytrio import Datum

from trainers.episode import DatumError, Episode, Turn, active_tokens, build_datum

# Turn 1: prompt [1 2 3], sampled [4 5]; the env's reply adds [6 7]; turn 2 samples [8 9].
FIRST = Turn([1, 2, 3], [4, 5], [-0.1, -0.2], "stop")
SECOND = Turn([1, 2, 3, 4, 5, 6, 7], [8, 9], [-0.3, -0.4], "stop")


def columns(datum: Datum) -> tuple[list[int], list[int], list[float], list[float]]:
    inputs = datum.loss_fn_inputs
    return (
        datum.model_input.to_ints(),
        inputs["target_tokens"].data,
        inputs["logprobs"].data,
        inputs["advantages"].data,
    )


def test_two_turn_datum_is_shifted_and_masked() -> None:
    tokens, targets, logprobs, advantages = columns(build_datum([FIRST, SECOND], 0.5))
    assert tokens == [1, 2, 3, 4, 5, 6, 7, 8]
    assert targets == [-100, -100, 4, 5, -100, -100, 8, 9]
    assert logprobs == pytest.approx([0, 0, -0.1, -0.2, 0, 0, -0.3, -0.4])
    assert advantages == [0, 0, 0.5, 0.5, 0, 0, 0.5, 0.5]
    for column in (targets, logprobs, advantages):
        assert len(column) == len(tokens)


def test_datum_types_are_pytrio_tensors() -> None:
    datum = build_datum([FIRST], -1.0)
    inputs = datum.loss_fn_inputs
    assert inputs["target_tokens"].dtype == "int64"
    assert inputs["logprobs"].dtype == inputs["advantages"].dtype == "float32"
    assert Datum.model_validate(datum.model_dump()) == datum
    assert active_tokens([datum, build_datum([FIRST, SECOND], 1.0)]) == 2 + 4


def test_macro_step_treats_earlier_turns_as_context() -> None:
    _, targets, _, advantages = columns(build_datum([SECOND], 1.0))
    assert targets == [-100] * 6 + [8, 9]
    assert advantages == [0.0] * 6 + [1.0, 1.0]


def test_broken_continuity_and_bad_lengths_raise() -> None:
    rewritten = Turn([1, 2, 3, 4, 99, 6, 7], [8], [-0.5], "stop")
    with pytest.raises(DatumError, match="not token-continuous"):
        build_datum([FIRST, rewritten], 1.0)
    with pytest.raises(DatumError, match="2 completion tokens but 1 logprobs"):
        Turn([1], [2, 3], [-0.1], "stop")
    with pytest.raises(DatumError, match="non-empty prompt"):
        Turn([], [2], [-0.1], "stop")
    with pytest.raises(DatumError, match="over 5"):
        build_datum([FIRST, SECOND], 1.0, max_length=5)
    with pytest.raises(DatumError, match="at least one turn"):
        build_datum([], 1.0)
    with pytest.raises(DatumError, match="finite"):
        build_datum([FIRST], float("nan"))
    with pytest.raises(DatumError, match="logprobs must be finite"):
        build_datum([Turn([1], [2], [float("-inf")], "stop")], 1.0)


def test_episode_views() -> None:
    episode = Episode("t", [FIRST, SECOND], reward=1.0, end_reason="terminated")
    assert episode.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert episode.sampled_tokens == 4
    assert not SECOND.cut and Turn([1], [2], [-0.1], "length").cut
