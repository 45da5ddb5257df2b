"""The local backend: losses and gradients by hand, sampling, checkpoints, bad input."""

from __future__ import annotations

import copy
import ctypes
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pytrio import AdamParams, Datum, ModelInput, SamplingParams
from pytrio.errors.base import ValidationError

from agent_gym_train.backends import runtime
from agent_gym_train.backends.local import LocalServiceClient, LocalTrainingClient
from agent_gym_train.backends.models import ModelSpecError

# Two sequences with masked (-100) positions, as agent_gym_train.run.episode builds them.
TOKENS = [[5, 17, 29, 41, 53, 65, 77], [9, 21, 33, 45, 57]]
SAMPLED = [[False, False, True, True, False, True], [False, True, True, True]]
ADVANTAGE = [[0.0, 0.0, 1.5, 1.5, 0.0, 1.5], [0.0, -0.5, -0.5, -0.5]]
# Per sampled position, how far the sampler's logprob sits from the learner's: ratios of
# 1/e^-0.5 = 1.65 (A > 0: clipped by ppo), e^-0.4 = 0.67 (A < 0: clipped), 1.0, and so on.
SHIFT = [[0.0, 0.0, -0.5, 0.1, 0.0, 0.0], [0.0, 0.4, -0.3, 0.05]]


@pytest.fixture
def service(tmp_path: Path) -> LocalServiceClient:
    return LocalServiceClient(checkpoint_dir=tmp_path, device="cpu", threads=1)


@pytest.fixture
def full(service: LocalServiceClient) -> LocalTrainingClient:
    return service.create_full_training_client("tiny:3")


def hand_logprobs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """log p(token[i+1] | tokens[:i+1]) for every i, straight from the logits."""
    logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)[range(len(tokens) - 1), tokens[1:]]


def make_datums(model: torch.nn.Module) -> list[Datum]:
    datums = []
    for tokens, sampled, adv, shift in zip(TOKENS, SAMPLED, ADVANTAGE, SHIFT, strict=True):
        with torch.no_grad():
            learner = hand_logprobs(model, tokens).tolist()
        datums.append(
            Datum(
                model_input=ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": [t if s else -100 for t, s in zip(tokens[1:], sampled, strict=True)],
                    "logprobs": [lp + d if s else 0.0 for lp, d, s in zip(learner, shift, sampled, strict=True)],
                    "advantages": adv,
                },
            )
        )
    return datums


def hand_loss(model: torch.nn.Module, datums: list[Datum], loss_fn: str) -> tuple[torch.Tensor, int, int]:
    """Loss mean, counted tokens and clipped tokens, one token at a time."""
    total = torch.zeros((), dtype=torch.float64)
    counted = clipped = 0
    for tokens, datum in zip(TOKENS, datums, strict=True):
        learner = hand_logprobs(model, tokens)
        inputs = datum.loss_fn_inputs
        for i, target in enumerate(inputs["target_tokens"].data):
            if target == -100:
                continue
            counted += 1
            ratio = torch.exp(learner[i] - inputs["logprobs"].data[i])
            advantage = inputs["advantages"].data[i]
            if loss_fn == "importance_sampling":
                total = total - ratio * advantage
            elif loss_fn == "ppo":  # thresholds 0.8 / 1.2
                bounded = torch.clamp(ratio, 0.8, 1.2)
                if bool(bounded * advantage < ratio * advantage):
                    clipped += 1
                    total = total - bounded * advantage
                else:
                    total = total - ratio * advantage
            elif loss_fn == "cispo":  # thresholds 0.9 / 1.5: a constant weight on the logprob
                value = float(ratio.detach())
                weight = min(max(value, 0.9), 1.5)
                clipped += weight != value
                total = total - weight * advantage * learner[i]
            else:  # dro, beta 0.5
                gap = learner[i] - inputs["logprobs"].data[i]
                total = total - (learner[i] * advantage - 0.5 * 0.5 * gap**2)
    return total / counted, counted, clipped


