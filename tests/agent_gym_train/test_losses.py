"""The client-side objectives (agent_gym_train.run.losses) by hand, and forward_backward_custom locally."""

from __future__ import annotations

import asyncio
import copy
from math import exp
from pathlib import Path

import pytest
import torch
from pytrio import Datum, ModelInput
from pytrio.errors.base import ValidationError

from agent_gym_train.backends.local import LocalServiceClient, LocalTrainingClient
from agent_gym_train.run.losses import Objective, policy_loss, problems
from tests.agent_gym_train.test_local_backend import TOKENS, hand_logprobs, make_datums

# Two hand-made sequences: the first trains its last 2 positions, the second all 3.
# p is the learner's logprob, q the sampler's; ratios r = exp(p - q):
#   sequence 1: r = e^0.3 = 1.350 (A = +1), e^-0.3 = 0.741 (A = +1)
#   sequence 2: r = 1, e^-0.4 = 0.670, 1 (A = -2 on every token)
TARGETS = [[-100, 7, 8], [5, 6, 9]]
Q = [[0.0, -1.0, -2.0], [-0.5, -0.5, -1.0]]
P = [[0.0, -0.7, -2.3], [-0.5, -0.9, -1.0]]
A = [[0.0, 1.0, 1.0], [-2.0, -2.0, -2.0]]
R1, R2, R4 = exp(0.3), exp(-0.3), exp(-0.4)
S2 = exp(-0.4 / 3)  # gspo: sequence 2's geometric-mean ratio (sequence 1's is e^0 = 1)
PPO = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


def datums() -> list[Datum]:
    return [
        Datum(model_input=ModelInput.from_ints([1] * len(t)),
              loss_fn_inputs={"target_tokens": t, "logprobs": q, "advantages": a})
        for t, q, a in zip(TARGETS, Q, A, strict=True)
    ]


