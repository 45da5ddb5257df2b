"""On-Policy Distillation: per-token advantages by hand, the tokenizer check, the teacher's
privileged context, and a real run that lowers the reverse KL."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gymnasium
import numpy as np
import pytest
import torch

from agent_gym.render import ChatRenderer
from agent_gym_train.backends import IGNORE_TARGET
from agent_gym_train.backends.local import LocalServiceClient
from agent_gym_train.cli import register
from agent_gym_train.opd import (
    PRIVILEGED_HEADER,
    Args,
    LabelState,
    TokenizerMismatchError,
    check_tokenizers,
    distillation_datum,
    label_states,
    parse_args,
    privileged_messages,
    teacher_labels,
    train,
)
from agent_gym_train.run.episode import Span, TokenSequence
from agent_gym_train.sft import Args as SftArgs
from agent_gym_train.sft import train as sft_train
from tests.helpers.chat_templates import smollm2_tokenizer
from tests.helpers.grpo_toy import char_tokenizer, save_tiny_model

GSM8K = Path(__file__).resolve().parents[2] / "agent_gym" / "datasets" / "gsm8k_mini.jsonl"


def inputs(datum: object, key: str) -> list[float]:
    return list(datum.loss_fn_inputs[key].data)  # type: ignore[attr-defined]


def test_single_turn_advantage_is_minus_beta_times_the_logprob_gap() -> None:
    # A prompt 1 2 3, then 4 5 sampled with logprobs -1 and -2.
    sequence = TokenSequence((1, 2, 3, 4, 5), (Span(3, (-1.0, -2.0)),))
    # Teacher logprobs of the sequence 1 2 3 4 5 (position 0 has none, as compute_logprobs).
    teacher = [None, -9.0, -9.0, -0.5, -2.5]
    datum, kl = distillation_datum(sequence, teacher, kl_coef=2.0)
    assert inputs(datum, "target_tokens") == [IGNORE_TARGET, IGNORE_TARGET, 4, 5]
    # token 4: -2 * (-1 - -0.5) = 1; token 5: -2 * (-2 - -2.5) = -1; prompt positions 0
    assert inputs(datum, "advantages") == pytest.approx([0.0, 0.0, 1.0, -1.0])
    assert inputs(datum, "logprobs") == pytest.approx([0.0, 0.0, -1.0, -2.0])
    assert kl.tolist() == pytest.approx([-0.5, 0.5])


def test_multi_turn_advantage_masks_observations_and_follows_the_teacher_offset() -> None:
    # A prompt 1 2, a reply 3 4, the env's observation 5 6 (never sampled), a reply 7.
    sequence = TokenSequence((1, 2, 3, 4, 5, 6, 7),
                             (Span(2, (-1.0, -1.5)), Span(6, (-0.5,))))
    # The teacher's opening (80 81 82 83) is two tokens longer than the student's (1 2):
    # it scores 80 81 82 83 3 4 5 6 7. Its opinion of the observation (-50) must not count.
    teacher = [None, -3.0, -3.0, -3.0, -0.5, -2.5, -50.0, -50.0, -0.25]
    datum, kl = distillation_datum(sequence, teacher, kl_coef=1.0, offset=2,
                                   reward_advantage=0.25)
    assert inputs(datum, "target_tokens") == [IGNORE_TARGET, 3, 4, IGNORE_TARGET,
                                              IGNORE_TARGET, 7]
    assert kl.tolist() == pytest.approx([-0.5, 1.0, -0.25])
    advantages = inputs(datum, "advantages")
    assert advantages == pytest.approx([0.0, 0.75, -0.75, 0.0, 0.0, 0.5])
    masked = np.array(inputs(datum, "target_tokens")) == IGNORE_TARGET
    assert not np.array(advantages)[masked].any()


def test_teacher_labels_are_asked_at_every_state_the_student_replied_at() -> None:
    # The student's opening 1 2, its reply 3 4, an observation 5 6, its reply 7. The
    # teacher's opening is 80 81 82: it sees the student's history after its own opening.
    sequence = TokenSequence((1, 2, 3, 4, 5, 6, 7), (Span(2, (-1.0, -1.5)), Span(6, (-0.5,))))
    states = label_states(sequence, [1, 2], [80, 81, 82])
    assert states == [LabelState((1, 2), (80, 81, 82)),
                      LabelState((1, 2, 3, 4, 5, 6), (80, 81, 82, 3, 4, 5, 6))]


def test_a_teacher_label_is_the_teachers_greedy_reply_on_the_students_context() -> None:
    """The tiny model as teacher: its greedy reply is asked on the teacher's view of the
    state, and becomes a span after the *student's* context; a cut reply is no label."""
    import asyncio

    from pytrio import ModelInput, SamplingParams

    from agent_gym_train.run.episode import cross_entropy_datum

    teacher = LocalServiceClient().create_sampling_client("tiny")
    state = LabelState((5, 6, 7), (9, 10, 11, 12, 13))
    greedy = teacher.sample(ModelInput.from_ints(list(state.teacher)), num_samples=1,
                            sampling_params=SamplingParams(max_tokens=4, temperature=0.0,
                                                           seed=3)).result().sequences[0]
    (finished,) = asyncio.run(teacher_labels(teacher, [state], [0], 4, lambda _: True))
    (cut,) = asyncio.run(teacher_labels(teacher, [state], [0], 4, lambda _: False))
    assert cut is None and finished is not None
    assert finished.tokens == (5, 6, 7, *greedy.tokens)
    (span,) = finished.spans
    # The label's call reuses the first call's cached prompt, so its logprobs come from
    # another kernel path: equal to float32 rounding (1e-6 apart on some CPUs), not bitwise.
    assert span.start == 3 and span.logprobs == pytest.approx(greedy.logprobs, abs=1e-5)
    datum = cross_entropy_datum(finished, 0.5)
    assert inputs(datum, "weights") == [0.0, 0.0, *[0.5] * len(greedy.tokens)]


