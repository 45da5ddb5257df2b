"""Local sampling with pytrio's ``SamplingClient`` surface and real per-token logprobs.

``num_samples`` sequences from one prompt share a single prefill: the prompt's key/value
cache is computed once and repeated, which is what makes GRPO's N branches per task cheap.
Each returned token carries its logprob under the distribution it was drawn from
(temperature, top-k and top-p applied); with the defaults (temperature 1, no filtering) that
is exactly the model's logprob, so a fresh sampler's logprobs match ``compute_logprobs`` and
the importance ratio of an on-policy update starts at 1. A temperature of 0 picks the most
likely token and reports the model's own logprob of it.

A sequence stops at a stop token or stop string (kept in the returned tokens, as pytrio
does) with ``stop_reason="stop"``, or at ``max_tokens`` / the context limit with
``stop_reason="length"``. Without ``stop`` the tokenizer's end-of-sequence token stops.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from pytrio import ModelInput, SamplingParams
from pytrio.types import APIFuture, SampleResponse, SampleSequence
from transformers import PreTrainedModel, PreTrainedTokenizerBase

STOP = "stop"
LENGTH = "length"


class LocalSamplingClient:
    """Samples from a fixed copy of some weights; training never changes it afterwards."""

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, model_id: str
    ) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.context_length = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        # One worker thread: torch already uses every core for one batch, and calls from
        # concurrent rollouts must not interleave their caches.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-sampler")
        self._lock = threading.Lock()

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
        return APIFuture.completed(
            self._sample(
                prompt, num_samples, sampling_params, include_prompt_logprobs,
                topk_prompt_logprobs, return_text,
            )
        )

    async def sample_async(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        return_text: bool = True,
    ) -> SampleResponse:
        return await asyncio.get_running_loop().run_in_executor(
            self._executor,
            self._sample,
            prompt, num_samples, sampling_params, include_prompt_logprobs,
            topk_prompt_logprobs, return_text,
        )

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        return APIFuture.completed(self._prompt_logprobs(self._tokens(prompt)))

    async def compute_logprobs_async(self, prompt: ModelInput) -> list[float | None]:
        tokens = self._tokens(prompt)
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self._prompt_logprobs, tokens
        )

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

    def _sample(
        self,
        prompt: ModelInput,
        num_samples: int,
        params: SamplingParams | None,
        include_prompt_logprobs: bool,
        topk_prompt_logprobs: int,
        return_text: bool,
    ) -> SampleResponse:
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
        with self._lock, torch.inference_mode():
            sequences = self._generate(tokens, num_samples, params, stop_ids, stop_strings)
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
            prompt_logprobs=self._prompt_logprobs(tokens) if include_prompt_logprobs else [],
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

    def _generate(
        self,
        prompt: list[int],
        n: int,
        params: SamplingParams,
        stop_ids: set[int],
        stop_strings: list[str],
    ) -> list[tuple[list[int], list[float], str]]:
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        out = self.model(input_ids=torch.tensor([prompt]), use_cache=True)
        cache = out.cache
        cache.batch_repeat_interleave(n)
        logits = out.logits[:, -1, :].float().expand(n, -1)
        budget = min(params.max_tokens or 0, self.context_length - len(prompt))
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        for _ in range(budget):
            chosen, chosen_logprobs = _draw(logits, params, generator)
            for i in range(n):
                if reasons[i] is not None:
                    continue
                token = int(chosen[i])
                tokens[i].append(token)
                logprobs[i].append(float(chosen_logprobs[i]))
                if token in stop_ids or (
                    stop_strings and _ends_with_stop(self.tokenizer, tokens[i], stop_strings)
                ):
                    reasons[i] = STOP
            if all(r is not None for r in reasons):
                break
            step = self.model(input_ids=chosen[:, None], cache=cache, use_cache=True)
            cache = step.cache
            logits = step.logits[:, -1, :].float()
        return [(t, lp, r or LENGTH) for t, lp, r in zip(tokens, logprobs, reasons, strict=True)]

    def _prompt_logprobs(self, tokens: list[int]) -> list[float | None]:
        with self._lock, torch.inference_mode():
            logits = self.model(input_ids=torch.tensor([tokens])).logits[0].float()
        logp = torch.log_softmax(logits[:-1], dim=-1)
        picked = logp.gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1)
        return [None, *picked.tolist()]


def _draw(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row, and its logprob under the distribution it was drawn from."""
    if params.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        chosen = logp.argmax(dim=-1)
        return chosen, logp.gather(1, chosen[:, None]).squeeze(1)
    scaled = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(scaled, min(params.top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1:
        ordered, order = torch.sort(scaled, dim=-1, descending=True)
        before = torch.softmax(ordered, dim=-1).cumsum(dim=-1) - torch.softmax(ordered, dim=-1)
        drop = before >= params.top_p  # keep the smallest prefix whose mass reaches top_p
        scaled = scaled.scatter(1, order, ordered.masked_fill(drop, float("-inf")))
    logp = torch.log_softmax(scaled, dim=-1)
    chosen = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
    return chosen, logp.gather(1, chosen[:, None]).squeeze(1)


def _ends_with_stop(
    tokenizer: PreTrainedTokenizerBase, tokens: list[int], stops: list[str]
) -> bool:
    longest = max(len(s) for s in stops)
    # A stop string spans at most `longest` tokens; decoding a short tail keeps this O(1).
    tail = tokenizer.decode(tokens[-longest - 1 :])
    return any(s in tail for s in stops)
