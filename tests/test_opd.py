"""On-Policy Distillation: per-token advantages by hand, the tokenizer check, the teacher's
privileged context, and a real run that lowers the reverse KL."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.chat_templates import smollm2_tokenizer
from tests.grpo_toy import char_tokenizer, save_tiny_model
from trainers.episode import IGNORE_TARGET, Turn
from trainers.opd import (
    PRIVILEGED_HEADER,
    Args,
    TokenizerMismatchError,
    check_tokenizers,
    distillation_datum,
    parse_args,
    privileged_messages,
    train,
)


def inputs(datum: object, key: str) -> list[float]:
    return list(datum.loss_fn_inputs[key].data)  # type: ignore[attr-defined]


def test_single_turn_advantage_is_minus_beta_times_the_logprob_gap() -> None:
    turn = Turn([1, 2, 3], [4, 5], [-1.0, -2.0], "stop")
    # Teacher logprobs of the sequence 1 2 3 4 5 (position 0 has none, as compute_logprobs).
    teacher = [None, -9.0, -9.0, -0.5, -2.5]
    datum, kl = distillation_datum([turn], teacher, kl_coef=2.0)
    assert inputs(datum, "target_tokens") == [IGNORE_TARGET, IGNORE_TARGET, 4, 5]
    # token 4: -2 * (-1 - -0.5) = 1; token 5: -2 * (-2 - -2.5) = -1; prompt positions 0
    assert inputs(datum, "advantages") == pytest.approx([0.0, 0.0, 1.0, -1.0])
    assert inputs(datum, "logprobs") == pytest.approx([0.0, 0.0, -1.0, -2.0])
    assert kl.tolist() == pytest.approx([-0.5, 0.5])


def test_multi_turn_advantage_masks_observations_and_follows_the_teacher_offset() -> None:
    first = Turn([1, 2], [3, 4], [-1.0, -1.5], "stop")
    # 5 6 is the env's observation: in the sequence, never sampled.
    second = Turn([1, 2, 3, 4, 5, 6], [7], [-0.5], "stop")
    # The teacher's opening (80 81 82 83) is two tokens longer than the student's (1 2):
    # it scores 80 81 82 83 3 4 5 6 7. Its opinion of the observation (-50) must not count.
    teacher = [None, -3.0, -3.0, -3.0, -0.5, -2.5, -50.0, -50.0, -0.25]
    datum, kl = distillation_datum([first, second], teacher, kl_coef=1.0, offset=2,
                                   reward_advantage=0.25)
    assert inputs(datum, "target_tokens") == [IGNORE_TARGET, 3, 4, IGNORE_TARGET,
                                              IGNORE_TARGET, 7]
    assert kl.tolist() == pytest.approx([-0.5, 1.0, -0.25])
    advantages = inputs(datum, "advantages")
    assert advantages == pytest.approx([0.0, 0.75, -0.75, 0.0, 0.0, 0.5])
    masked = np.array(inputs(datum, "target_tokens")) == IGNORE_TARGET
    assert not np.array(advantages)[masked].any()


def test_a_missing_teacher_logprob_is_refused() -> None:
    with pytest.raises(ValueError, match="no logprob at position 0"):
        distillation_datum([Turn([1], [2], [-1.0], "stop")], [None, None], 1.0, offset=-1)


def test_tokenizer_check_refuses_a_different_vocabulary() -> None:
    student = smollm2_tokenizer()
    check_tokenizers(student, smollm2_tokenizer())  # the same vocabulary passes
    with pytest.raises(TokenizerMismatchError, match="share one vocabulary") as caught:
        check_tokenizers(student, char_tokenizer())
    assert "ids differ" in str(caught.value)


def test_training_refuses_an_incompatible_teacher_before_any_rollout(tmp_path: Path) -> None:
    teacher = save_tiny_model(tmp_path / "char-teacher")  # a character-level tokenizer
    args = Args(model="tiny", lora_rank=0, teacher=f"local:{teacher}", privileged=False,
                steps=1, out=str(tmp_path / "run"), progress=False)
    with pytest.raises(TokenizerMismatchError):
        train(args)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_privileged_information_goes_to_the_teachers_system_prompt() -> None:
    chat = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "2+2?"}]
    secret = {"reference_answer": "4", "oracle_actions": ["The answer is \\boxed{4}."]}
    teacher = privileged_messages(chat, secret)
    assert teacher[1] == chat[1] and chat[0]["content"] == "Solve it."  # input untouched
    assert teacher[0]["content"].startswith("Solve it.\n\n" + PRIVILEGED_HEADER)
    assert "- reference_answer: 4" in teacher[0]["content"]
    assert "- oracle_actions: The answer is \\boxed{4}." in teacher[0]["content"]
    bare = privileged_messages(chat[1:], secret)
    assert bare[0]["role"] == "system" and bare[1] == chat[1]


def test_self_teacher_without_privileged_info_is_refused() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--teacher", "self", "--no-privileged"])


def test_privileged_self_distillation_step_on_a_real_env(tmp_path: Path) -> None:
    """Plumbing on GSM8K-v0 with the tiny model: the teacher (the frozen start, with the
    reference answer in its context) scores every sampled token of every episode."""
    args = Args(model="tiny", lora_rank=0, steps=2, batch_size=2, group_size=2, max_tokens=6,
                out=str(tmp_path / "run"), progress=False)
    rows = train(args)
    assert [row["step"] for row in rows] == [0, 1]
    for row in rows:
        assert row["episodes"] == 4 and row["trained_tokens"] == row["sampled_tokens"] > 0
        assert np.isfinite([row["reverse_kl_mean"], row["teacher_logprob_mean"]]).all()
        assert row["reverse_kl_mean"] != 0.0  # the privileged context changes the teacher
    saved = json.loads((tmp_path / "run" / "checkpoint.json").read_text())
    assert saved["step"] == 2