CONFIGS: dict[str, dict[str, object]] = {
    "cispo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.5}, "dro": {"beta": 0.5},
}


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro"])
def test_loss_and_gradients_match_hand_computation(full: LocalTrainingClient, loss_fn: str) -> None:
    reference = copy.deepcopy(full.model).double()
    datums = make_datums(full.model)
    output = full.forward_backward(datums, loss_fn, CONFIGS.get(loss_fn)).result()

    expected, counted, clipped = hand_loss(reference, datums, loss_fn)
    expected.backward()
    expected = expected.detach()
    assert output.metrics["token_count"] == counted == 6
    assert output.metrics["loss_mean"] == pytest.approx(float(expected), rel=1e-5, abs=1e-6)
    assert output.metrics["loss_sum"] == pytest.approx(float(expected) * counted, rel=1e-5, abs=1e-6)
    if loss_fn in ("ppo", "cispo"):
        assert clipped == 2  # the clip really was exercised
    grads = dict(reference.named_parameters())
    compared = 0
    for name, parameter in full.model.named_parameters():
        want = grads[name].grad
        if want is None:
            assert parameter.grad is None or not parameter.grad.any()
            continue
        torch.testing.assert_close(parameter.grad.double(), want, rtol=1e-3, atol=1e-6)
        compared += 1
    assert compared > 5
    for tokens, datum, out in zip(TOKENS, datums, output.loss_fn_outputs, strict=True):
        learner = hand_logprobs(reference, tokens).detach()
        mask = torch.tensor(datum.loss_fn_inputs["target_tokens"].data) != -100
        got = torch.tensor(out["logprobs"].data, dtype=torch.float64)
        torch.testing.assert_close(got[mask], learner[mask], rtol=1e-5, atol=1e-5)
        assert not got[~mask].any()


def test_ppo_clipping_changes_the_gradient(full: LocalTrainingClient) -> None:
    datums = make_datums(full.model)
    full.forward_backward(datums, "ppo").result()
    ppo = [p.grad.clone() for p in full.model.parameters()]
    full.optim_step(AdamParams(learning_rate=0.0)).result()  # clears the gradients
    full.forward_backward(datums, "importance_sampling").result()
    assert any(not torch.allclose(a, p.grad) for a, p in zip(ppo, full.model.parameters(), strict=True))


def test_gradient_does_not_depend_on_microbatching(service: LocalServiceClient) -> None:
    one = service.create_full_training_client("tiny:3")
    datums = make_datums(one.model)
    one.forward_backward(datums, "importance_sampling").result()
    service.microbatch_tokens = 1  # one sequence per forward pass
    split = service.create_full_training_client("tiny:3")
    split.forward_backward(datums, "importance_sampling").result()
    for a, b in zip(one.model.parameters(), split.model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-5)


def test_forward_leaves_gradients_alone_and_matches_forward_backward(full: LocalTrainingClient) -> None:
    datums = make_datums(full.model)
    plain = full.forward(datums, "ppo").result()
    assert all(p.grad is None for p in full.model.parameters())
    both = full.forward_backward(datums, "ppo").result()
    assert plain.metrics == pytest.approx(both.metrics)


def test_cross_entropy_counts_only_weighted_targets(full: LocalTrainingClient) -> None:
    tokens = TOKENS[0]
    datum = Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0, 1.0, 1.0, 0.0, 0.0, 2.0]},
    )
    out = full.forward_backward([datum], "cross_entropy").result()
    with torch.no_grad():
        learner = hand_logprobs(full.model, tokens)
    expected = -(learner[1] + learner[2] + 2 * learner[5]) / 3
    assert out.metrics["token_count"] == 3
    assert out.metrics["loss_mean"] == pytest.approx(float(expected), rel=1e-5)


