"""The sampler policies ``agent-gym eval`` runs (agent_gym_train.policies): token-continuous prompts,
as in training; context limits; seeds."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from agent_gym.eval.config import EvalConfig
from agent_gym.eval.policies import PolicyInput, make_policy
from agent_gym.eval.run import evaluate
from agent_gym_train.backends import make_service
from agent_gym_train.policies import SamplerPolicy

GSM8K = "agent_gym/GSM8K-v0"
OPENING = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Name a colour."},
]
FOLLOW_UPS = ["Name another one.", "And one more."]


class RecordingSampler:
    """The real local sampler, keeping every prompt it is given for the assertions."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.prompts: list[list[int]] = []
        self.completions: list[list[int]] = []

    def get_tokenizer(self) -> Any:
        return self.client.get_tokenizer()

    async def sample_async(self, model_input: Any, num_samples: int, sampling_params: Any) -> Any:
        self.prompts.append(model_input.to_ints())
        response = await self.client.sample_async(
            model_input, num_samples=num_samples, sampling_params=sampling_params
        )
        self.completions.append(list(response.sequences[0].tokens))
        return response


@pytest.fixture(scope="module")
def sampler() -> Any:
    return make_service("local", threads=1).create_sampling_client("smollm2")


def _play(policy: SamplerPolicy) -> list[str]:
    """A greedy three-turn chat, each reply followed by a user turn."""
    messages = [dict(m) for m in OPENING]
    replies = []
    for turn in range(len(FOLLOW_UPS) + 1):
        reply = asyncio.run(policy.act(PolicyInput(list(messages), [], turn)))
        replies.append(reply.text)
        messages.append({"role": "assistant", "content": reply.text})
        if turn < len(FOLLOW_UPS):
            messages.append({"role": "user", "content": FOLLOW_UPS[turn]})
    return replies


def test_turn_prompts_extend_the_previous_prompt_and_reply(sampler: Any) -> None:
    recorder = RecordingSampler(sampler)
    policy = SamplerPolicy("local:smollm2", recorder, max_tokens=12)
    replies = _play(policy)
    prompts, completions = recorder.prompts, recorder.completions
    assert len(prompts) == 3
    for turn in range(2):
        # The sampled tokens are in the next prompt verbatim, right after the prompt.
        sent = prompts[turn] + completions[turn]
        assert len(prompts[turn + 1]) > len(sent)
        assert prompts[turn + 1][: len(sent)] == sent
    # Greedy outputs are what re-rendering the whole transcript every turn gave: for this
    # template and text the continued prompt is token for token the full render.
    messages = [dict(m) for m in OPENING]
    for turn, reply in enumerate(replies):
        assert prompts[turn] == policy.renderer.prompt(messages)
        messages.append({"role": "assistant", "content": reply})
        if turn < len(FOLLOW_UPS):
            messages.append({"role": "user", "content": FOLLOW_UPS[turn]})


def test_a_prompt_past_the_models_context_ends_the_episode(tmp_path: Path) -> None:
    policy = make_policy("local:tiny", max_tokens=8)
    assert policy.context_length == policy.client.context_length  # the model's positions
    config = EvalConfig(GSM8K, "local:tiny", episodes=1, max_tokens=8)
    asyncio.run(evaluate(config, policy, tmp_path / "fits", progress=False))
    first = json.loads((tmp_path / "fits" / "episodes.jsonl").read_text().splitlines()[0])
    # A context one token longer than the opening prompt leaves room for one token: the
    # reply is cut. One token shorter: the episode ends context_length, scored, no error.
    policy.context_length = first["prompt_tokens"] + 1
    summary = asyncio.run(evaluate(config, policy, tmp_path / "cut", progress=False))
    assert summary.end_reasons == {"max_tokens": 1} and summary.mean_tokens == 1
    assert summary.finish_reasons == {"length": 1}
    policy.context_length = first["prompt_tokens"]
    summary = asyncio.run(evaluate(config, policy, tmp_path / "over", progress=False))
    assert summary.errors == 0 and summary.end_reasons == {"context_length": 1}
    record = json.loads((tmp_path / "over" / "episodes.jsonl").read_text().splitlines()[0])
    assert record["turns"] == 0 and record["reward"] == 0.0
    assert "context is" in record["context_error"]


def test_a_checkpoint_is_named_as_init_from_names_it_and_a_bad_one_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``local:MODEL@CHECKPOINT`` takes what ``--init-from`` takes (a training run's
    directory, its checkpoint.json, the backend path), resolved by the same code; an
    unusable one is a ValueError that `agent-gym eval` prints as one line."""
    import torch

    from agent_gym.cli.main import main
    from agent_gym_train.backends.local import LocalServiceClient
    from agent_gym_train.run.files import CHECKPOINT_FILE, Checkpoint

    run = tmp_path / "run"
    training = LocalServiceClient(checkpoint_dir=run / "checkpoints", threads=1) \
        .create_lora_training_client("tiny", rank=2, seed=0)
    for parameter in training.model.parameters():  # weights the base model does not have
        if parameter.requires_grad:
            parameter.data.add_(0.5)
    path = training.save_state("step-000001").result().path
    (run / CHECKPOINT_FILE).write_text(json.dumps(Checkpoint(1, path, {}).to_dict()))

    def weights(spec: str) -> list[torch.Tensor]:
        policy = make_policy(spec, max_tokens=4, threads=1)
        return [p.detach().clone() for p in policy.client.model.parameters()]

    trained = weights(f"local:tiny@{path}")
    for spec in (run, run / CHECKPOINT_FILE):
        assert all(torch.equal(a, b) for a, b in zip(
            trained, weights(f"local:tiny@{spec}"), strict=True)), spec
    assert not all(torch.equal(a, b) for a, b in zip(
        trained, weights("local:tiny"), strict=True))

    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=rf"^--policy local:tiny@{tmp_path / 'empty'}: an empty"):
        make_policy(f"local:tiny@{tmp_path / 'empty'}", threads=1)
    with pytest.raises(ValueError, match="holds weights for 'tiny', not 'smollm2'"):
        make_policy(f"local:smollm2@{run}", threads=1)
    missing = tmp_path / "no-such-run"
    out = tmp_path / "eval"
    assert main(["eval", GSM8K, "--policy", f"local:tiny@{missing}", "--episodes", "1",
                 "--threads", "1", "--quiet", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"agent-gym eval: error: --policy local:tiny@{missing}: {missing} is not a local "
        "checkpoint (no meta.json)"], err


def test_eval_runs_a_bfloat16_local_policy_where_the_cpu_has_bf16_units(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--sampler-precision bfloat16`` reaches the local policy's weights, and a CPU without
    bf16 units refuses it in one line rather than sampling slower than float32."""
    import torch

    from agent_gym.cli.main import main
    from agent_gym_train.backends import runtime

    out = tmp_path / "eval"
    argv = ["eval", GSM8K, "--policy", "local:tiny", "--episodes", "2", "--max-tokens", "4",
            "--threads", "1", "--sampler-precision", "bfloat16", "--quiet", "--out", str(out)]
    if runtime.native_bf16(torch.device("cpu")):
        policy = make_policy("local:tiny", max_tokens=4, threads=1, precision="bfloat16")
        assert {p.dtype for p in policy.client.model.parameters()} == {torch.bfloat16}
        assert main(argv) == 0
        assert json.loads((out / "summary.json").read_text())["episodes"] == 2
    monkeypatch.setattr(runtime, "_cpu_flags", lambda: frozenset({"avx2"}))
    capsys.readouterr()
    assert main([*argv[:-1], str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no native bfloat16 units" in err[0], err
