"""One decoding loop for every concurrent sampling call of a local sampler.

Rollouts call ``sample_async`` from many coroutines at once: every group's first turn, every
branch's later turns, critic samples. Serving them one call at a time leaves the CPU doing
matrix-vector products for one row; decoding them together turns each step into one
matrix-matrix product over all rows, which costs little more than one row. So calls go to a
queue, and one worker thread runs a continuous batch:

* **Join and leave.** Before every decode step, waiting calls are admitted (up to
  ``max_rows`` rows): each is prefilled on its own (batch 1, only the tokens the prefix cache
  does not hold), its ``num_samples`` rows draw their first token from the prefill's logits
  and join the batch. A row that stops (stop token or string, ``max_tokens``, the context)
  leaves at once; nobody decodes on for it. A call's future resolves when its last row stops.
* **Ragged rows in one batch.** Rows have different lengths; their keys/values are kept
  left-padded to a common width, padding masked out of attention, and every row is fed its
  own position ids, so a row's logits are those it would get alone (up to float rounding).
  The width shrinks again when the longest rows leave.
* **Reproducible draws.** Every row has its own ``torch.Generator`` seeded from (call seed,
  row index) and draws with the Gumbel-max trick from its own noise. What a row samples
  therefore depends on its own seed and logits only, not on which other calls happened to
  share the batch or in which order they arrived. (Its logits can differ in the last float
  bits with the batch shape; that changes a draw only if two tokens' perturbed scores tie
  to within that rounding.)
* **Prefix reuse.** A finished row leaves its keys/values in the sampler's ``PrefixCache``
  (see ``kvcache``), so the branch's next turn prefills only its new tokens.

Other model work of the sampler (``compute_logprobs``) runs on the same thread between
decode steps, so the model is never used by two threads at once and the process never
runs more torch work than its thread policy allows.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from pytrio import SamplingParams
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache, DynamicLayer

from trainers.backends.kvcache import LayerKV, PrefixCache
from trainers.backends.runtime import autocast

STOP = "stop"
LENGTH = "length"

# (tokens, logprobs, stop_reason) of one sampled sequence.
Sampled = tuple[list[int], list[float], str]


def row_seed(seed: int, row: int) -> int:
    """The generator seed of row ``row`` of a call seeded ``seed`` (63-bit, well mixed)."""
    digest = hashlib.blake2b(f"{seed}/{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


@dataclass
class SampleRequest:
    """One ``sample`` call: ``num_samples`` rows from one prompt."""

    prompt: list[int]
    num_samples: int
    params: SamplingParams
    budget: int  # tokens each row may sample (max_tokens, bounded by the context)
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    seed: int
    future: Future[list[Sampled]] = field(default_factory=Future)
    results: list[Sampled | None] = field(default_factory=list)
    remaining: int = 0


@dataclass(eq=False)
class _Row:
    request: SampleRequest
    index: int
    generator: torch.Generator
    length: int  # positions whose keys/values are in the batch
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reason: str = LENGTH


@dataclass
class EngineStats:
    """Counters for benchmarks and tests: what was prefilled and decoded."""

    prefill_tokens: int = 0  # tokens run through the model to build prompts' keys/values
    reused_tokens: int = 0  # prompt tokens whose keys/values came from the prefix cache
    decode_steps: int = 0
    decoded_rows: int = 0  # sum over steps of rows in the batch
    max_batch_rows: int = 0
    busy_seconds: float = 0.0  # wall time spent prefilling and decoding
    busy_cpu_seconds: float = 0.0  # CPU time of the engine thread meanwhile (load-robust)


class _GrowingLayer(DynamicLayer):
    """A batch's keys/values for one layer, in a buffer with spare columns.

    ``DynamicLayer.update`` concatenates, copying the whole cache at every decode step
    (O(width) per token); here a step writes its column in place and the buffer doubles when
    full, so appending is amortised O(1). ``keys``/``values`` are views of the used columns.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.reset_to(keys, values)

    def reset_to(self, keys: torch.Tensor, values: torch.Tensor, spare: int = 64) -> None:
        rows, heads, width, dim = keys.shape
        self._keys = keys.new_empty(rows, heads, width + spare, dim)
        self._values = values.new_empty(rows, heads, width + spare, values.shape[-1])
        self._keys[:, :, :width] = keys
        self._values[:, :, :width] = values
        self.width = width
        self.keys, self.values = self._keys[:, :, :width], self._values[:, :, :width]
        self.device, self.dtype, self.is_initialized = keys.device, keys.dtype, True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        new = key_states.shape[2]
        if self.width + new > self._keys.shape[2]:
            self.reset_to(self.keys, self.values, spare=max(64, self.width))
        self._keys[:, :, self.width : self.width + new] = key_states
        self._values[:, :, self.width : self.width + new] = value_states
        self.width += new
        self.keys, self.values = self._keys[:, :, : self.width], self._values[:, :, : self.width]
        return self.keys, self.values


