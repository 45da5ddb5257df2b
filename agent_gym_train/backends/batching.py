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
* **Ragged rows in one batch.** Rows have different lengths; each row's keys/values sit in
  its own slot of one buffer, left-aligned, the columns past its length masked out of
  attention, and every row is fed its own position ids, so a row's logits are those it
  would get alone (up to float rounding). A joining row is written into a free slot and a
  leaving row's slot is refilled by the last row, so neither event copies the rest of the
  batch (an earlier layout re-padded every row on each join and leave: O(rows x context)
  per event, a fifth of a multi-turn rollout's time).
* **Reproducible draws.** Every row has its own ``torch.Generator`` seeded from (call seed,
  row index) and draws with the Gumbel-max trick from its own noise. What a row samples
  therefore depends on its own seed and logits only, not on which other calls happened to
  share the batch or in which order they arrived. (Its logits can differ in the last float
  bits with the batch shape; that changes a draw only if two tokens' perturbed scores tie
  to within that rounding.)
* **Prefix reuse.** A prefilled prompt and a finished row leave their keys/values in the
  sampler's ``PrefixCache`` (see ``kvcache``): the branch's next turn prefills only its new
  tokens, and calls sharing an opening (a system prompt) prefill it once.

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

from agent_gym_train.backends.kvcache import LayerKV, PrefixCache
from agent_gym_train.backends.runtime import autocast

STOP = "stop"
LENGTH = "length"
# Columns reserved past a joining prompt, so the batch is not reallocated at its first steps.
SPARE_COLUMNS = 64

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
    scored_reused_tokens: int = 0  # compute_logprobs positions read from its own cache
    decode_steps: int = 0
    decoded_rows: int = 0  # sum over steps of rows in the batch
    max_batch_rows: int = 0
    steps_by_rows: dict[int, int] = field(default_factory=dict)  # rows in the batch -> steps
    busy_seconds: float = 0.0  # wall time spent prefilling and decoding
    prefill_seconds: float = 0.0  # the part of it spent admitting calls (prefill, joining)
    busy_cpu_seconds: float = 0.0  # CPU time of the engine thread meanwhile (load-robust)


class _SlotLayer(DynamicLayer):
    """One layer's keys/values of the batch: row ``i`` of the batch lives in slot ``i``.

    A slot holds its row's positions left-aligned (column ``c`` = the row's position ``c``)
    in a buffer with spare rows and columns, so rows of different lengths need no padding
    moves: a decode step writes each row's new key at that row's own length, and the
    attention mask hides every column at or past it. Joining writes one row into a free
    slot and leaving moves at most one row (the last) into the freed slot, so neither
    copies the rest of the batch; the buffer is reallocated only when it runs out of room,
    growing geometrically, so that is amortised O(1) per token.
    """

    def __init__(self, like: torch.Tensor, value_dim: int) -> None:
        super().__init__()
        _, self.heads, _, self.key_dim = like.shape
        self.value_dim = value_dim
        self._keys = like.new_zeros(0, self.heads, 0, self.key_dim)
        self._values = like.new_zeros(0, self.heads, 0, value_dim)
        self.device, self.dtype, self.is_initialized = like.device, like.dtype, True
        self.write_at: torch.Tensor | None = None  # per row: the column the next key goes to
        self.show(0, 0)

    def reserve(self, rows: int, width: int, keep: int) -> None:
        """Room for ``rows`` slots of ``width`` columns, keeping what the first ``keep`` slots
        hold. A reallocation sizes the rows to the need plus a quarter (so single rows can
        join without one, and a batch that has shrunk gives its memory back) and grows the
        columns by half, so reallocations stay rare and amortised O(1) per token."""
        have_rows, have_width = self._keys.shape[0], self._keys.shape[2]
        if rows <= have_rows and width <= have_width:
            return
        new_rows = rows + rows // 4 + 2
        new_width = max(width, have_width + have_width // 2 + 64) if width > have_width \
            else have_width
        self._keys = _regrow(self._keys, new_rows, new_width, keep)
        self._values = _regrow(self._values, new_rows, new_width, keep)

    def place(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write one row's keys/values ([1, heads, length, dim]) into ``slot``."""
        length = keys.shape[2]
        self._keys[slot, :, :length] = keys[0]
        self._values[slot, :, :length] = values[0]

    def move(self, source: int, target: int, length: int) -> None:
        self._keys[target, :, :length] = self._keys[source, :, :length]
        self._values[target, :, :length] = self._values[source, :, :length]

    def row(self, slot: int, length: int) -> LayerKV:
        """Views of one slot's first ``length`` positions (callers copy what they keep)."""
        return self._keys[slot : slot + 1, :, :length], self._values[slot : slot + 1, :, :length]

    def show(self, rows: int, width: int) -> None:
        """What the model sees as the cache: the first ``rows`` slots, ``width`` columns."""
        self.keys, self.values = self._keys[:rows, :, :width], self._values[:rows, :, :width]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Decode only: one new position per row, written at the row's own length.
        assert self.write_at is not None and key_states.shape[2] == 1
        rows, width = self.keys.shape[0], self.keys.shape[2]
        slots = torch.arange(rows, device=key_states.device)
        self._keys[slots, :, self.write_at] = key_states[:, :, 0]
        self._values[slots, :, self.write_at] = value_states[:, :, 0]
        self.show(rows, width + 1)
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
        self._incoming = 0  # rows admitted in this round that have not joined yet
        self._done: list[SampleRequest] = []  # finished in this round, resolved at its end

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
                    self._incoming = sum(r.num_samples for r in admitted)
                    for request in admitted:
                        self._incoming -= request.num_samples
                        self._admit(request)
                    self.stats.prefill_seconds += time.perf_counter() - started
                    if self._rows:
                        self._step()
                self.stats.busy_seconds += time.perf_counter() - started
                self.stats.busy_cpu_seconds += time.thread_time() - started_cpu
            except Exception as error:
                self._fail_all(error, admitted)
            finally:
                self._deliver()

    def _deliver(self) -> None:
        """Resolve the calls finished in this round, after its last torch operation.

        A caller may exit as soon as its future resolves; if this daemon thread were then
        still inside a torch operation (which releases the GIL), re-taking the GIL during
        interpreter shutdown would end the thread by unwinding through C++ frames that
        forbid it, and the process would abort ("terminate called without an active
        exception"). After delivery the thread only runs plain Python until it idles.
        """
        done, self._done = self._done, []
        for request in done:
            if not request.future.done():
                request.future.set_result([r for r in request.results if r is not None])

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
            if request.remaining and not request.future.done():  # finished ones are delivered
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
        if self.prefix_cache.max_bytes:
            # The prefill's tensors are its own (concatenated, not views of an entry): kept as
            # they are. Calls admitted after this one find their shared prefix (a system
            # prompt, a group's opening) even before any row of this call finishes.
            self.prefix_cache.put(prompt, layers)
        logits = out.logits[:, -1].float()
        rows = [
            _Row(request, i, torch.Generator().manual_seed(row_seed(request.seed, i)),
                 len(prompt))
            for i in range(request.num_samples)
        ]
        joining = []
        for row, token in zip(rows, self._draw(rows, logits.expand(len(rows), -1)), strict=True):
            if self._emit(row, token):
                self._finish(row, layers)
            else:
                joining.append(row)
        if joining:
            self._join(joining, layers)

    def _join(self, rows: list[_Row], layers: tuple[LayerKV, ...]) -> None:
        """Add rows sharing one prompt's keys/values ([1, h, L, d] per layer) to the batch:
        each is written into its own slot; the rows already there are not touched."""
        if self._cache is None:
            self._cache = Cache(layers=[_SlotLayer(k, v.shape[-1]) for k, v in layers])
        first, length = len(self._rows), layers[0][0].shape[2]
        for layer, (k, v) in zip(self._cache.layers, layers, strict=True):
            # Room for the calls admitted with this one too: one reallocation, not one each.
            layer.reserve(first + len(rows) + self._incoming,
                          length + min(rows[0].request.budget, SPARE_COLUMNS), keep=first)
            for slot in range(first, first + len(rows)):
                layer.place(slot, k, v)
        self._rows.extend(rows)

    # ----------------------------------------------------------------- decode
    def _step(self) -> None:
        assert self._cache is not None
        rows, layers = self._rows, self._cache.layers
        width = max(row.length for row in rows)
        lengths = torch.tensor([row.length for row in rows], device=self.device)
        for layer in layers:
            layer.reserve(len(rows), width + 1, keep=len(rows))
            layer.show(len(rows), width)
            layer.write_at = lengths
        # Row i's positions are columns [0, length); its new one goes to column `length`.
        mask = (torch.arange(width + 1, device=self.device)[None] <= lengths[:, None]).long()
        feed = torch.tensor([[row.tokens[-1]] for row in rows], device=self.device)
        out = self.model(input_ids=feed, attention_mask=mask, position_ids=lengths[:, None],
                         cache=self._cache, use_cache=True)
        self.stats.decode_steps += 1
        self.stats.decoded_rows += len(rows)
        self.stats.max_batch_rows = max(self.stats.max_batch_rows, len(rows))
        self.stats.steps_by_rows[len(rows)] = self.stats.steps_by_rows.get(len(rows), 0) + 1
        for row in rows:
            row.length += 1
        chosen = self._draw(rows, out.logits[:, -1].float())
        finished = [i for i, (row, token) in enumerate(zip(rows, chosen, strict=True))
                    if self._emit(row, token)]
        # From the highest slot down, so the last slot is always a row that stays (or the
        # finished row itself): it moves into the freed slot, nothing else moves.
        for i in reversed(finished):
            self._finish(rows[i], tuple(layer.row(i, rows[i].length) for layer in layers))
            last = len(rows) - 1
            if i != last:
                for layer in layers:
                    layer.move(last, i, rows[last].length)
                rows[i] = rows[last]
            rows.pop()
        if not rows:
            self._cache = None  # an idle engine holds no batch memory

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

    def _finish(self, row: _Row, layers: tuple[LayerKV, ...]) -> None:
        """Resolve the row; cache the keys/values of prompt + completion[:-1] it computed
        (``layers``: exactly those positions, possibly views of the batch, copied here)."""
        request = row.request
        known = request.prompt + row.tokens[:-1]
        if self.prefix_cache.max_bytes:
            self.prefix_cache.put(known, tuple((k.clone(), v.clone()) for k, v in layers))
        request.results[row.index] = (row.tokens, row.logprobs, row.reason)
        request.remaining -= 1
        if request.remaining == 0:
            self._done.append(request)

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
                # Each row's uniforms go straight into one buffer, turned into log(-log u) in
                # place: the same values as stacking fresh tensors, at half the time.
                noise = torch.empty(len(members), logp.shape[-1], dtype=torch.float64)
                for j, i in enumerate(members):
                    torch.rand(logp.shape[-1], generator=rows[i].generator, dtype=torch.float64,
                               out=noise[j])
                noise = noise.log_().neg_().log_().to(logits.device)
                chosen = (logp - noise).argmax(dim=-1)
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


def _regrow(buffer: torch.Tensor, rows: int, width: int, keep: int) -> torch.Tensor:
    """A [rows, heads, width, dim] buffer holding ``buffer``'s first ``keep`` slots, zero
    elsewhere: masked columns get zero attention weight, and 0 * NaN would not be 0."""
    keep_width = min(buffer.shape[2], width)
    out = buffer.new_empty(rows, buffer.shape[1], width, buffer.shape[3])
    out[:keep, :, :keep_width] = buffer[:keep, :, :keep_width]
    out[:keep, :, keep_width:] = 0
    out[keep:] = 0
    return out


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