def test_a_missing_teacher_logprob_is_refused() -> None:
    with pytest.raises(ValueError, match="no logprob at position 0"):
        distillation_datum(TokenSequence((1, 2), (Span(1, (-1.0,)),)), [None, None], 1.0,
                           offset=-1)


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


def test_opd_samples_one_version_behind_with_max_staleness(tmp_path: Path) -> None:
    """With --max-staleness 1 the student samples step t+1 (and the teacher scores it)
    while step t trains: every step after the first trains data one update old."""
    args = Args(model="tiny", lora_rank=0, steps=3, batch_size=2, group_size=2, max_tokens=6,
                teacher_labels=0.5, max_staleness=1, out=str(tmp_path / "run"),
                progress=False)
    rows = train(args)
    assert [row["sampler_version"] for row in rows] == [0, 0, 1]
    assert [row["staleness"] for row in rows] == [0, 1, 1]
    for row in rows:
        assert row["episodes"] == 4 and row["trained_tokens"] == row["sampled_tokens"] > 0
        assert np.isfinite([row["reverse_kl_mean"], row["grad_norm"]]).all()


def test_teacher_labels_train_in_the_same_step_as_the_distillation(tmp_path: Path) -> None:
    """With --teacher-labels the teacher answers at each of the student's replies; a
    cut answer (the tiny model never stops in 6 tokens) is counted and not trained."""
    args = Args(model="tiny", lora_rank=0, steps=1, batch_size=2, group_size=2, max_tokens=6,
                teacher_labels=0.5, out=str(tmp_path / "run"), progress=False)
    (row,) = train(args)
    assert row["teacher_labels"] == row["episodes"] * row["turns_mean"] > 0
    assert row["teacher_labels_cut"] == row["teacher_labels"] - row.get("supervised_datums", 0)
    assert "time_labels" in row and np.isfinite(row["grad_norm"])


