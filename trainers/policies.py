"""The sampler policies ``agent-gym eval`` can benchmark: ``local[:MODEL][@CHECKPOINT]`` (the
local torch backend) and ``pytrio:MODEL[@CHECKPOINT]`` (the PyTRIO service).

They live here, not in ``agent_gym``, because they need torch or the PyTRIO SDK;
``agent_gym.policies.make_policy`` finds them through this package's ``agent_gym.policies``
entry points.
"""

from __future__ import annotations

from typing import Any

from pytrio import ModelInput, SamplingParams

from agent_gym.policies import PolicyInput, Reply
from agent_gym.render import ChatRenderer, ContinuedPrompts
from trainers.backends import make_service


class SamplerPolicy:
    """A pytrio-style sampling client: the remote service's or the local torch backend's.

    Both expose ``sample_async(ModelInput, num_samples, SamplingParams)`` and
    ``get_tokenizer()``. Prompts are token-continuous, as in training: each turn's prompt
    is the previous one plus the sampled tokens verbatim plus the env's reply
    (``agent_gym.render.ContinuedPrompts``), not a re-render of the transcript. A reply
    cut by ``max_tokens`` is marked cut: eval, like the trainers, ends the episode there
    instead of scoring the unfinished text.
    """

    def __init__(
        self, name: str, sampling_client: Any, *, max_tokens: int = 256,
        temperature: float = 0.0, seed: int = 0,
    ) -> None:
        self.name = name
        self.client = sampling_client
        self.renderer = ChatRenderer(sampling_client.get_tokenizer())
        self.prompts = ContinuedPrompts(self.renderer)
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.seed = seed

    async def act(self, observation: PolicyInput) -> Reply:
        conversation = self.prompts.conversation(observation.messages, observation.tools)
        prompt = list(conversation.tokens)
        params = SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature,
            seed=self.seed + observation.turn, stop=sorted(self.renderer.stop_tokens),
        )
        response = await self.client.sample_async(
            ModelInput.from_ints(prompt), num_samples=1, sampling_params=params
        )
        sequence = response.sequences[0]
        completion = list(sequence.tokens)
        self.prompts.answered(conversation, completion)
        return Reply(self.renderer.completion_text(completion), len(prompt), len(completion),
                     cut=not self.renderer.is_finished(completion))


def sampler_policy(
    spec: str, *, seed: int, max_tokens: int, device: str = "auto", threads: int | None = None
) -> SamplerPolicy:
    """``local[:MODEL][@CHECKPOINT]`` or ``pytrio:MODEL[@CHECKPOINT]``; ``device`` and
    ``threads`` place the local sampler (see ``trainers.backends.runtime``)."""
    backend, _, rest = spec.partition(":")
    model, _, checkpoint = rest.partition("@")
    if backend == "pytrio" and not model:
        raise ValueError(f"expected pytrio:MODEL[@CHECKPOINT], got {spec!r}")
    service = make_service(backend, device=device, threads=threads)
    client = service.create_sampling_client(model or "smollm2", checkpoint or None)
    return SamplerPolicy(spec, client, max_tokens=max_tokens, seed=seed)
