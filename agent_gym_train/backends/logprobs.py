"""Logprobs of chosen tokens without building the full logits tensor.

A causal LM's logits are ``head(hidden)`` with a vocabulary-sized head (49,152 rows for
SmolLM2): at every position of a batch that is the largest tensor of the pass (2,392
positions x 49,152 floats = 470 MB for 8 datums of 299 tokens), and its log-softmax and
gradient are as large again. A learner needs the logprob of one target token at the
positions that train (target != -100), so here the head and the log-softmax run only on
those positions' hidden states, in chunks of ``chunk`` positions. Under autograd each chunk is
checkpointed: its logits are recomputed in the backward pass instead of kept, so peak memory
holds one chunk's logits, not every position's.

This relies on ``logits = head(last_hidden_state)``, true of the Llama, Qwen, Mistral and
SmolLM families; models that post-process logits (soft-capping, scaling) are refused.
"""

from __future__ import annotations

import torch
from peft import PeftModel
from torch.utils.checkpoint import checkpoint

POST_PROCESSED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def split_model(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The decoder body (input ids -> last hidden state) and the LM head of a causal LM."""
    inner = model.get_base_model() if isinstance(model, PeftModel) else model
    head = inner.get_output_embeddings()
    body = inner.get_decoder()
    if head is None or body is inner:
        raise ValueError(f"{type(inner).__name__} has no separate decoder and LM head")
    config = getattr(inner, "config", None)
    for name in POST_PROCESSED_LOGITS:
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ValueError(f"{type(inner).__name__} post-processes its logits ({name})")
    return body, head


def target_logprobs(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunk: int
) -> torch.Tensor:
    """``log softmax(head(hidden))[target]`` per row of ``hidden`` [M, H], as float32 [M]."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    if hidden.shape[0] == 0:
        return hidden.new_zeros(0, dtype=torch.float32)
    pieces = []
    for start in range(0, hidden.shape[0], chunk):
        h = hidden[start : start + chunk]
        t = targets[start : start + chunk]
        if torch.is_grad_enabled():
            pieces.append(checkpoint(_chunk, head, h, t, use_reentrant=False))
        else:
            pieces.append(_chunk(head, h, t))
    return torch.cat(pieces)


def _chunk(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    picked = logits.gather(-1, targets[:, None]).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