# ----------------------------------------------------------------------- a real run
@pytest.fixture(scope="module")
def format_teacher(tmp_path_factory: pytest.TempPathFactory) -> str:
    """SmolLM2 after two SFT updates on GSM8K-v0 oracle replies ("The answer is \\boxed{N}."):
    a teacher whose replies begin unlike the base model's ("To find ...")."""
    folder = tmp_path_factory.mktemp("teacher")
    data = folder / "train.jsonl"
    data.write_text("".join(GSM8K.read_text().splitlines(keepends=True)[:4]))
    sft_train(SftArgs(env_id="agent_gym/GSM8K-v0", env_kwargs={"data_path": str(data)},
                      epochs=2, batch_size=4, learning_rate=2e-3, lora_rank=8,
                      out=str(folder / "run"), progress=False))
    return json.loads((folder / "run" / "checkpoint.json").read_text())["path"]


def first_token_reverse_kl(student: object, teacher: object, prompts: list[list[int]]) -> float:
    """Exact KL(student || teacher) of the first reply token, summed over the vocabulary
    (no sampling noise), averaged over prompts."""
    values = []
    for prompt in prompts:
        with torch.no_grad():
            s, t = (torch.log_softmax(m.model(input_ids=torch.tensor([prompt])).logits[0, -1]
                                      .double(), -1)
                    for m in (student, teacher))  # type: ignore[attr-defined]
        values.append(float((s.exp() * (s - t)).sum()))
    return float(np.mean(values))


def test_opd_lowers_the_reverse_kl_to_its_teacher(tmp_path: Path, format_teacher: str) -> None:
    """The embedded model as student, on GSM8K-v0 tasks the teacher never saw: three OPD
    updates (8 episodes of 3 tokens each) cut the exact first-token reverse KL to the
    teacher, measured on four further held-out tasks, by more than half (measured here:
    1.99 -> 0.39; two updates only reached 0.99, too close to the line)."""
    data = tmp_path / "tasks.jsonl"
    lines = GSM8K.read_text().splitlines(keepends=True)
    data.write_text("".join(lines[10:18]))
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(lines[40:44]))
    service = LocalServiceClient(checkpoint_dir=tmp_path / "checkpoints")
    teacher = service.create_sampling_client("smollm2", format_teacher)
    renderer = ChatRenderer(teacher.get_tokenizer())
    env = gymnasium.make("agent_gym/GSM8K-v0", data_path=str(heldout))
    prompts = [renderer.prompt(env.reset(options={"index": i})[1]["messages"]) for i in range(4)]
    env.close()
    before = first_token_reverse_kl(service.create_sampling_client("smollm2"), teacher, prompts)

    rows = train(Args(teacher=f"local:smollm2@{format_teacher}", privileged=False,
                      env_kwargs={"data_path": str(data)}, steps=3, batch_size=2,
                      group_size=4, max_tokens=3, learning_rate=5e-3, lora_rank=8,
                      out=str(tmp_path / "run"), progress=False))
    assert all(row["reverse_kl_mean"] > 0.2 for row in rows)  # the teacher disagrees
    student = json.loads((tmp_path / "run" / "checkpoint.json").read_text())["path"]
    after = first_token_reverse_kl(service.create_sampling_client("smollm2", student), teacher,
                                   prompts)
    assert before > 0.5 and after < 0.5 * before, (before, after)


def test_cli_reports_an_incompatible_teacher_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    teacher = save_tiny_model(tmp_path / "char-teacher")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    command = parser.parse_args(["train", "opd", "--model", "tiny", "--lora-rank", "0",
                                 "--teacher", f"local:{teacher}", "--no-privileged",
                                 "--steps", "1", "--out", str(tmp_path / "run"),
                                 "--no-progress"])
    assert command.run(command) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("agent-gym train opd: error: the teacher's tokenizer differs")


def test_a_teacher_checkpoint_is_named_as_init_from_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--teacher local:MODEL@CHECKPOINT`` takes a run directory as ``--init-from`` does; an
    empty one is refused in one line naming the teacher."""
    (tmp_path / "empty").mkdir()
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    command = parser.parse_args(["train", "opd", "--model", "tiny", "--lora-rank", "0",
                                 "--teacher", f"local:tiny@{tmp_path / 'empty'}",
                                 "--no-privileged", "--steps", "1",
                                 "--out", str(tmp_path / "run"), "--no-progress"])
    assert command.run(command) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"agent-gym train opd: error: --teacher local:tiny@{tmp_path / 'empty'}: an empty "
        "directory, not a run or checkpoint")