def test_optim_step_is_adamw_and_clears_gradients(full: LocalTrainingClient) -> None:
    before = [p.detach().clone() for p in full.model.parameters()]
    full.forward_backward(make_datums(full.model), "importance_sampling").result()
    grads = [p.grad.clone() for p in full.model.parameters()]
    step = full.optim_step(AdamParams(learning_rate=1e-3, grad_clip_norm=1e9)).result()
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
    assert step.metrics["grad_norm"] == pytest.approx(norm, rel=1e-4)
    for old, new, grad in zip(before, full.model.parameters(), grads, strict=True):
        assert new.grad is None
        # Adam's first step moves each weight by lr * sign(grad) (eps is negligible).
        moved = (new.detach() - old)[grad.abs() > 1e-6]
        torch.testing.assert_close(moved, -1e-3 * torch.sign(grad[grad.abs() > 1e-6]), atol=2e-6, rtol=0)


def test_lora_trains_only_adapters_and_sampler_is_a_snapshot(service: LocalServiceClient) -> None:
    lora = service.create_lora_training_client("tiny", rank=4, seed=1)
    trainable = [n for n, p in lora.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    prompt = ModelInput.from_ints(TOKENS[0])
    first = lora.save_weights_and_get_sampling_client()
    base = first.compute_logprobs(prompt).result()
    for _ in range(3):
        lora.forward_backward(make_datums(lora.model), "importance_sampling").result()
        lora.optim_step(AdamParams(learning_rate=1e-2)).result()
    assert first.compute_logprobs(prompt).result() == base  # the old sampler did not move
    trained = lora.save_weights_and_get_sampling_client().compute_logprobs(prompt).result()
    assert trained[1:] != pytest.approx(base[1:], abs=1e-4)


needs_cpu_bf16 = pytest.mark.skipif(
    not runtime.native_bf16(torch.device("cpu")), reason="this CPU has no bf16 units")


@needs_cpu_bf16
def test_bfloat16_sampler_merges_the_adapters_into_rounded_weights(tmp_path: Path) -> None:
    """A bfloat16 sampler on trained LoRA weights: one rounded weight per layer, the head
    untied from an embedding left as it was, and logprobs within bf16 rounding of the
    float32 sampler's on the same weights."""
    exact = LocalServiceClient(checkpoint_dir=tmp_path, device="cpu", threads=1)
    lora = exact.create_lora_training_client("tiny", rank=4, seed=1)
    for _ in range(3):
        lora.forward_backward(make_datums(lora.model), "importance_sampling").result()
        lora.optim_step(AdamParams(learning_rate=1e-2)).result()
    prompt = ModelInput.from_ints(TOKENS[0] + TOKENS[1])
    want = lora.save_weights_and_get_sampling_client().compute_logprobs(prompt).result()
    path = lora.save_state("trained").result().path
    rounded = LocalServiceClient(checkpoint_dir=tmp_path, device="cpu", threads=1,
                                 sampler_precision="bfloat16").create_sampling_client("tiny", path)
    names = [name for name, _ in rounded.model.named_parameters()]
    assert names and not any("lora_" in name for name in names)
    assert {p.dtype for p in rounded.model.parameters()} == {torch.bfloat16}
    embedding = rounded.model.get_input_embeddings().weight
    assert rounded.model.get_output_embeddings().weight is not embedding
    base = lora.model.get_base_model().get_input_embeddings().weight
    assert torch.equal(embedding, base.detach().bfloat16())
    got = rounded.compute_logprobs(prompt).result()
    assert got[0] is None and len(got) == len(want)
    assert got[1:] != want[1:]  # rounded, so not the same numbers
    assert got[1:] == pytest.approx(want[1:], abs=0.05)  # bf16 keeps 8 bits of mantissa
    sampled = rounded.sample(ModelInput.from_ints(TOKENS[0]), 3,
                             SamplingParams(max_tokens=5, seed=2)).result()
    for sequence in sampled.sequences:
        scored = rounded.compute_logprobs(ModelInput.from_ints(TOKENS[0] + sequence.tokens))
        # decoding (one position at a time) and scoring (the whole prompt at once) round
        # their bf16 products in another order, so the copy agrees with itself only to
        # within bf16 rounding, never bit for bit
        assert sequence.logprobs == pytest.approx(scored.result()[len(TOKENS[0]):], abs=0.05)
    # the learner itself stays float32
    assert {p.dtype for p in lora.model.parameters()} == {torch.float32}


def test_sampler_precision_is_checked_against_the_hardware(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="not one of float32, bfloat16"):
        runtime.sampler_dtype("float16", cpu)
    assert runtime.sampler_dtype("float32", cpu) == torch.float32
    monkeypatch.setattr(runtime, "_cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    assert not runtime.native_bf16(cpu)
    with pytest.raises(ValueError, match="no native bfloat16 units"):
        LocalServiceClient(device="cpu", threads=1, sampler_precision="bfloat16")
    monkeypatch.setattr(runtime, "_cpu_flags", lambda: frozenset({"avx2", "amx_bf16"}))
    assert runtime.sampler_dtype("bfloat16", cpu) == torch.bfloat16
    assert not runtime.native_bf16(torch.device("mps"))


def test_sampling_logprobs_stop_reasons_and_seed(full: LocalTrainingClient) -> None:
    sampler = full.save_weights_and_get_sampling_client()
    prompt = ModelInput.from_ints(TOKENS[0])
    params = SamplingParams(max_tokens=6, seed=7)
    response = sampler.sample(prompt, num_samples=5, sampling_params=params).result()
    assert len(response.sequences) == 5 and response.input_tokens == len(TOKENS[0])
    again = sampler.sample(prompt, num_samples=5, sampling_params=params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in response.sequences]
    for sequence in response.sequences:
        assert sequence.stop_reason == "length" and len(sequence.tokens) == 6
        scored = sampler.compute_logprobs(ModelInput.from_ints(TOKENS[0] + sequence.tokens)).result()
        assert scored[0] is None
        assert sequence.logprobs == pytest.approx(scored[len(TOKENS[0]) :], abs=1e-4)
    # Same seed and batch: the same draws, cut at the first stop token / stop string.
    stop_at = response.sequences[0].tokens[2]
    stopped = sampler.sample(prompt, 5, params.model_copy(update={"stop": [stop_at]})).result()
    first = stopped.sequences[0]
    assert first.stop_reason == "stop"
    assert first.tokens == response.sequences[0].tokens[: first.tokens.index(stop_at) + 1]
    text = full.tokenizer.decode(response.sequences[0].tokens[:3])
    by_text = sampler.sample(prompt, 5, params.model_copy(update={"stop": text[-1]})).result()
    assert by_text.sequences[0].stop_reason == "stop" and len(by_text.sequences[0].tokens) <= 3


def test_greedy_and_filtered_sampling(full: LocalTrainingClient) -> None:
    sampler = full.save_weights_and_get_sampling_client()
    prompt = ModelInput.from_ints(TOKENS[1])
    greedy = sampler.sample(prompt, 3, SamplingParams(max_tokens=4, temperature=0)).result()
    assert len({tuple(s.tokens) for s in greedy.sequences}) == 1
    top1 = sampler.sample(prompt, 2, SamplingParams(max_tokens=4, top_k=1, seed=1)).result()
    assert top1.sequences[0].tokens == greedy.sequences[0].tokens
    assert all(lp == pytest.approx(0.0, abs=1e-6) for lp in top1.sequences[0].logprobs)
    nucleus = sampler.sample(prompt, 2, SamplingParams(max_tokens=4, top_p=1e-6, seed=1)).result()
    assert nucleus.sequences[0].tokens == greedy.sequences[0].tokens


def test_checkpoint_round_trip_resumes_exactly(service: LocalServiceClient) -> None:
    client = service.create_lora_training_client("tiny", rank=4, seed=2)
    params = AdamParams(learning_rate=5e-3)
    client.forward_backward(make_datums(client.model), "ppo").result()
    client.optim_step(params).result()
    saved = client.save_state("step-1").result()
    assert Path(saved.path, "optimizer.pt").is_file() and saved.size > 0
    with pytest.raises(FileExistsError):
        client.save_state("step-1")
    resumed = service.create_training_client_from_state_with_optimizer(saved.path)
    datums = make_datums(client.model)
    for twin in (client, resumed):
        twin.forward_backward(datums, "ppo").result()
        twin.optim_step(params).result()
    for a, b in zip(client.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    weights_only = service.create_training_client_from_state(saved.path)
    assert weights_only._optimizer is None
    sampler_path = client.save_weights_for_sampler("final").result().path
    prompt = ModelInput.from_ints(TOKENS[0])
    from_path = service.create_sampling_client("tiny", sampler_path).compute_logprobs(prompt).result()
    live = client.save_weights_and_get_sampling_client().compute_logprobs(prompt).result()
    assert from_path[1:] == pytest.approx(live[1:], abs=1e-6)
    other = service.create_lora_training_client("tiny", rank=8)
    with pytest.raises(ValueError, match="lora_rank"):
        other.load_state(saved.path)


def test_bad_input_gets_clear_errors(full: LocalTrainingClient, service: LocalServiceClient) -> None:
    datums = make_datums(full.model)
    with pytest.raises(ValueError, match="not available locally"):
        full.forward_backward(datums, "dpo")
    with pytest.raises(ValueError, match="beta >= 0"):
        full.forward_backward(datums, "dro", {"beta": -1.0})
    with pytest.raises(ValueError, match="cispo needs"):
        full.forward_backward(datums, "cispo", {"clip_high_threshold": 0.5})
    with pytest.raises(ValueError, match="no loss_fn_config keys"):
        full.forward_backward(datums, "importance_sampling", {"clip_low_threshold": 0.5})
    with pytest.raises(ValueError, match="clip_low_threshold"):
        full.forward_backward(datums, "ppo", {"clip_low_threshold": 1.5})
    with pytest.raises(ValueError, match="auto_shift"):
        full.forward_backward(datums, "ppo", auto_shift=True)
    no_advantages = Datum(
        model_input=ModelInput.from_ints([1, 2]),
        loss_fn_inputs={"target_tokens": [2, 3], "logprobs": [0.0, 0.0]},
    )
    with pytest.raises(ValueError, match="advantages is required"):
        full.forward_backward([no_advantages], "importance_sampling")
    out_of_vocab = Datum(
        model_input=ModelInput.from_ints([1, 10**7]),
        loss_fn_inputs={"target_tokens": [2, 3], "logprobs": [0.0, 0.0], "advantages": [0.0, 1.0]},
    )
    with pytest.raises(ValidationError, match="outside the tokenizer vocabulary"):
        full.forward_backward([out_of_vocab], "ppo")
    sampler = full.save_weights_and_get_sampling_client()
    with pytest.raises(ValueError, match="max_tokens"):
        sampler.sample(ModelInput.from_ints([1, 2]), 1, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        sampler.sample(ModelInput.from_ints([]), 1, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="rank"):
        service.create_lora_training_client("tiny", rank=0)
    with pytest.raises(FileNotFoundError, match="not a local checkpoint"):
        service.create_training_client_from_state(str(service.checkpoint_dir))
    with pytest.raises(ModelSpecError, match="no model hub"):
        service.create_sampling_client("Qwen/Qwen3-4B")
    with pytest.raises(ModelSpecError, match="integer"):
        service.create_sampling_client("tiny:x")


def test_embedded_smollm2_answers(service: LocalServiceClient) -> None:
    sampler = service.create_sampling_client("smollm2")
    tokenizer = sampler.get_tokenizer()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, tokenize=False
    )
    tokens = tokenizer.encode(prompt, add_special_tokens=False)
    reply = sampler.sample(
        ModelInput.from_ints(tokens), 1, SamplingParams(max_tokens=12, temperature=0)
    ).result().sequences[0]
    assert "5" in tokenizer.decode(reply.tokens)


def test_device_policy_resolves_and_refuses_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent_gym_train.backends import runtime

    assert runtime.resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert runtime.resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA"):
        runtime.resolve_device("cuda:1")
    with pytest.raises(ValueError, match="MPS"):
        runtime.resolve_device("mps")
    with pytest.raises(ValueError, match="one of"):
        runtime.resolve_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert runtime.resolve_device("auto") == torch.device("cuda")
    with pytest.raises(ValueError, match="only 1 CUDA"):
        runtime.resolve_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert runtime.compute_dtype(torch.device("cuda")) == torch.bfloat16
    assert runtime.compute_dtype(torch.device("cpu")) == torch.float32


def test_thread_policy_leaves_loaded_cores_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent_gym_train.backends import runtime

    monkeypatch.delenv(runtime.THREADS_ENV, raising=False)
    monkeypatch.setattr(runtime, "available_cores", lambda: 8)
    monkeypatch.setattr(os, "getloadavg", lambda: (5.7, 5.0, 4.0))
    assert runtime.default_threads() == 3  # 8 cores, 5 busy
    monkeypatch.setattr(os, "getloadavg", lambda: (12.0, 5.0, 4.0))
    assert runtime.default_threads() == 1
    monkeypatch.setenv(runtime.THREADS_ENV, "4")
    assert runtime.default_threads() == 4
    monkeypatch.setenv(runtime.THREADS_ENV, "lots")
    with pytest.raises(ValueError, match="positive integer"):
        runtime.default_threads()
    before = torch.get_num_threads()
    try:
        assert runtime.apply_threads(1) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="at least 1"):
        runtime.apply_threads(0)


# Run in a fresh interpreter: in this one, earlier tests' freed memory would be reused.
_CHURN = """
import threading, torch
from agent_gym_train.backends.runtime import return_freed_memory
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
kept = []
def churn():  # what a sampler thread does: tensors of odd sizes, most soon freed
    big = torch.ones(8 << 20, dtype=torch.uint8); del big  # lifts glibc's mmap threshold
    blocks = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(300)]
    kept.extend(blocks[::25])  # a few survivors pin the heap they sit in
thread = threading.Thread(target=churn); thread.start(); thread.join()
churned = rss()
return_freed_memory()
print(churned, rss())
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "malloc_trim"), reason="not glibc")
def test_memory_freed_on_another_thread_goes_back_to_the_os() -> None:
    """288 MB freed between survivors stays resident under glibc until it is trimmed."""
    result = subprocess.run([sys.executable, "-c", _CHURN], capture_output=True, text=True,
                            timeout=120, cwd=Path(__file__).parents[2], check=True)
    churned, trimmed = map(int, result.stdout.split())
    assert churned - trimmed >= 200, (churned, trimmed)


def test_cpu_defaults_pass_and_gpu_scale_settings_warn_with_the_cost() -> None:
    from agent_gym_train.backends import runtime

    cpu = torch.device("cpu")
    assert runtime.cpu_step_warning(cpu, runtime.CPU_DEFAULTS) is None
    assert runtime.step_cost(runtime.CPU_DEFAULTS) < runtime.WARN_STEP_SECONDS
    gpu_scale = runtime.StepShape(batch_size=8, group_size=8, max_tokens=512)
    warning = runtime.cpu_step_warning(cpu, gpu_scale)
    assert warning is not None and "min" in warning and "--group-size 4" in warning
    assert runtime.cpu_step_warning(torch.device("cuda"), gpu_scale) is None
    # More threads or a smaller model make a step cheaper.
    assert runtime.step_cost(gpu_scale, threads=4) < runtime.step_cost(gpu_scale)
