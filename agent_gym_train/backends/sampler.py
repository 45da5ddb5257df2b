"""Local sampling with pytrio's ``SamplingClient`` surface and real per-token logprobs.

Every call goes to one batching engine (``agent_gym_train.backends.batching``): concurrent calls
(all groups' first turns, every branch's later turns, critic samples) are decoded together as
one batch, rows joining and leaving as they arrive and finish, and each branch's next turn
prefills only the tokens its previous turn did not (``agent_gym_train.backends.kvcache``).
``num_samples`` sequences from one prompt share a single prefill. ``compute_logprobs`` keeps
its own prefix cache (keys, values and the logprobs already computed), so prompts scored one
after another that share a long opening pay for it once: TEMPO's median readout scores five
replies of a few tokens after one critic prompt of hundreds.

Each returned token carries its logprob under the distribution it was drawn from
(temperature, top-k and top-p applied); with the defaults (temperature 1, no filtering) that
is exactly the model's logprob, so a fresh sampler's logprobs match ``compute_logprobs`` and
the importance ratio of an on-policy update starts at 1. A temperature of 0 picks the most
likely token and reports the model's own logprob of it. With a seed, what a call samples
depends on the seed, the prompt and the weights only, not on which other calls share the
batch: row ``i`` of a call draws from its own generator seeded from ``(seed, i)``.

A sequence stops at a stop token or stop string (kept in the returned tokens, as pytrio
does) with ``stop_reason="stop"``, or at ``max_tokens`` / the context limit with
``stop_reason="length"``. Without ``stop`` the tokenizer's end-of-sequence token stops.
"""

from __future__ import annotations

import asyncio
import copy
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from peft import PeftModel
from pytrio import ModelInput, SamplingParams
from pytrio.types import APIFuture, SampleResponse, SampleSequence
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from agent_gym_train.backends.batching import BatchEngine, EngineStats, SampleRequest
from agent_gym_train.backends.kvcache import PrefixCache
from agent_gym_train.backends.logprobs import split_model, target_logprobs
from agent_gym_train.backends.runtime import autocast

DEFAULT_MAX_ROWS = 64
DEFAULT_KV_CACHE_BYTES = 1 << 30
LOGPROB_CHUNK = 512


