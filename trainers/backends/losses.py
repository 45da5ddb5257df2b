"""The built-in losses, per token, with pytrio's (tinker's) definitions.

With ``p`` the learner's logprob of a target token, ``q`` the sampler's logprob of it
(``logprobs`` in the datum) and ``A`` its advantage:

* ``cross_entropy``:       ``-p * weight``
* ``importance_sampling``: ``-exp(p - q) * A``
* ``ppo``:                 ``-min(exp(p - q) * A, clip(exp(p - q), low, high) * A)``,
  ``low``/``high`` from ``loss_fn_config`` keys ``clip_low_threshold`` (default 0.8) and
  ``clip_high_threshold`` (default 1.2).

Positions whose target is ``-100`` contribute nothing and are not counted. A logical batch's
``loss_sum`` adds every term; ``loss_mean = loss_sum / token_count`` where ``token_count``
is the number of counted targets in the whole batch, and the gradient is that of
``loss_mean`` (pytrio sends whole-batch totals with every split request for exactly this).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

SUPPORTED_LOSSES = ("cross_entropy", "importance_sampling", "ppo")
_CONFIG_KEYS: dict[str, frozenset[str]] = {
    "cross_entropy": frozenset(),
    "importance_sampling": frozenset(),
    "ppo": frozenset({"clip_low_threshold", "clip_high_threshold"}),
}
PPO_CLIP_DEFAULTS = (0.8, 1.2)


def check_loss(loss_fn: str, config: Mapping[str, object] | None) -> dict[str, float]:
    """Validate a loss name and its config; returns the config as floats."""
    if loss_fn not in _CONFIG_KEYS:
        raise ValueError(
            f"loss {loss_fn!r} is not available locally; use one of {', '.join(SUPPORTED_LOSSES)}"
        )
    values = dict(config or {})
    unknown = set(values) - _CONFIG_KEYS[loss_fn]
    if unknown:
        raise ValueError(f"{loss_fn} takes no loss_fn_config keys {sorted(unknown)}")
    checked: dict[str, float] = {}
    for key, value in values.items():
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not math.isfinite(value):
            raise ValueError(f"loss_fn_config[{key!r}] must be a finite number, got {value!r}")
        checked[key] = float(value)
    if loss_fn == "ppo":
        low, high = ppo_clip(checked)
        if not 0.0 <= low <= 1.0 <= high:
            raise ValueError(f"ppo needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold, "
                             f"got {low} and {high}")
    return checked


def ppo_clip(config: Mapping[str, float]) -> tuple[float, float]:
    return (
        config.get("clip_low_threshold", PPO_CLIP_DEFAULTS[0]),
        config.get("clip_high_threshold", PPO_CLIP_DEFAULTS[1]),
    )


def token_losses(
    loss_fn: str,
    logprobs: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    counted: torch.Tensor,
    config: Mapping[str, float],
) -> torch.Tensor:
    """Elementwise loss, zero where ``counted`` is False. All tensors share one shape."""
    if loss_fn == "cross_entropy":
        terms = -logprobs * inputs["weights"]
    else:
        ratio = torch.exp(logprobs - inputs["logprobs"])
        advantages = inputs["advantages"]
        if loss_fn == "importance_sampling":
            terms = -ratio * advantages
        else:
            low, high = ppo_clip(config)
            terms = -torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    return torch.where(counted, terms, torch.zeros_like(terms))
