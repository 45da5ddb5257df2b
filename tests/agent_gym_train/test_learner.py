"""The learner's position-skipping pass gives the loss and gradients of the full-logits pass."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from pytrio import Datum, ModelInput

from agent_gym_train.backends.local import LocalServiceClient, LocalTrainingClient
from agent_gym_train.backends.losses import token_losses
from agent_gym_train.backends.prefix import MIN_SHARED_PREFIX, shared_prefixes


def datums(seed: int, count: int = 5, masked: float = 0.4) -> list[Datum]:
    """Ragged datums with about ``masked`` of the positions masked (prompt-like runs)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        length = rng.randint(6, 20)
        tokens = [rng.randrange(1, 4000) for _ in range(length + 1)]
        prompt = max(1, round(length * masked))
        targets = [-100 if i < prompt or rng.random() < 0.1 else t
                   for i, t in enumerate(tokens[1:])]
        out.append(Datum(
            model_input=ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": targets,
                "logprobs": [rng.uniform(-9, -7) if t != -100 else 0.0 for t in targets],
                "advantages": [rng.uniform(-1, 1) if t != -100 else 0.0 for t in targets],
            },
        ))
    return out


def full_pass(model: torch.nn.Module, batch: list[Datum], loss_fn: str) -> torch.Tensor:
    """The reference: logits and log-softmax at every position, then the masked mean."""
    total = torch.zeros(())
    count = 0
    for datum in batch:
        ids = torch.tensor([datum.model_input.to_ints()])
        inputs = datum.loss_fn_inputs
        targets = torch.tensor(inputs["target_tokens"].data)
        counted = targets != -100
        logits = model(input_ids=ids).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1).gather(1, targets.clamp(min=0)[:, None])[:, 0]
        logp = torch.where(counted, logp, 0.0)
        tensors = {k: torch.tensor(inputs[k].data, dtype=torch.float32)
                   for k in ("logprobs", "advantages")}
        total = total + token_losses(loss_fn, logp, tensors, counted, {}).sum()
        count += int(counted.sum())
    return total / count


def wake_lora(client: LocalTrainingClient) -> None:
    """LoRA's B matrices start at zero; move them so that every adapter has a gradient."""
    with torch.no_grad():
        for name, parameter in client.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)


def assert_same_gradients(client: LocalTrainingClient, reference: torch.nn.Module) -> None:
    grads = dict(reference.named_parameters())
    for name, parameter in client.model.named_parameters():
        if parameter.requires_grad:
            torch.testing.assert_close(parameter.grad, grads[name].grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("kind", "loss_fn", "chunk"),
    [("lora", "importance_sampling", 3), ("lora", "ppo", 512), ("full", "importance_sampling", 1)],
)
def test_position_skipping_matches_the_full_logits_pass(
    tmp_path: Path, kind: str, loss_fn: str, chunk: int
) -> None:
    service = LocalServiceClient(checkpoint_dir=tmp_path, device="cpu", threads=1,
                                 logit_chunk=chunk)
    client: LocalTrainingClient = (
        service.create_lora_training_client("tiny:2", rank=4, seed=3) if kind == "lora"
        else service.create_full_training_client("tiny:2")
    )
    if kind == "lora":
        wake_lora(client)
    reference = copy.deepcopy(client.model)
    batch = datums(seed=len(kind) + chunk)
    counted = sum(sum(t != -100 for t in d.loss_fn_inputs["target_tokens"].data) for d in batch)
    total = sum(len(d.model_input) for d in batch)
    assert 0.3 < 1 - counted / total < 0.7  # a realistic share of masked positions

    output = client.forward_backward(batch, loss_fn).result()
    expected = full_pass(reference, batch, loss_fn)
    expected.backward()
    assert output.metrics["token_count"] == counted
    assert output.metrics["loss_mean"] == pytest.approx(float(expected.detach()), rel=1e-5, abs=1e-6)
    grads = dict(reference.named_parameters())
    compared = 0
    for name, parameter in client.model.named_parameters():
        if not parameter.requires_grad:
            continue
        torch.testing.assert_close(parameter.grad, grads[name].grad, rtol=1e-4, atol=1e-6)
        compared += 1
    assert compared >= (8 if kind == "lora" else 10)
    if kind == "lora":
        assert any("lm_head" in n for n, p in client.model.named_parameters() if p.requires_grad)


def group_datums(seed: int) -> list[Datum]:
    """A GRPO-like batch: two groups whose branches share their (masked) prompt, a lone datum,
    one whose reply is followed by masked observation tokens, and one with nothing counted."""
    rng = random.Random(seed)
    out = []

    def datum(tokens: list[int], counted_from: int, counted_to: int | None = None) -> Datum:
        end = len(tokens) - 1 if counted_to is None else counted_to
        targets = [t if counted_from <= i < end else -100 for i, t in enumerate(tokens[1:])]
        return Datum(
            model_input=ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": targets,
                "logprobs": [rng.uniform(-9, -7) if t != -100 else 0.0 for t in targets],
                "advantages": [rng.uniform(-1, 1) if t != -100 else 0.0 for t in targets],
            },
        )

    for branches, prompt_length in ((4, 20), (3, 17)):
        prompt = [rng.randrange(1, 4000) for _ in range(prompt_length)]
        for _ in range(branches):
            reply = [rng.randrange(1, 4000) for _ in range(rng.randint(3, 12))]
            out.append(datum(prompt + reply, prompt_length - 1))
    out.append(datum([rng.randrange(1, 4000) for _ in range(15)], 5))
    out.append(datum([rng.randrange(1, 4000) for _ in range(25)], 8, counted_to=14))
    out.append(datum([rng.randrange(1, 4000) for _ in range(9)], 9))  # nothing counted
    rng.shuffle(out)
    return out


