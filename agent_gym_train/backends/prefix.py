"""The learner's shared-prefix trick: rows opening with the same untrained tokens (a GRPO
group's prompt, TEMPO's branches from one saved state) run that opening once per
``forward_backward``, whatever microbatches they fall into, with the gradient of running it
in every row; and activation checkpointing (``recompute_layers``) that keeps it working.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import Cache, DynamicLayer

# Rows opening with at least this many identical untrained tokens share their computation.
MIN_SHARED_PREFIX = 16


class SharedPrefix:
    """An untrained opening several rows share, run once: its keys and values per layer.

    Under autograd the rows attend to detached copies (leaves), so each microbatch's
    backward stops there and adds its share to their gradients; ``backward`` then pushes the
    sum through the prefix once. That is the gradient of running the prefix in every row.
    Both passes use caches that give the same answer when a recomputed layer asks again
    (``_Recorded``, ``_Fixed``), so they hold under ``recompute_layers`` too.
    """

    def __init__(self, body: torch.nn.Module, tokens: Sequence[int], device: torch.device):
        self.length = len(tokens)
        layers = [_Recorded() for _ in range(body.config.num_hidden_layers)]
        body(input_ids=torch.tensor([list(tokens)], device=device), cache=Cache(layers=layers),
             use_cache=True)
        self._computed = [(layer.keys, layer.values) for layer in layers]
        # A leaf wants a gradient only where the prefix depends on trained weights (a first
        # layer's keys with frozen attention do not), and holds it in float32, so the
        # microbatches' shares add up unrounded under a bf16 autocast.
        self._seen = [tuple(t.detach().float().requires_grad_(t.requires_grad) for t in pair)
                      for pair in self._computed]

    def cache(self, rows: int) -> Cache:
        """A cache holding the prefix for ``rows`` rows (views, not copies)."""
        return Cache(layers=[
            _Fixed(*(seen.to(computed.dtype).expand(rows, -1, -1, -1)
                     for seen, computed in zip(seens, computeds, strict=True)))
            for seens, computeds in zip(self._seen, self._computed, strict=True)
        ])

    def backward(self) -> None:
        """Push the gradient the microbatches left on the leaves through the prefix, once."""
        pairs = [(computed, seen.grad.to(computed.dtype))
                 for layers in zip(self._computed, self._seen, strict=True)
                 for computed, seen in zip(*layers, strict=True) if seen.grad is not None]
        if pairs:
            torch.autograd.backward([c for c, _ in pairs], [g for _, g in pairs])


class _Recorded(DynamicLayer):
    """A cache layer of a pass with no past: keeps the keys/values it is given, returns them.
    A recomputed layer gives them again and they are replaced, never appended."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys, self.values = key_states, value_states
        self.device, self.dtype, self.is_initialized = key_states.device, key_states.dtype, True
        return key_states, value_states


class _Fixed(DynamicLayer):
    """A cache layer holding a fixed past: the new positions attend to it and are not kept."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values = keys, values
        self.device, self.dtype, self.is_initialized = keys.device, keys.dtype, True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.cat([self.keys, key_states], dim=-2),
                torch.cat([self.values, value_states], dim=-2))


def recompute_layers(body: torch.nn.Module) -> None:
    """Make each decoder layer of ``body`` keep only its input for the backward pass and run
    again there, instead of keeping every activation (activation checkpointing).

    Not Hugging Face's ``gradient_checkpointing_enable``: that drops a layer's cache, and a
    ``SharedPrefix`` needs it. The learner's caches answer a recomputed layer as they
    answered the first run, and its plain passes run without one.
    """
    layers = getattr(body, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(body).__name__} has no list of decoder layers to recompute")
    for layer in layers:
        layer.forward = partial(_recomputed, layer.forward)


def _recomputed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``forward`` under a checkpoint when autograd records (a sampler or a forward-only
    pass has nothing to recompute)."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def shared_prefixes(
    leads: Sequence[Sequence[int] | None], minimum: int
) -> list[tuple[list[int], int]]:
    """Rows grouped by identical untrained opening tokens: ``(rows, shared length)``.

    ``leads[r]`` is row r's tokens before its first counted position (None: nothing
    counted). Rows whose lead is shared by another row and at least ``minimum`` long form a
    group with that prefix; all other rows go together with prefix 0.
    """
    by_lead: dict[tuple[int, ...], list[int]] = {}
    alone: list[int] = []
    for row, lead in enumerate(leads):
        if lead is None:
            alone.append(row)
        else:
            by_lead.setdefault(tuple(lead), []).append(row)
    groups: list[tuple[list[int], int]] = []
    for lead, rows in by_lead.items():
        if len(rows) > 1 and len(lead) >= minimum:
            groups.append((rows, len(lead)))
        else:
            alone.extend(rows)
    if alone:
        groups.append((sorted(alone), 0))
    return groups