class BatchEngine:
    """The queue and the decode loop; owned by one ``LocalSamplingClient``.

    The worker thread exists only while there is work: it starts on the first submission and
    ends when the queue and the batch are empty, so an idle sampler holds no thread and is
    freed (with its prefix cache) as soon as its client is.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        device: torch.device,
        *,
        max_rows: int,
        prefix_cache: PrefixCache,
    ) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.max_rows = max_rows
        self.prefix_cache = prefix_cache
        self.stats = EngineStats()
        self._pending: list[SampleRequest] = []
        self._jobs: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._lock = threading.Lock()
        self._running = False
        # The batch: rows, and per layer keys/values [rows, kv_heads, width, head_dim].
        self._rows: list[_Row] = []
        self._cache: Cache | None = None

    # ----------------------------------------------------------------- submission
    def submit(self, request: SampleRequest) -> Future[list[Sampled]]:
        request.results = [None] * request.num_samples
        request.remaining = request.num_samples
        with self._lock:
            self._pending.append(request)
            self._start()
        return request.future

    def run(self, job: Callable[[], Any]) -> Future[Any]:
        """Run ``job`` on the engine's thread between decode steps."""
        future: Future[Any] = Future()
        with self._lock:
            self._jobs.append((job, future))
            self._start()
        return future

    def _start(self) -> None:  # under self._lock
        if not self._running:
            self._running = True
            threading.Thread(target=self._loop, name="local-sampler", daemon=True).start()

    # ----------------------------------------------------------------- the loop
    def _loop(self) -> None:
        while True:
            with self._lock:
                jobs, self._jobs = self._jobs, []
                admitted = self._take_admissible()
                if not (jobs or admitted or self._rows):
                    self._running = False
                    return
            for job, future in jobs:
                _settle(future, job)
            started, started_cpu = time.perf_counter(), time.thread_time()
            try:
                with torch.inference_mode(), autocast(self.device):
                    for request in admitted:
                        self._admit(request)
                    if self._rows:
                        self._step()
                self.stats.busy_seconds += time.perf_counter() - started
                self.stats.busy_cpu_seconds += time.thread_time() - started_cpu
            except Exception as error:
                self._fail_all(error, admitted)

    def _take_admissible(self) -> list[SampleRequest]:  # under self._lock
        taken: list[SampleRequest] = []
        room = self.max_rows - len(self._rows)
        while self._pending:
            request = self._pending[0]
            # A call larger than the whole batch still runs, alone.
            if request.num_samples > room and (self._rows or taken):
                break
            taken.append(self._pending.pop(0))
            room -= request.num_samples
        return taken

    def _fail_all(self, error: BaseException, admitted: Sequence[SampleRequest]) -> None:
        requests = {id(r.request): r.request for r in self._rows}
        requests.update({id(r): r for r in admitted})
        self._rows, self._cache = [], None
        for request in requests.values():
            if not request.future.done():
                request.future.set_exception(error)

    # ----------------------------------------------------------------- prefill
    def _admit(self, request: SampleRequest) -> None:
        prompt = request.prompt
        entry, reused = self.prefix_cache.longest_prefix(prompt, limit=len(prompt) - 1)
        # Building the cache copies the entry's tensors: the entry itself is never written.
        past = DynamicCache(ddp_cache_data=entry.cropped(reused)) if entry else DynamicCache()
        new = torch.tensor([prompt[reused:]], device=self.device)
        positions = torch.arange(reused, len(prompt), device=self.device)[None]
        out = self.model(input_ids=new, position_ids=positions, cache=past, use_cache=True,
                         logits_to_keep=1)
        self.stats.prefill_tokens += len(prompt) - reused
        self.stats.reused_tokens += reused
        layers = tuple((layer.keys, layer.values) for layer in out.cache.layers)
        logits = out.logits[:, -1].float()
        rows = [
            _Row(request, i, torch.Generator().manual_seed(row_seed(request.seed, i)),
                 len(prompt))
            for i in range(request.num_samples)
        ]
        joining = []
        for row, token in zip(rows, self._draw(rows, logits.expand(len(rows), -1)), strict=True):
            if self._emit(row, token):
                self._finish(row, layers, 0)
            else:
                joining.append(row)
        if joining:
            self._join(joining, layers)

    def _join(self, rows: list[_Row], layers: tuple[LayerKV, ...]) -> None:
        """Add rows sharing one prompt's keys/values ([1, h, L, d] per layer) to the batch."""
        count = len(rows)
        length = layers[0][0].shape[2]
        if self._cache is None:
            self._cache = Cache(layers=[
                _GrowingLayer(k.expand(count, -1, -1, -1), v.expand(count, -1, -1, -1))
                for k, v in layers
            ])
        else:
            width = self._cache.layers[0].keys.shape[2]
            grow = max(0, length - width)
            pad = width + grow - length
            for layer, (k, v) in zip(self._cache.layers, layers, strict=True):
                layer.reset_to(
                    torch.cat([_left_pad(layer.keys, grow),
                               _left_pad(k, pad).expand(count, -1, -1, -1)]),
                    torch.cat([_left_pad(layer.values, grow),
                               _left_pad(v, pad).expand(count, -1, -1, -1)]),
                )
        self._rows.extend(rows)

    # ----------------------------------------------------------------- decode
    def _step(self) -> None:
        assert self._cache is not None
        rows = self._rows
        width = self._cache.layers[0].keys.shape[2]
        lengths = torch.tensor([row.length for row in rows], device=self.device)
        columns = torch.arange(width + 1, device=self.device)
        # Row i holds its `length` real positions right-aligned in `width`, then the new one.
        mask = (columns[None] >= width - lengths[:, None]).long()
        feed = torch.tensor([[row.tokens[-1]] for row in rows], device=self.device)
        out = self.model(input_ids=feed, attention_mask=mask, position_ids=lengths[:, None],
                         cache=self._cache, use_cache=True)
        self.stats.decode_steps += 1
        self.stats.decoded_rows += len(rows)
        self.stats.max_batch_rows = max(self.stats.max_batch_rows, len(rows))
        for row in rows:
            row.length += 1
        chosen = self._draw(rows, out.logits[:, -1].float())
        keep = [i for i, (row, token) in enumerate(zip(rows, chosen, strict=True))
                if not self._emit(row, token)]
        if len(keep) == len(rows):
            return
        width += 1
        layers = self._cache.layers
        for i, row in enumerate(rows):
            if i not in keep:
                self._finish(row, tuple((layer.keys[i : i + 1], layer.values[i : i + 1])
                                        for layer in layers), width - row.length)
        self._rows = [rows[i] for i in keep]
        if not self._rows:
            self._cache = None
            return
        # Drop the finished rows, and the columns only they were using.
        start = width - max(row.length for row in self._rows)
        index = torch.tensor(keep, device=self.device)
        for layer in layers:
            layer.reset_to(layer.keys.index_select(0, index)[:, :, start:],
                           layer.values.index_select(0, index)[:, :, start:])

    def _emit(self, row: _Row, token: tuple[int, float]) -> bool:
        """Append a drawn token; True when the row is finished."""
        request = row.request
        row.tokens.append(token[0])
        row.logprobs.append(token[1])
        stop_string = bool(request.stop_strings) and _ends_with_stop(
            self.tokenizer, row.tokens, request.stop_strings
        )
        if token[0] in request.stop_ids or stop_string:
            row.reason = STOP
        elif len(row.tokens) >= request.budget:
            row.reason = LENGTH
        else:
            return False
        return True

    def _finish(self, row: _Row, layers: tuple[LayerKV, ...], padding: int) -> None:
        """Resolve the row; cache the keys/values of prompt + completion[:-1] it computed."""
        request = row.request
        known = request.prompt + row.tokens[:-1]
        if self.prefix_cache.max_bytes:
            self.prefix_cache.put(
                known, tuple((k[:, :, padding:].clone(), v[:, :, padding:].clone())
                             for k, v in layers)
            )
        request.results[row.index] = (row.tokens, row.logprobs, row.reason)
        request.remaining -= 1
        if request.remaining == 0 and not request.future.done():
            request.future.set_result([r for r in request.results if r is not None])

    # ----------------------------------------------------------------- drawing
    def _draw(self, rows: Sequence[_Row], logits: torch.Tensor) -> list[tuple[int, float]]:
        """One token per row and its logprob under the distribution it was drawn from."""
        out: list[tuple[int, float]] = [(0, 0.0)] * len(rows)
        by_params: dict[tuple[float, int, float], list[int]] = {}
        for i, row in enumerate(rows):
            p = row.request.params
            by_params.setdefault((p.temperature, p.top_k, p.top_p), []).append(i)
        for (temperature, top_k, top_p), members in by_params.items():
            index = torch.tensor(members, device=logits.device)
            logp = _filtered_logprobs(logits.index_select(0, index), temperature, top_k, top_p)
            if temperature == 0:
                chosen = logp.argmax(dim=-1)
            else:
                # Gumbel-max: argmax(logp + Gumbel noise) is an exact draw from softmax(logp).
                # Unlike inverting the CDF, whose boundaries lie ~1e-7 apart in a 49k-token
                # tail, it flips only if the top two perturbed scores sit within float
                # rounding of each other, so rounding differences between batch shapes
                # (or cached and fresh keys) practically never change a draw.
                uniforms = torch.stack([
                    torch.rand(logp.shape[-1], generator=rows[i].generator, dtype=torch.float64)
                    for i in members
                ]).to(logits.device)
                chosen = (logp.double() - torch.log(-torch.log(uniforms))).argmax(dim=-1)
            picked = logp.gather(1, chosen[:, None]).squeeze(1)
            for i, token, lp in zip(members, chosen.tolist(), picked.tolist(), strict=True):
                out[i] = (token, lp)
        return out


