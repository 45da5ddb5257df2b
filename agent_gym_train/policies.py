"""The sampler policies ``agent-gym eval`` can benchmark: ``local[:MODEL][@CHECKPOINT]`` (the
local torch backend), ``vllm[:MODEL][@CHECKPOINT]`` (a vLLM server the policy starts and
stops, on the checkpoint's weights) and ``pytrio:MODEL[@CHECKPOINT]`` (the PyTRIO
service).

They live here, not in ``agent_gym``, because they need torch or the PyTRIO SDK;
``agent_gym.eval.policies.make_policy`` finds them through this package's ``agent_gym.policies``
entry points.
"""

from __future__ import annotations

from typing import Any

from pytrio import ModelInput, SamplingParams

from agent_gym.eval.policies import ContextLengthError, PolicyInput, Reply
from agent_gym.render import ChatRenderer, ContinuedPrompts
from agent_gym.seeding import derive_seed
from agent_gym_train.backends import make_service
from agent_gym_train.backends.pytrio import BackendError
from agent_gym_train.backends.vllm import (
    Engine,
    EngineConfig,
    EngineError,
    Scratch,
    VLLMSampler,
    served_model_name,
)
from agent_gym_train.run.files import RunConfigError, checkpoint_path


class SamplerPolicy:
    """A pytrio-style sampling client: the remote service's or the local torch backend's.

    Both expose ``sample_async(ModelInput, num_samples, SamplingParams)`` and
    ``get_tokenizer()``. Prompts are token-continuous, as in training: each turn's prompt
    is the previous one plus the sampled tokens verbatim plus the env's reply
    (``agent_gym.render.ContinuedPrompts``), not a re-render of the transcript; a
    transcript it has not seen (the first turn, a history window's cut) is rendered whole.
    A reply cut by ``max_tokens`` is marked cut: eval, like the trainers, ends the episode
    there instead of scoring the unfinished text.

    The context is the sampler's (the local model's positions) or, for a remote sampler
    that does not say, the tokenizer's ``model_max_length``: a prompt that fills it raises
    ``ContextLengthError`` and a reply may use only what is left of it.
    """

    def __init__(
        self, name: str, sampling_client: Any, *, max_tokens: int = 256,
        temperature: float = 0.0, seed: int = 0, engine: Engine | None = None,
    ) -> None:
        self.name = name
        self.client = sampling_client
        self.engine = engine  # a server this policy started, stopped with it
        self.renderer = ChatRenderer(sampling_client.get_tokenizer())
        self.prompts = ContinuedPrompts(self.renderer)
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.seed = seed
        self.context_length = _context_length(sampling_client)

    async def act(self, observation: PolicyInput) -> Reply:
        conversation = self.prompts.conversation(observation.messages, observation.tools)
        prompt = list(conversation.tokens)
        room = self.max_tokens
        if self.context_length is not None:
            if len(prompt) >= self.context_length:
                raise ContextLengthError(
                    f"the prompt has {len(prompt)} tokens; {self.name}'s context is "
                    f"{self.context_length}"
                )
            room = min(room, self.context_length - len(prompt))
        params = SamplingParams(
            max_tokens=room, temperature=self.temperature,
            seed=derive_seed(self.seed, observation.seed, observation.turn),
            stop=sorted(self.renderer.stop_tokens),
        )
        response = await self.client.sample_async(
            ModelInput.from_ints(prompt), num_samples=1, sampling_params=params
        )
        sequence = response.sequences[0]
        completion = list(sequence.tokens)
        self.prompts.answered(conversation, completion)
        finished = self.renderer.is_finished(completion)
        return Reply(self.renderer.completion_text(completion), len(prompt), len(completion),
                     cut=not finished, finish_reason="stop" if finished else "length")


    async def aclose(self) -> None:
        if self.engine is not None:
            self.engine.close()


def _context_length(sampling_client: Any) -> int | None:
    """The sampler's context in tokens, if it or its tokenizer says (tokenizers without a
    limit report a huge sentinel)."""
    known = getattr(sampling_client, "context_length", None)
    if isinstance(known, int):
        return known
    limit = getattr(sampling_client.get_tokenizer(), "model_max_length", None)
    return limit if isinstance(limit, int) and limit < 10**7 else None


def sampler_policy(
    spec: str, *, seed: int, max_tokens: int, temperature: float = 0.0, device: str = "auto",
    threads: int | None = None, precision: str = "float32",
) -> SamplerPolicy:
    """``local[:MODEL][@CHECKPOINT]`` or ``pytrio:MODEL[@CHECKPOINT]``; ``device``,
    ``threads`` and ``precision`` (its weights' dtype) place the local sampler (see
    ``agent_gym_train.backends.runtime``).

    CHECKPOINT is what a trainer's ``--init-from`` takes
    (``agent_gym_train.run.files.checkpoint_path``):
    a training run's directory or its ``checkpoint.json`` (the run's latest checkpoint), or
    a backend checkpoint path. A checkpoint or model that cannot be loaded, or a service
    that cannot be reached, is a ``ValueError`` (``RunConfigError``) naming ``spec``, which
    ``agent-gym eval`` prints as one line.
    """
    backend, _, rest = spec.partition(":")
    model, _, checkpoint = rest.partition("@")
    if backend == "pytrio" and not model:
        raise ValueError(f"expected pytrio:MODEL[@CHECKPOINT], got {spec!r}")
    engine = None
    try:
        path = checkpoint_path(checkpoint) if checkpoint else None
        if backend == "vllm":
            engine, client = _vllm_client(model or "smollm2", path, threads)
        else:
            service = make_service(backend, device=device, threads=threads,
                                   sampler_precision=precision)
            client = service.create_sampling_client(model or "smollm2", path)
    except RunConfigError as err:
        raise RunConfigError(f"--policy {backend}:{model}@{err}") from err
    except (ValueError, OSError, BackendError, EngineError) as err:  # a wrong checkpoint
        raise RunConfigError(f"--policy {spec}: {err}") from err
    return SamplerPolicy(spec, client, max_tokens=max_tokens, temperature=temperature,
                         seed=seed, engine=engine)


def _vllm_client(model: str, checkpoint: str | None, threads: int | None
                 ) -> tuple[Engine, VLLMSampler]:
    """A vLLM server on ``model`` or on the checkpoint's weights (loaded by the local backend,
    which reads checkpoints, and merged: the CPU build samples a whole model far faster than
    one through a LoRA adapter), and a sampler on it. The model written for the server goes
    with it."""
    from agent_gym_train.backends.local import LocalServiceClient
    from agent_gym_train.backends.merged import save_engine_model
    from agent_gym_train.backends.models import load_model, load_tokenizer, model_dir

    scratch = Scratch.make()
    folder = scratch.path
    try:
        if checkpoint is None:
            weights = load_model(model)
        else:
            local = LocalServiceClient(checkpoint_dir=folder / "checkpoints", device="cpu",
                                       threads=threads)
            weights = local.create_training_client_from_state(checkpoint).model
        served = save_engine_model(weights, model_dir(model), folder / "model")
        engine = Engine.start(EngineConfig(
            model_dir=served, served_name=served_model_name(model), max_lora_rank=0,
            max_loras=1, log=folder / "vllm.log", threads=threads, scratch=scratch))
    except BaseException:
        scratch.remove()
        raise
    return engine, VLLMSampler(engine, engine.served_name, load_tokenizer(model))
