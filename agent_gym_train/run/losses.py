"""The policy-gradient objectives ``--loss`` and ``--loss-aggregation`` name, on either backend.

pytrio computes ``importance_sampling``, ``ppo`` and ``cispo`` itself (``forward_backward``;
the local backend's definitions are in ``agent_gym_train.backends.losses``), as a **token mean**
over the logical batch: the summed loss of every trained token, divided by their number, so
each token weighs the same and a long reply weighs more than a short one (what DAPO calls
the token-level loss). What pytrio does not have built in is written here as one custom loss,
``policy_loss``, sent through ``forward_backward_custom``, so the same code runs on the
local backend and on pytrio:

* ``gspo`` (GSPO, Zheng et al. 2025): one importance ratio per sequence, the geometric mean
  of its tokens' ratios, ``s = exp(mean_t(p_t - q_t))``, clipped as ppo clips, and applied
  to every token of the sequence in GSPO's token form ``s_t = sg(s) * exp(p_t - sg(p_t))``
  (value ``s`` on every token; with one advantage per sequence its gradient is that of the
  sequence objective). Why: a token ratio is noisy and a sequence's reward belongs to the
  whole sequence; GSPO clips whole sequences instead of scattered tokens. Sequence ratios sit
  close to 1, so its clip range is GSPO's 3e-4/4e-4, not ppo's 0.2.
* ``sequence-mean`` aggregation (GRPO's original): each sequence's mean token loss, then
  the mean over sequences, so each episode weighs the same whatever its length. It applies
  to every loss here and always goes through ``forward_backward_custom``.

With ``p`` the learner's logprob of a trained token, ``q`` the sampler's, ``r = exp(p - q)``
and ``A`` the advantage, the per-token terms are those of the built-in losses
(``importance_sampling``: ``-r A``; ``ppo``: ``-min(r A, clip(r) A)``; ``cispo``:
``-sg(clip(r)) A p``) and, for gspo, ppo's with ``s_t`` in place of ``r``.

**Scale.** pytrio's client turns a custom loss ``L`` into a ``cross_entropy`` pass weighted
by ``-dL/dp``, which is divided by that pass's token count: the positions with a nonzero
weight. ``policy_loss`` returns its objective ``J`` times that count (found by autograd on
its own inputs, as a constant), so the update is exactly ``grad J`` -- the token-mean custom
ppo gives the built-in ppo's gradient -- however many tokens are clipped or have a zero
advantage.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pytrio import Datum
from pytrio.types import APIFuture, ForwardBackwardOutput

from agent_gym_train.backends import IGNORE_TARGET

TOKEN_MEAN, SEQUENCE_MEAN = "token-mean", "sequence-mean"
AGGREGATIONS = (TOKEN_MEAN, SEQUENCE_MEAN)
BUILT_IN = ("importance_sampling", "ppo", "cispo")  # pytrio computes these (token mean)
POLICY_LOSSES = (*BUILT_IN, "gspo")
# Clip widths (eps_low, eps_high): ratios are clipped to [1 - eps_low, 1 + eps_high].
# ppo: the usual 0.2 (DAPO raises eps_high to 0.28); cispo: tinker's one-sided default
# (thresholds 0 and 4); gspo: the GSPO paper's.
CLIP_DEFAULTS: dict[str, tuple[float, float]] = {
    "ppo": (0.2, 0.2), "cispo": (1.0, 3.0), "gspo": (3e-4, 4e-4),
}


def problems(loss: str, aggregation: str, clip_low: float | None,
             clip_high: float | None) -> list[str]:
    """What is wrong with a run's loss options (empty: nothing)."""
    found = []
    if aggregation not in AGGREGATIONS:
        found.append(f"--loss-aggregation must be one of {AGGREGATIONS}")
    if aggregation == SEQUENCE_MEAN and loss not in POLICY_LOSSES:
        found.append(f"--loss-aggregation {SEQUENCE_MEAN} applies to the policy-gradient "
                     f"losses {POLICY_LOSSES}, not {loss}")
    if (clip_low is not None or clip_high is not None) and loss not in CLIP_DEFAULTS:
        found.append(f"--clip-low/--clip-high apply to {tuple(CLIP_DEFAULTS)}, not {loss}")
    if clip_low is not None and not 0 <= clip_low <= 1:
        found.append(f"--clip-low must be in [0, 1], got {clip_low}")
    if clip_high is not None and not clip_high >= 0:
        found.append(f"--clip-high must be at least 0, got {clip_high}")
    return found