def sampling_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A frozen copy of ``model``'s current weights for a sampler, in ``dtype``.

    float32 keeps the model as it is (LoRA unmerged): with tied embeddings, merging the
    ``lm_head`` adapter would also change the input embedding the trained model does not
    change. A bfloat16 copy is made to be read fast, so its adapters are merged (one weight
    per layer to stream, not three) after untying the head from the embedding, each weight
    rounded once from its float32 sum.
    """
    snapshot = copy.deepcopy(model)
    for parameter in snapshot.parameters():
        parameter.grad = None
    if dtype == torch.float32:
        return snapshot
    if isinstance(snapshot, PeftModel):
        inner = snapshot.get_base_model()
        head = inner.get_output_embeddings()
        base_head = getattr(head, "base_layer", head)
        if base_head.weight is inner.get_input_embeddings().weight:
            base_head.weight = torch.nn.Parameter(base_head.weight.detach().clone())
        with warnings.catch_warnings():  # peft's advice on untying; done above
            warnings.filterwarnings("ignore", message=".*tie(d)?_word_embeddings.*")
            snapshot = snapshot.merge_and_unload()
    return snapshot.to(dtype)


def lay_out_for_decoding(model: torch.nn.Module) -> None:
    """Store every float32 linear layer's weight transposed in memory (same values, same
    shape).

    A decode step multiplies a few rows by each weight. MKL's CPU GEMM on a row-major
    ``[out, in]`` weight (``x @ W.T``) is pathologically slow for 4-15 rows (measured with
    SmolLM2-135M at one thread: 14 rows took 97 ms over the 30 layers' linears against 70 ms
    for 16 rows) and the ``[in, out]`` layout is not; a whole decode step of 14 rows at 900
    positions went from 256 to 176 ms, one row from 57 to 53 ms. ``F.linear`` reads the
    strides, so nothing else changes; values are bit-identical. Only the sampler's frozen
    copy is re-laid: a training model keeps the layout its optimizer state was built on.
    bfloat16 weights keep theirs: oneDNN's bf16 GEMM is the faster on ``[out, in]``
    (SmolLM2-135M, one thread, 400 positions: a decode step of 1 row 55 against 91 ms, of 8
    rows 77 against 108 ms).
    """
    with torch.no_grad():
        for module in model.modules():
            if (isinstance(module, torch.nn.Linear) and module.weight.is_contiguous()
                    and module.weight.dtype == torch.float32):
                module.weight.data = module.weight.data.t().contiguous().t()


class LocalSamplingClient:
    """Samples from a fixed copy of some weights; training never changes it afterwards.

    Args:
        max_rows: rows decoded together at most (more wait for room; a single call larger
            than this runs alone).
        kv_cache_bytes: memory for keys/values kept between calls for prefix reuse (0 turns
            reuse off). It lives and dies with this client, i.e. with these weights.
        scoring_cache_bytes: the same for ``compute_logprobs``'s own prefix cache (keys,
            values and logprobs of scored prompts); ``None``: as much as ``kv_cache_bytes``,
            so in the worst case the sampler holds twice that.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        model_id: str,
        *,
        max_rows: int = DEFAULT_MAX_ROWS,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        scoring_cache_bytes: int | None = None,
    ) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.device = next(model.parameters()).device
        if self.device.type == "cpu":
            lay_out_for_decoding(self.model)
        self.context_length = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self._body, self._head = split_model(self.model)
        self.engine = BatchEngine(
            self.model, tokenizer, self.device, max_rows=max_rows,
            prefix_cache=PrefixCache(kv_cache_bytes),
        )
        self._scored = PrefixCache(
            kv_cache_bytes if scoring_cache_bytes is None else scoring_cache_bytes)

    @property
    def stats(self) -> EngineStats:
        """Prefill / reuse / decode counters of this sampler's engine."""
        return self.engine.stats

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

    # ----------------------------------------------------------------- public surface
    def sample(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        return_text: bool = True,
    ) -> APIFuture[SampleResponse]:
        request, tokens = self._request(prompt, num_samples, sampling_params,
                                        topk_prompt_logprobs)
        sequences = self.engine.submit(request).result()
        prompt_logprobs = (
            self.engine.run(lambda: self._prompt_logprobs(tokens)).result()
            if include_prompt_logprobs else []
        )
        return APIFuture.completed(self._response(tokens, sequences, prompt_logprobs,
                                                  return_text))

    async def sample_async(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        return_text: bool = True,
    ) -> SampleResponse:
        request, tokens = self._request(prompt, num_samples, sampling_params,
                                        topk_prompt_logprobs)
        sequences = await asyncio.wrap_future(self.engine.submit(request))
        prompt_logprobs = (
            await asyncio.wrap_future(self.engine.run(lambda: self._prompt_logprobs(tokens)))
            if include_prompt_logprobs else []
        )
        return self._response(tokens, sequences, prompt_logprobs, return_text)

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        tokens = self._tokens(prompt)
        return APIFuture.completed(self.engine.run(lambda: self._prompt_logprobs(tokens)).result())

    async def compute_logprobs_async(self, prompt: ModelInput) -> list[float | None]:
        tokens = self._tokens(prompt)
        return await asyncio.wrap_future(self.engine.run(lambda: self._prompt_logprobs(tokens)))

    # ----------------------------------------------------------------- implementation
    def _tokens(self, prompt: ModelInput) -> list[int]:
        if not isinstance(prompt, ModelInput):
            raise TypeError(f"prompt must be a pytrio ModelInput, got {type(prompt).__name__}")
        tokens = prompt.to_ints()
        if not tokens:
            raise ValueError("prompt cannot be empty")
        vocab = self.model.get_input_embeddings().num_embeddings
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(tokens) >= self.context_length:
            raise ValueError(
                f"prompt has {len(tokens)} tokens; the model's context is {self.context_length}"
            )
        return tokens

    def _request(
        self,
        prompt: ModelInput,
        num_samples: int,
        params: SamplingParams | None,
        topk_prompt_logprobs: int,
    ) -> tuple[SampleRequest, list[int]]:
        params = params or SamplingParams()
        tokens = self._tokens(prompt)
        if params.max_tokens is None or params.max_tokens <= 0:
            raise ValueError("sampling_params.max_tokens must be greater than 0")
        if num_samples < 1:
            raise ValueError(f"num_samples must be at least 1, got {num_samples}")
        if topk_prompt_logprobs:
            raise ValueError("topk_prompt_logprobs is not supported by the local backend")
        if params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_k == 0:
            raise ValueError(
                "sampling needs temperature >= 0, 0 < top_p <= 1 and top_k > 0 or -1"
            )
        stop_ids, stop_strings = self._stops(params.stop)
        # An unseeded call still gets per-row generators, seeded from torch's global RNG.
        seed = params.seed if params.seed is not None else int(torch.randint(1 << 62, ()))
        request = SampleRequest(
            prompt=tokens,
            num_samples=num_samples,
            params=params,
            budget=min(params.max_tokens, self.context_length - len(tokens)),
            stop_ids=frozenset(stop_ids),
            stop_strings=tuple(stop_strings),
            seed=seed,
        )
        return request, tokens

    def _response(
        self,
        tokens: list[int],
        sequences: list[tuple[list[int], list[float], str]],
        prompt_logprobs: list[float | None],
        return_text: bool,
    ) -> SampleResponse:
        out = [
            SampleSequence(
                stop_reason=reason,
                tokens=seq,
                logprobs=lps,
                text=self.tokenizer.decode(seq) if return_text else None,
            )
            for seq, lps, reason in sequences
        ]
        return SampleResponse(
            sequences=out,
            prompt_logprobs=prompt_logprobs,
            input_tokens=len(tokens),
            output_tokens=sum(len(s.tokens) for s in out),
        )

    def _stops(
        self, stop: str | Sequence[str] | Sequence[int] | None
    ) -> tuple[set[int], list[str]]:
        if stop is None:
            eos = self.tokenizer.eos_token_id
            return ({eos} if eos is not None else set()), []
        if isinstance(stop, str):
            return set(), [stop]
        items = list(stop)
        if all(isinstance(s, int) and not isinstance(s, bool) for s in items):
            return set(items), []
        if all(isinstance(s, str) for s in items):
            return set(), items
        raise ValueError("stop must be a string, a list of strings or a list of token ids")

    def _prompt_logprobs(self, tokens: list[int]) -> list[float | None]:
        """Runs on the engine's thread (``engine.run``).

        The longest scored prefix is reused but for its last position, which runs again:
        its hidden state, not kept, is what scores the first new token. A prompt scored
        before (or a prefix of one) runs nothing and gets the very same logprobs."""
        entry, shared = self._scored.longest_prefix(tokens, limit=len(tokens))
        if entry is not None and shared == len(tokens):  # scored before, as a whole or a part
            self.stats.scored_reused_tokens += shared
            return [None, *entry.logprobs[1:shared].tolist()]
        start = max(shared - 1, 0) if entry is not None else 0
        past = DynamicCache(ddp_cache_data=entry.cropped(start)) if start else DynamicCache()
        ids = torch.tensor([tokens[start:]], device=self.device)
        positions = torch.arange(start, len(tokens), device=self.device)[None]
        with torch.inference_mode(), autocast(self.device):
            out = self._body(input_ids=ids, position_ids=positions, cache=past, use_cache=True)
            picked = target_logprobs(self._head, out.last_hidden_state[0, :-1], ids[0, 1:],
                                     LOGPROB_CHUNK).float().cpu().numpy()
        known = entry.logprobs[: start + 1] if start else np.array([np.nan])
        logprobs = np.concatenate([known, picked])
        if self._scored.max_bytes:
            self._scored.put(tokens, tuple((layer.keys, layer.values)
                                           for layer in out.cache.layers), logprobs)
        self.stats.scored_reused_tokens += start
        return [None, *logprobs[1:].tolist()]