def _filtered_logprobs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """Log-probabilities after temperature, top-k and top-p (the model's own at temperature 0)."""
    if temperature == 0:
        return torch.log_softmax(logits, dim=-1)
    scaled = logits / temperature
    if top_k > 0:
        kth = torch.topk(scaled, min(top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1:
        ordered, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # keep the smallest prefix reaching top_p
        scaled = scaled.scatter(1, order, ordered.masked_fill(drop, float("-inf")))
    return torch.log_softmax(scaled, dim=-1)


def _left_pad(tensor: torch.Tensor, columns: int) -> torch.Tensor:
    """Zero columns before the sequence axis (dim 2); the attention mask hides them."""
    if columns == 0:
        return tensor
    shape = list(tensor.shape)
    shape[2] = columns
    return torch.cat([tensor.new_zeros(shape), tensor], dim=2)


def _ends_with_stop(
    tokenizer: PreTrainedTokenizerBase, tokens: list[int], stops: Sequence[str]
) -> bool:
    longest = max(len(s) for s in stops)
    # A stop string spans at most `longest` tokens; decoding a short tail keeps this O(1).
    tail = tokenizer.decode(tokens[-longest - 1 :])
    return any(s in tail for s in stops)


def _settle(future: Future[Any], job: Callable[[], Any]) -> None:
    try:
        future.set_result(job())
    except Exception as error:
        future.set_exception(error)