@dataclass(frozen=True)
class Objective:
    """What ``Run.update`` trains on: a loss, how it is aggregated, its clip widths."""

    loss: str
    aggregation: str = TOKEN_MEAN
    clip_low: float | None = None  # None: the loss's default (CLIP_DEFAULTS)
    clip_high: float | None = None
    # Truncated importance sampling for data sampled on older weights (see
    # ``truncated``): the largest weight a token of ``importance_sampling`` gets.
    max_weight: float | None = None

    def __post_init__(self) -> None:
        if self.max_weight is not None and not 1 <= self.max_weight < float("inf"):
            raise ValueError(f"the largest importance weight must be at least 1, got "
                             f"{self.max_weight}")

    def truncated(self, max_weight: float) -> Objective:
        """This objective for data up to some versions older than the weights it trains.

        Every loss here weighs a token by ``r = exp(p - q)``, its probability under the
        weights being trained over that under the sampler that drew it: with a stale
        sampler that ratio *is* the off-policy correction, and only needs bounding. ppo,
        cispo and gspo clip it already. ``importance_sampling`` does not, and a token the
        new weights like far more than the old ones did would dominate the step; it is
        trained as truncated importance sampling (IMPALA's truncated weight, TIS): the
        gradient ``-min(r, max_weight) * A * grad p``, which is pytrio's own ``cispo`` with
        the bounds ``[0, max_weight]``. Where ``r <= max_weight`` its gradient is exactly
        ``importance_sampling``'s (``grad r = r grad p``); the reported loss is cispo's.
        """
        if self.loss != "importance_sampling":
            return self
        return dataclasses.replace(self, loss="cispo", max_weight=max_weight)

    @property
    def built_in(self) -> bool:
        """Computed by the backend itself (``forward_backward``), not by ``policy_loss``."""
        return self.loss != "gspo" and self.aggregation == TOKEN_MEAN

    def thresholds(self) -> dict[str, float] | None:
        """The ratio bounds as pytrio's ``loss_fn_config`` keys (None: the loss clips nothing)."""
        if self.max_weight is not None and self.loss == "cispo":
            return {"clip_low_threshold": 0.0, "clip_high_threshold": self.max_weight}
        if self.loss not in CLIP_DEFAULTS:
            return None
        low, high = CLIP_DEFAULTS[self.loss]
        low = low if self.clip_low is None else self.clip_low
        high = high if self.clip_high is None else self.clip_high
        return {"clip_low_threshold": 1 - low, "clip_high_threshold": 1 + high}

    def forward_backward(self, training: Any, datums: list[Datum]
                         ) -> APIFuture[ForwardBackwardOutput]:
        """The step's one forward-backward on ``training`` (a pytrio or local client)."""
        if self.built_in:
            return training.forward_backward(datums, self.loss, self.thresholds())
        config = {"loss": self.loss, "aggregation": self.aggregation, **(self.thresholds() or {})}
        return training.forward_backward_custom(datums, policy_loss, config)


def sampler_mismatch(
    datums: Sequence[Datum], outputs: Sequence[Mapping[str, Any]], max_weight: float | None,
) -> dict[str, float | None]:
    """How far the sampler's logprobs of the sampled tokens (the datums' ``logprobs``) are
    from the learner's (``outputs``' ``logprobs``, from the same forward-backward): their
    mean absolute difference, and the share of tokens whose importance weight
    ``exp(learner - sampler)`` is above ``max_weight`` (what truncation cut; None when the
    objective truncates nothing). An engine computes in its own precision and kernels, so
    these are not 0 even on weights just published; they say how much the correction does."""
    gaps: list[float] = []
    for datum, output in zip(datums, outputs, strict=True):
        learner = output.get("logprobs")
        if learner is None or "logprobs" not in datum.loss_fn_inputs:
            continue
        targets = datum.loss_fn_inputs["target_tokens"].data
        sampled = datum.loss_fn_inputs["logprobs"].data
        gaps += [p - q for p, q, t in zip(learner.data, sampled, targets, strict=True)
                 if t != IGNORE_TARGET]
    if not gaps:
        return {"logprob_gap_abs_mean": None, "truncated_fraction": None}
    cut = (None if max_weight is None
           else sum(gap > math.log(max_weight) for gap in gaps) / len(gaps))
    return {"logprob_gap_abs_mean": sum(abs(g) for g in gaps) / len(gaps),
            "truncated_fraction": cut}


