"""Training backends with one client surface: ``local`` (torch) and ``pytrio`` (remote)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

BACKENDS = ("local", "pytrio")
# The dtypes a local sampler may hold its weights in (``runtime.sampler_dtype``).
SAMPLER_PRECISIONS = ("float32", "bfloat16")
# Where rollouts are sampled: the backend's own sampler, or a vLLM server (``vllm.py``).
SAMPLERS = ("local", "vllm")
# How the learner's weights reach a vLLM engine after each update (``vllm.py``).
VLLM_WEIGHTS = ("merged", "adapter")
# The target id a datum gives the tokens the loss skips (prompt and observation tokens):
# the learners read it, the datum builders (``agent_gym_train.run.episode``) write it.
IGNORE_TARGET = -100


def make_service(
    backend: str,
    *,
    checkpoint_dir: str | Path | None = None,
    api_key: str | None = None,
    device: str = "auto",
    threads: int | None = None,
    activation_checkpointing: bool = False,
    sampler_precision: str = "float32",
) -> Any:
    """A service client: ``LocalServiceClient`` or an authenticated ``pytrio.ServiceClient``.

    ``device`` and ``threads`` place the local backend (``agent_gym_train.backends.runtime``),
    ``activation_checkpointing`` trades its learner time for memory and ``sampler_precision``
    its samplers' exactness for speed; the remote service decides its own hardware.
    Imported lazily: the local backend pulls in torch, the remote one a network session.
    """
    if backend == "local":
        from agent_gym_train.backends.local import LocalServiceClient

        return LocalServiceClient(checkpoint_dir=checkpoint_dir, device=device, threads=threads,
                                  activation_checkpointing=activation_checkpointing,
                                  sampler_precision=sampler_precision)
    if backend == "pytrio":
        from agent_gym_train.backends.pytrio import connect

        return connect(api_key)
    raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