# (loss, aggregation, thresholds, expected objective, expected dJ/dp, clip fraction),
# each worked out token by token in the comments.
CASES = [
    # terms -r*A: -1.350, -0.741 | 2, 2*0.670, 2; dJ/dp = -r*A / 5 tokens
    ("importance_sampling", "token-mean", {},
     (-R1 - R2 + 2 + 2 * R4 + 2) / 5,
     [[0, -R1 / 5, -R2 / 5], [2 / 5, 2 * R4 / 5, 2 / 5]], 0.0),
    # the same terms, each sequence's mean (/2, /3), then the mean of the two (/2)
    ("importance_sampling", "sequence-mean", {},
     ((-R1 - R2) / 2 + (2 + 2 * R4 + 2) / 3) / 2,
     [[0, -R1 / 4, -R2 / 4], [2 / 6, 2 * R4 / 6, 2 / 6]], 0.0),
    # ppo: r = 1.350 > 1.2 with A > 0 and r = 0.670 < 0.8 with A < 0 take the clipped
    # (constant) term, -1.2 and 1.6, and no gradient; the other three are as above
    ("ppo", "token-mean", PPO,
     (-1.2 - R2 + 2 + 1.6 + 2) / 5,
     [[0, 0, -R2 / 5], [2 / 5, 0, 2 / 5]], 2 / 5),
    ("ppo", "sequence-mean", PPO,
     ((-1.2 - R2) / 2 + (2 + 1.6 + 2) / 3) / 2,
     [[0, 0, -R2 / 4], [2 / 6, 0, 2 / 6]], 2 / 5),
    # cispo with ppo's bounds: terms -clip(r)*A*p; whatever A's sign, 1.350 is clipped to
    # 1.2 and 0.741, 0.670 to 0.8, and the clipped weight still multiplies the gradient:
    # dJ/dp = -clip(r)*A / 5
    ("cispo", "token-mean", PPO,
     (-1.2 * -0.7 - 0.8 * -2.3 + 2 * -0.5 + 0.8 * 2 * -0.9 + 2 * -1.0) / 5,
     [[0, -1.2 / 5, -0.8 / 5], [2 / 5, 1.6 / 5, 2 / 5]], 3 / 5),
    # cispo's default bounds 0 and 4 clip nothing
    ("cispo", "token-mean", {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
     (-R1 * -0.7 - R2 * -2.3 + 2 * -0.5 + R4 * 2 * -0.9 + 2 * -1.0) / 5,
     [[0, -R1 / 5, -R2 / 5], [2 / 5, 2 * R4 / 5, 2 / 5]], 0.0),
    # gspo, GSPO's bounds: sequence 1's ratio is 1 (terms -1, gradient -s*A = -1 per token);
    # sequence 2's 0.875 < 1 - 3e-4 with A < 0: clipped, term 2 * 0.9997, no gradient
    ("gspo", "token-mean", {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},
     (-1 - 1 + 3 * 2 * (1 - 3e-4)) / 5,
     [[0, -1 / 5, -1 / 5], [0, 0, 0]], 3 / 5),
    ("gspo", "sequence-mean",
     {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},
     (-2 / 2 + 3 * 2 * (1 - 3e-4) / 3) / 2,
     [[0, -1 / 4, -1 / 4], [0, 0, 0]], 3 / 5),
    # gspo, ppo's bounds: nothing clipped; every token of sequence 2 carries the sequence's
    # ratio: term -s2*A = 2*s2 and gradient -s2*A / 5 on each of its tokens
    ("gspo", "token-mean", PPO,
     (-1 - 1 + 3 * 2 * S2) / 5,
     [[0, -1 / 5, -1 / 5], [2 * S2 / 5] * 3], 0.0),
]


@pytest.mark.parametrize(("loss", "aggregation", "bounds", "objective", "grads", "clipped"),
                         CASES)
def test_policy_loss_matches_hand_computation(
    loss: str, aggregation: str, bounds: dict[str, float], objective: float,
    grads: list[list[float]], clipped: float,
) -> None:
    logprobs = [torch.tensor(p, requires_grad=True) for p in P]
    config = {"loss": loss, "aggregation": aggregation, **bounds}
    scaled, metrics = policy_loss(datums(), logprobs, config)
    assert metrics["loss_mean"] == pytest.approx(objective, rel=1e-5)
    assert metrics["token_count"] == 5
    assert metrics["clip_fraction"] == pytest.approx(clipped)
    scaled.backward()
    # pytrio divides the weighted pass by the positions whose gradient is nonzero; the loss
    # returned is the objective times that count, so what trains is exactly dJ/dp.
    weighted = sum(int(p.grad.count_nonzero()) for p in logprobs)
    assert float(scaled.detach()) == pytest.approx(objective * weighted, rel=1e-5)
    for p, want in zip(logprobs, grads, strict=True):
        torch.testing.assert_close(p.grad / weighted, torch.tensor(want, dtype=torch.float32),
                                   rtol=1e-5, atol=1e-7)


@pytest.fixture
def service(tmp_path: Path) -> LocalServiceClient:
    return LocalServiceClient(checkpoint_dir=tmp_path, device="cpu", threads=1)


@pytest.mark.parametrize("loss", ["importance_sampling", "ppo", "cispo"])
def test_custom_token_mean_gives_the_built_in_update(service: LocalServiceClient, loss: str) -> None:
    """The scale correction holds through the model: the same loss as a custom loss (ppo
    clips 2 of 6 tokens here, so the weighted pass counts 4) trains exactly as the built-in."""
    built_in, custom = (service.create_full_training_client("tiny:3") for _ in range(2))
    batch = make_datums(built_in.model)
    objective = Objective(loss, clip_low=0.2, clip_high=0.2)
    want = built_in.forward_backward(batch, loss, objective.thresholds()).result().metrics
    config = {"loss": loss, "aggregation": "token-mean", **(objective.thresholds() or {})}
    got = custom.forward_backward_custom(batch, policy_loss, config).result().metrics
    assert got["loss_mean"] == pytest.approx(want["loss_mean"], rel=1e-5)
    assert got["token_count"] == want["token_count"] == 6
    for a, b in zip(built_in.model.parameters(), custom.model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-7)


def test_forward_backward_custom_has_pytrio_surface(service: LocalServiceClient) -> None:
    """tinker's documented example, sum of squared logprobs, checked against the model by
    hand: the loss sees per-datum target logprobs (0 at masked positions) as leaves; the
    update is its gradient over the positions it weights; its metrics join the pass's."""
    full: LocalTrainingClient = service.create_full_training_client("tiny:3")
    reference = copy.deepcopy(full.model).double()
    batch = make_datums(full.model)
    seen: list[list[float]] = []

    def squared(data: list[Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        assert all(p.requires_grad and p.is_leaf for p in logprobs)
        seen.extend(p.detach().tolist() for p in logprobs)
        loss = sum((p**2).sum() for p in logprobs)
        return loss, {"squared": float(loss.detach())}

    out = full.forward_backward_custom(batch, squared).result()
    expected = torch.zeros((), dtype=torch.float64)
    for tokens, datum, got in zip(TOKENS, batch, seen, strict=True):
        learner = hand_logprobs(reference, tokens)
        mask = torch.tensor(datum.loss_fn_inputs["target_tokens"].data) != -100
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                                   torch.where(mask, learner, 0.0).detach(), rtol=1e-4,
                                   atol=1e-5)
        expected = expected + (learner[mask] ** 2).sum()
    assert out.metrics["squared"] == pytest.approx(float(expected.detach()), rel=1e-4)
    assert out.metrics["token_count"] == 6  # the weighted pass: 6 trained positions
    (expected / 6).backward()
    grads = dict(reference.named_parameters())
    for name, parameter in full.model.named_parameters():
        if grads[name].grad is not None:
            torch.testing.assert_close(parameter.grad.double(), grads[name].grad,
                                       rtol=1e-3, atol=1e-6)

    # A three-argument loss gets loss_fn_config (pytrio's own dispatch); async works too.
    configs: list[dict] = []

    def with_config(data: list[Datum], logprobs: list[torch.Tensor], config: dict
                    ) -> tuple[torch.Tensor, dict]:
        configs.append(config)
        return sum(p.sum() for p in logprobs), {}

    asyncio.run(full.forward_backward_custom_async(batch, with_config, {"k": 1}))
    assert configs == [{"k": 1}]


def test_forward_backward_custom_refuses_bad_losses(service: LocalServiceClient) -> None:
    full = service.create_full_training_client("tiny:3")
    batch = make_datums(full.model)
    with pytest.raises(ValidationError, match="cannot be empty"):
        full.forward_backward_custom([], lambda d, p: (torch.zeros(()), {}))
    with pytest.raises(ValidationError, match="no gradients"):
        full.forward_backward_custom(batch, lambda d, p: (p[0].sum(), {}))
    with pytest.raises(TypeError, match="scalar"):
        full.forward_backward_custom(batch, lambda d, p: (torch.cat(p), {}))
    with pytest.raises(ValueError, match="computes"):
        policy_loss(batch, [torch.zeros(6, requires_grad=True)] * 2,
                    {"loss": "dpo", "aggregation": "token-mean"})


def test_loss_option_problems() -> None:
    assert problems("ppo", "token-mean", 0.2, 0.28) == []
    assert problems("gspo", "sequence-mean", None, None) == []
    assert problems("importance_sampling", "token-mean", 0.2, None)  # clips nothing
    assert problems("cross_entropy", "sequence-mean", None, None)
    assert problems("ppo", "mean", None, None)
    assert problems("ppo", "token-mean", 1.5, None)
    assert problems("ppo", "token-mean", None, -0.1)
    assert Objective("ppo", clip_high=0.28).thresholds() == {
        "clip_low_threshold": 0.8, "clip_high_threshold": 1.28}
    assert Objective("cispo").thresholds() == {"clip_low_threshold": 0.0,
                                               "clip_high_threshold": 4.0}
    assert Objective("importance_sampling").thresholds() is None
    logprobs = [torch.tensor(p, requires_grad=True) for p in P]  # gspo's bounds by default
    assert policy_loss(datums(), logprobs, {"loss": "gspo", "aggregation": "token-mean"}
                       )[1]["clip_fraction"] == pytest.approx(3 / 5)
    assert Objective("ppo").built_in and not Objective("gspo").built_in
    assert not Objective("ppo", "sequence-mean").built_in


def test_stale_data_trains_importance_sampling_truncated() -> None:
    """Truncated importance sampling: below the bound every token's gradient is
    importance_sampling's own (-r*A); above it the weight stops at the bound, and the
    token still trains (a plain clip would silence it)."""
    objective = Objective("importance_sampling").truncated(1.2)
    assert (objective.loss, objective.built_in) == ("cispo", True)
    assert objective.thresholds() == {"clip_low_threshold": 0.0, "clip_high_threshold": 1.2}
    # ppo, cispo and gspo bound the ratio themselves: nothing changes for them
    assert Objective("ppo").truncated(1.2) == Objective("ppo")
    logprobs = [torch.tensor(p, requires_grad=True) for p in P]
    config = {"loss": objective.loss, "aggregation": "token-mean", **objective.thresholds()}
    scaled, metrics = policy_loss(datums(), logprobs, config)
    scaled.backward()
    weighted = sum(int(p.grad.count_nonzero()) for p in logprobs)
    # sequence 1's first ratio, e^0.3 = 1.35, is cut to 1.2; the others are below it
    want = [[0, -1.2 / 5, -R2 / 5], [2 / 5, 2 * R4 / 5, 2 / 5]]
    for p, expected in zip(logprobs, want, strict=True):
        torch.testing.assert_close(p.grad / weighted, torch.tensor(expected), rtol=1e-5,
                                   atol=1e-7)
    assert metrics["clip_fraction"] == pytest.approx(1 / 5)
    with pytest.raises(ValueError, match="at least 1"):
        Objective("importance_sampling").truncated(0.5)


def test_truncation_above_every_ratio_trains_as_importance_sampling(
    service: LocalServiceClient,
) -> None:
    """Through the model: with a bound no ratio reaches, the truncated loss's update is
    importance_sampling's (same gradient, computed by another formula)."""
    plain, truncated = (service.create_full_training_client("tiny:3") for _ in range(2))
    batch = make_datums(plain.model)
    Objective("importance_sampling").forward_backward(plain, batch).result()
    Objective("importance_sampling").truncated(100.0).forward_backward(truncated, batch).result()
    for a, b in zip(plain.model.parameters(), truncated.model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-7)