def lead(datum: Datum) -> list[int] | None:
    """The datum's tokens before its first counted position (None: nothing counted)."""
    targets = datum.loss_fn_inputs["target_tokens"].data
    first = next((i for i, t in enumerate(targets) if t != -100), None)
    return None if first is None else datum.model_input.to_ints()[:first]


def test_shared_prompts_are_computed_once_with_the_full_pass_gradient(tmp_path: Path) -> None:
    service = LocalServiceClient(checkpoint_dir=tmp_path, device="cpu", threads=1,
                                 logit_chunk=7)
    client = service.create_lora_training_client("tiny:4", rank=4, seed=1)
    wake_lora(client)
    reference = copy.deepcopy(client.model)
    batch = group_datums(seed=0)
    groups = shared_prefixes([lead(d) for d in batch], MIN_SHARED_PREFIX)
    assert sorted((len(rows), prefix) for rows, prefix in groups) == [(3, 0), (3, 16), (4, 19)]

    output = client.forward_backward(batch, "ppo").result()
    expected = full_pass(reference, batch, "ppo")
    expected.backward()
    assert output.metrics["loss_mean"] == pytest.approx(float(expected.detach()), rel=1e-5)
    assert_same_gradients(client, reference)
    for datum, out in zip(batch, output.loss_fn_outputs, strict=True):
        assert len(out["logprobs"].data) == len(datum.model_input)


def test_a_microbatch_with_nothing_counted_is_skipped(tmp_path: Path) -> None:
    service = LocalServiceClient(checkpoint_dir=tmp_path, device="cpu", threads=1,
                                 microbatch_tokens=1)  # one datum per pass
    client = service.create_full_training_client("tiny:2")
    batch = group_datums(seed=1)
    output = client.forward_backward(batch, "importance_sampling").result()
    expected = full_pass(copy.deepcopy(client.model), batch, "importance_sampling")
    assert output.metrics["loss_mean"] == pytest.approx(float(expected.detach()), rel=1e-5)


def reference_logprobs(model: torch.nn.Module, datum: Datum) -> torch.Tensor:
    """The datum's target logprobs from the whole sequence (0 where nothing trains)."""
    targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].data)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([datum.model_input.to_ints()])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1).gather(1, targets.clamp(min=0)[:, None])[:, 0]
    return torch.where(targets != -100, logp, 0.0)


@pytest.mark.parametrize(("recompute", "train_attn"), [(False, True), (True, True), (True, False)])
def test_a_shared_prompt_runs_once_across_microbatches(
    tmp_path: Path, recompute: bool, train_attn: bool
) -> None:
    """With room for about one branch per pass, a group's prompt still runs once, and the
    gradient is still the full pass's (each microbatch adds its share to the prefix): with
    every layer recomputed in the backward pass too, and with frozen attention, where the
    first layer's prompt keys depend on no trained weight."""
    service = LocalServiceClient(checkpoint_dir=tmp_path, device="cpu", threads=1,
                                 microbatch_tokens=30, logit_chunk=5,
                                 activation_checkpointing=recompute)
    client = service.create_lora_training_client("tiny:4", rank=4, seed=2,
                                                 train_attn=train_attn)
    wake_lora(client)
    reference = copy.deepcopy(client.model)
    batch = group_datums(seed=3)
    passes: list[tuple[int, int]] = []  # (new tokens, prompt tokens attended to) per pass

    def record(_module: torch.nn.Module, _args: tuple[()], kwargs: dict[str, Any]) -> None:
        cache = kwargs.get("cache")
        passes.append((kwargs["input_ids"].shape[1], cache.get_seq_length() if cache else 0))

    hook = client._body.register_forward_pre_hook(record, with_kwargs=True)
    output = client.forward_backward(batch, "importance_sampling").result()
    hook.remove()
    assert sorted(n for n, past in passes if n in (16, 19) and not past) == [16, 19]  # once
    assert sum(past == 19 for _, past in passes) >= 2  # the 4 branches took several passes
    expected = full_pass(reference, batch, "importance_sampling")
    expected.backward()
    # Advantages of both signs make the mean loss a small difference (about 2e-4): an
    # absolute tolerance, as float rounding (which MKL varies with memory alignment) is.
    assert output.metrics["loss_mean"] == pytest.approx(float(expected.detach()), rel=1e-5,
                                                        abs=1e-7)
    assert_same_gradients(client, reference)
    for datum, out in zip(batch, output.loss_fn_outputs, strict=True):
        torch.testing.assert_close(torch.tensor(out["logprobs"].data),
                                   reference_logprobs(reference, datum), rtol=1e-4, atol=1e-5)


def saved_bytes(client: LocalTrainingClient, batch: list[Datum]) -> int:
    """Bytes of the tensors autograd keeps for the backward pass of one forward_backward."""
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        client.forward_backward(batch, "importance_sampling").result()
    return total


def test_recomputed_layers_keep_a_fraction_of_the_activations(tmp_path: Path) -> None:
    kept = {}
    for recompute in (False, True):
        service = LocalServiceClient(checkpoint_dir=tmp_path, device="cpu", threads=1,
                                     activation_checkpointing=recompute)
        client = service.create_lora_training_client("tiny:4", rank=4, seed=2)
        kept[recompute] = saved_bytes(client, group_datums(seed=4))
    assert kept[True] < kept[False] / 3