def policy_loss(
    data: list[Datum], logprobs: list[torch.Tensor], config: dict[str, object]
) -> tuple[torch.Tensor, dict[str, float]]:
    """A custom loss (pytrio's ``CustomLossFn``): ``config`` names the ``loss``, the
    ``aggregation`` and, for a clipped loss, ``clip_low_threshold``/``clip_high_threshold``
    (default: the loss's own, ``CLIP_DEFAULTS``).
    Returns the objective scaled for pytrio's normalisation (module docstring) and metrics:
    ``loss_mean`` (the objective), ``loss_sum`` (its token terms added), ``token_count``
    (trained tokens) and ``clip_fraction`` (trained tokens whose ratio was clipped)."""
    loss, aggregation = str(config["loss"]), str(config["aggregation"])
    if loss not in POLICY_LOSSES or aggregation not in AGGREGATIONS:
        raise ValueError(f"policy_loss computes {POLICY_LOSSES} with {AGGREGATIONS}, "
                         f"not {loss} with {aggregation}")
    bounds = {"clip_low_threshold": 0.0, "clip_high_threshold": 0.0,
              **(Objective(loss).thresholds() or {}), **config}  # unset: the loss's defaults
    low = float(bounds["clip_low_threshold"])  # type: ignore[arg-type]
    high = float(bounds["clip_high_threshold"])  # type: ignore[arg-type]
    sums, counts, clipped = [], [], []
    for datum, p in zip(data, logprobs, strict=True):
        inputs = datum.loss_fn_inputs
        mask = torch.tensor(inputs["target_tokens"].data) != IGNORE_TARGET
        q = torch.tensor(inputs["logprobs"].data, dtype=p.dtype)
        advantages = torch.tensor(inputs["advantages"].data, dtype=p.dtype)
        terms, clips = _token_terms(loss, p, q, advantages, mask, low, high)
        sums.append(torch.where(mask, terms, torch.zeros_like(terms)).sum())
        counts.append(int(mask.sum()))
        clipped.append(int((clips & mask).sum()))
    tokens = sum(counts)
    total = torch.stack(sums).sum()
    if aggregation == TOKEN_MEAN:
        objective = total / max(tokens, 1)
    else:
        means = [s / max(n, 1) for s, n in zip(sums, counts, strict=True)]
        objective = torch.stack(means).sum() / max(sum(1 for n in counts if n), 1)
    gradients = torch.autograd.grad(objective, logprobs, retain_graph=True)
    weighted = sum(int(g.count_nonzero()) for g in gradients)
    return objective * weighted, {
        "loss_mean": float(objective.detach()), "loss_sum": float(total.detach()),
        "token_count": float(tokens), "clip_fraction": sum(clipped) / max(tokens, 1),
    }


def _token_terms(
    loss: str, p: torch.Tensor, q: torch.Tensor, advantages: torch.Tensor,
    mask: torch.Tensor, low: float, high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss terms of one sequence and where the clip was active."""
    if loss == "gspo":
        gaps = torch.where(mask, p - q, torch.zeros_like(p))
        log_ratio = gaps.sum() / max(int(mask.sum()), 1)
        ratio = torch.exp(log_ratio.detach() + p - p.detach())
    else:
        ratio = torch.exp(p - q)
    if loss == "importance_sampling":
        return -ratio * advantages, torch.zeros_like(mask)
    bounded = ratio.clamp(low, high)
    if loss == "cispo":
        return -bounded.detach() * advantages * p, bounded != ratio
    unclipped, clipped = ratio * advantages, bounded * advantages
    return -torch.minimum(unclipped, clipped), clipped < unclipped
