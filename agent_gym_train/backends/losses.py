"""The built-in losses, per token, with pytrio's (tinker's) definitions.

With ``p`` the learner's logprob of a target token, ``q`` the sampler's logprob of it
(``logprobs`` in the datum), ``r = exp(p - q)`` and ``A`` its advantage:

* ``cross_entropy``:       ``-p * weight``
* ``importance_sampling``: ``-r * A``
* ``ppo``:                 ``-min(r * A, clip(r, low, high) * A)``
* ``cispo``:               ``-sg(clip(r, low, high)) * A * p`` (``sg``: no gradient flows
  through the coefficient, so a clipped token still trains, with a bounded weight)
* ``dro``:                 ``-(p * A - beta / 2 * (p - q) ** 2)``

``low``/``high`` come from ``loss_fn_config`` keys ``clip_low_threshold`` and
``clip_high_threshold``: 0.8/1.2 for ppo; 0.0/4.0 for cispo (a one-sided clip, tinker's
default). ``beta`` is ``loss_fn_config["beta"]``. pytrio names cispo and dro among its losses
(``pytrio.client.training_batch``) without defining them; the definitions and cispo's
defaults are tinker's, whose API pytrio mirrors. Tinker documents no default beta: 1.0
here, so pass ``beta`` to get the same update on both backends.

Positions whose target is ``-100`` contribute nothing and are not counted. A logical batch's
``loss_sum`` adds every term; ``loss_mean = loss_sum / token_count`` where ``token_count``
is the number of counted targets in the whole batch, and the gradient is that of
``loss_mean`` (pytrio sends whole-batch totals with every split request for exactly this).
pytrio also sends the count of targets with a nonzero advantage, which its service may use
as dro's denominator; locally every loss divides by ``token_count``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

SUPPORTED_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
_CLIP_KEYS = frozenset({"clip_low_threshold", "clip_high_threshold"})
_CONFIG_KEYS: dict[str, frozenset[str]] = {
    "cross_entropy": frozenset(),
    "importance_sampling": frozenset(),
    "ppo": _CLIP_KEYS,
    "cispo": _CLIP_KEYS,
    "dro": frozenset({"beta"}),
}
CLIP_DEFAULTS = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0)}
DRO_BETA = 1.0


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
    if loss_fn in CLIP_DEFAULTS:
        low, high = clip_thresholds(loss_fn, checked)
        if not 0.0 <= low <= 1.0 <= high:
            raise ValueError(f"{loss_fn} needs 0 <= clip_low_threshold <= 1 <= "
                             f"clip_high_threshold, got {low} and {high}")
    if checked.get("beta", DRO_BETA) < 0:
        raise ValueError(f"dro needs beta >= 0, got {checked['beta']}")
    return checked


def clip_thresholds(loss_fn: str, config: Mapping[str, float]) -> tuple[float, float]:
    """The ratio bounds of a clipped loss: its config, else its defaults."""
    low, high = CLIP_DEFAULTS[loss_fn]
    return config.get("clip_low_threshold", low), config.get("clip_high_threshold", high)


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
    elif loss_fn == "dro":
        gap = logprobs - inputs["logprobs"]
        beta = config.get("beta", DRO_BETA)
        terms = -(logprobs * inputs["advantages"] - 0.5 * beta * gap * gap)
    else:
        ratio = torch.exp(logprobs - inputs["logprobs"])
        advantages = inputs["advantages"]
        if loss_fn == "importance_sampling":
            terms = -ratio * advantages
        elif loss_fn == "ppo":
            low, high = clip_thresholds(loss_fn, config)
            terms = -torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
        else:  # cispo
            low, high = clip_thresholds(loss_fn, config)
            terms = -ratio.clamp(low, high).detach() * advantages * logprobs
    return torch.where(counted, terms, torch.zeros_like(terms))
