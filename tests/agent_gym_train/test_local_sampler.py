"""The local sampler's batching engine and prefix cache: same samples however calls are batched,
and cached keys/values that give the logits a fresh prefill gives."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from pytrio import ModelInput, SamplingParams
from transformers import DynamicCache

from agent_gym_train.backends.kvcache import PrefixCache
from agent_gym_train.backends.local import LocalServiceClient
from agent_gym_train.backends.sampler import LocalSamplingClient

# Float32 logits of the same positions computed in different batch shapes (left padding,
# other rows, cached vs fresh keys) agree to rounding; these bounds are what is asserted.
LOGPROB_TOL = 1e-5
LOGIT_TOL = 1e-4

PROMPTS = [
    [5, 17, 29, 41, 53, 65, 77],
    [9, 21, 33],
    [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1100],
    [7, 8],
]
# (prompt index, num_samples, params): varied lengths, budgets, filters and a greedy call,
# so rows join and leave the batch at different steps.
CALLS = [
    (0, 3, SamplingParams(max_tokens=9, seed=1)),
    (1, 1, SamplingParams(max_tokens=4, seed=2)),
    (2, 2, SamplingParams(max_tokens=12, seed=3, top_k=50)),
    (3, 1, SamplingParams(max_tokens=6, temperature=0)),
    (0, 2, SamplingParams(max_tokens=7, seed=4, top_p=0.9)),
    (1, 4, SamplingParams(max_tokens=10, seed=5, temperature=0.7)),
]


@pytest.fixture
def service(tmp_path: Path) -> LocalServiceClient:
    return LocalServiceClient(checkpoint_dir=tmp_path, device="cpu", threads=1)


def sampler(service: LocalServiceClient, **kwargs: int) -> LocalSamplingClient:
    client = service.create_sampling_client("tiny:5")
    if kwargs:
        client = LocalSamplingClient(client.model, client.tokenizer, "tiny:5", **kwargs)
    return client


def results(responses: list) -> list[list[tuple[list[int], list[float], str]]]:
    return [[(s.tokens, s.logprobs, s.stop_reason) for s in r.sequences] for r in responses]


def assert_same(got: list, want: list) -> None:
    for call_got, call_want in zip(got, want, strict=True):
        assert len(call_got) == len(call_want)
        for (tokens, lps, reason), (w_tokens, w_lps, w_reason) in zip(
            call_got, call_want, strict=True
        ):
            assert tokens == w_tokens and reason == w_reason
            np.testing.assert_allclose(lps, w_lps, rtol=0, atol=LOGPROB_TOL)


def test_batched_calls_sample_what_single_calls_sample(service: LocalServiceClient) -> None:
    alone = sampler(service, kv_cache_bytes=0)
    single = results([
        alone.sample(ModelInput.from_ints(PROMPTS[p]), n, params).result()
        for p, n, params in CALLS
    ])
    assert alone.stats.max_batch_rows == max(n for _, n, _ in CALLS)  # never more than one call

    batched = sampler(service, kv_cache_bytes=0)

    async def together() -> list:
        async def call(delay: int, p: int, n: int, params: SamplingParams):
            await asyncio.sleep(0.01 * delay)  # later calls join a batch already decoding
            return await batched.sample_async(ModelInput.from_ints(PROMPTS[p]), n, params)

        return await asyncio.gather(*(call(i % 3, *c) for i, c in enumerate(CALLS)))

    assert_same(results(asyncio.run(together())), single)
    assert batched.stats.max_batch_rows > max(n for _, n, _ in CALLS)
    # Finished rows leave: fewer row-steps decoded than if every row ran to the longest budget.
    assert batched.stats.decoded_rows < sum(n for _, n, _ in CALLS) * 12


def test_draws_depend_on_the_seed_not_on_the_batch(service: LocalServiceClient) -> None:
    client = sampler(service)
    prompt = ModelInput.from_ints(PROMPTS[0])
    params = SamplingParams(max_tokens=8, seed=11)
    four = client.sample(prompt, 4, params).result().sequences
    two = client.sample(prompt, 2, params).result().sequences
    assert [s.tokens for s in two] == [s.tokens for s in four[:2]]  # row i: its own generator
    other = client.sample(prompt, 2, params.model_copy(update={"seed": 12})).result().sequences
    assert [s.tokens for s in other] != [s.tokens for s in two]


def test_a_call_larger_than_the_batch_runs_and_later_calls_wait(
    service: LocalServiceClient,
) -> None:
    small = sampler(service, max_rows=2, kv_cache_bytes=0)
    wide = sampler(service, kv_cache_bytes=0)
    params = SamplingParams(max_tokens=5, seed=3)

    async def run(client: LocalSamplingClient) -> list:
        return await asyncio.gather(
            client.sample_async(ModelInput.from_ints(PROMPTS[0]), 5, params),
            client.sample_async(ModelInput.from_ints(PROMPTS[1]), 2, params),
        )

    assert_same(results(asyncio.run(run(small))), results(asyncio.run(run(wide))))
    assert small.stats.max_batch_rows == 5


def test_next_turn_prefills_only_new_tokens_and_samples_the_same(
    service: LocalServiceClient,
) -> None:
    cached, fresh = sampler(service), sampler(service, kv_cache_bytes=0)
    prompt = PROMPTS[2]
    params = SamplingParams(max_tokens=6, seed=9)
    first = cached.sample(ModelInput.from_ints(prompt), 1, params).result().sequences[0]
    assert cached.stats.prefill_tokens == len(prompt) and len(cached.engine.prefix_cache) == 1
    # The next turn: prompt + completion + an "observation" and a new header.
    extended = prompt + first.tokens + [13, 14, 15, 16]
    nxt = SamplingParams(max_tokens=6, seed=10)
    with_cache = cached.sample(ModelInput.from_ints(extended), 1, nxt).result()
    without = fresh.sample(ModelInput.from_ints(extended), 1, nxt).result()
    assert_same(results([with_cache]), results([without]))
    reused = len(prompt) + len(first.tokens) - 1  # the last sampled token was never fed
    assert cached.stats.reused_tokens == reused
    assert cached.stats.prefill_tokens == len(prompt) + len(extended) - reused
    assert fresh.stats.reused_tokens == 0
    assert len(cached.engine.prefix_cache) == 1  # the longer entry replaced its own prefix


def test_cached_keys_values_give_the_logits_of_a_fresh_prefill(
    service: LocalServiceClient,
) -> None:
    client = sampler(service)

    async def rows() -> list:
        # Several rows of different lengths decoded together: cached entries come out of a
        # left-padded batch.
        return await asyncio.gather(*(
            client.sample_async(ModelInput.from_ints(p), 2, SamplingParams(max_tokens=5 + i,
                                                                          seed=i))
            for i, p in enumerate(PROMPTS)
        ))

    responses = asyncio.run(rows())
    model = client.model
    checked = 0
    for prompt, response in zip(PROMPTS, responses, strict=True):
        for sequence in response.sequences:
            extended = prompt + sequence.tokens + [42, 43, 44]
            entry, reused = client.engine.prefix_cache.longest_prefix(extended, len(extended) - 1)
            assert entry is not None and reused == len(prompt) + len(sequence.tokens) - 1
            with torch.inference_mode():
                full = model(input_ids=torch.tensor([extended])).logits[0, reused:]
                past = DynamicCache(ddp_cache_data=entry.cropped(reused))
                suffix = torch.tensor([extended[reused:]])
                positions = torch.arange(reused, len(extended))[None]
                cont = model(input_ids=suffix, position_ids=positions, cache=past).logits[0]
            torch.testing.assert_close(cont, full, rtol=0, atol=LOGIT_TOL)
            checked += 1
    assert checked == 2 * len(PROMPTS)


def test_concurrent_multi_turn_branches_match_an_uncached_serial_run(
    service: LocalServiceClient,
) -> None:
    """Branches sharing an opening prompt, several turns each, interleaved in one engine."""

    async def branch(client: LocalSamplingClient, b: int) -> list[list[int]]:
        prompt = list(PROMPTS[0])
        seen = []
        for turn in range(3):
            params = SamplingParams(max_tokens=4 + turn, seed=100 * b + turn)
            reply = (await client.sample_async(ModelInput.from_ints(prompt), 1, params))
            tokens = reply.sequences[0].tokens
            seen.append(tokens)
            prompt = prompt + tokens + [20 + b, 30 + turn]
            await asyncio.sleep(0.002 * b)  # an env step of varying length
        return seen

    async def all_branches(client: LocalSamplingClient) -> list:
        return await asyncio.gather(*(branch(client, b) for b in range(4)))

    cached = sampler(service)
    got = asyncio.run(all_branches(cached))
    serial = sampler(service, kv_cache_bytes=0, max_rows=1)
    want = [asyncio.run(branch(serial, b)) for b in range(4)]
    assert got == want
    assert cached.stats.reused_tokens > 0


def test_prefix_cache_is_bounded_lru_and_drops_dominated_entries() -> None:
    def kv(n: int) -> tuple:
        return ((torch.zeros(1, 1, n, 2), torch.zeros(1, 1, n, 2)),)

    per_token = 2 * 2 * 4  # keys + values, 2 floats each
    cache = PrefixCache(max_bytes=10 * per_token)
    cache.put([1, 2, 3], kv(3))
    cache.put([1, 2, 3, 4, 5], kv(5))  # extends [1, 2, 3]: replaces it
    assert len(cache) == 1 and cache.nbytes == 5 * per_token
    cache.put([7, 8, 9], kv(3))
    entry, common = cache.longest_prefix([1, 2, 3, 9], limit=3)
    assert common == 3 and entry is not None and entry.length == 5  # any shared prefix counts
    _, capped = cache.longest_prefix([1, 2, 3, 4, 5], limit=4)
    assert capped == 4
    cache.put([4, 4, 4, 4], kv(4))  # over budget: the least recently used entry ([7, 8, 9]) goes
    assert cache.nbytes <= 10 * per_token
    assert cache.longest_prefix([7, 8, 9, 1], limit=3) == (None, 0)
    assert cache.longest_prefix([1, 2, 3, 4, 5, 6], limit=5)[1] == 5
    assert PrefixCache(0).longest_prefix([1], 1) == (None, 0)


def test_a_failing_batch_fails_its_calls_and_the_engine_serves_on(
    service: LocalServiceClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = sampler(service)
    forward = client.engine.model
    broken = True

    def model(**kwargs: object) -> object:
        if broken and "attention_mask" in kwargs:  # decode steps (prefills pass no mask)
            raise RuntimeError("device lost")
        return forward(**kwargs)

    monkeypatch.setattr(client.engine, "model", model)

    async def two() -> list:
        return await asyncio.gather(
            *(client.sample_async(ModelInput.from_ints(p), 1, SamplingParams(max_tokens=4))
              for p in PROMPTS[:2]),
            return_exceptions=True,
        )

    outcomes = asyncio.run(two())
    assert all(isinstance(o, RuntimeError) and "device lost" in str(o) for o in outcomes)
    broken = False
    ok = client.sample(ModelInput.from_ints([1, 2]), 2, SamplingParams(max_tokens=3)).result()
    assert [len(s.tokens) for s in ok.sequences] == [3, 3]


def test_concurrent_calls_sharing_an_opening_prefill_it_once(
    service: LocalServiceClient,
) -> None:
    """A prompt's keys/values are cached when it is prefilled, so a call admitted after it
    reuses their shared opening (a system prompt) even before the first call finishes."""
    client = sampler(service)
    opening = PROMPTS[2]
    first, second = [*opening, 1, 2, 3], [*opening, 4, 5]
    params = SamplingParams(max_tokens=6, seed=1)

    async def both() -> list:
        return await asyncio.gather(*(client.sample_async(ModelInput.from_ints(p), 2, params)
                                      for p in (first, second)))

    together = results(asyncio.run(both()))
    assert client.stats.prefill_tokens == len(first) + len(second) - len(opening)
    assert client.stats.reused_tokens == len(opening)
    alone = sampler(service, kv_cache_bytes=0)
    assert_same(together, results([alone.sample(ModelInput.from_ints(p), 2, params).result()
                                   for p in (first, second)]))


def test_decoding_layout_keeps_every_weight_and_logit(service: LocalServiceClient) -> None:
    client = service.create_sampling_client("tiny:5")  # already laid out by the sampler
    fresh = service.create_sampling_client("tiny:5").model
    with torch.no_grad():
        for module in fresh.modules():
            if isinstance(module, torch.nn.Linear):  # back to the row-major layout
                module.weight.data = module.weight.data.contiguous()
    ids = torch.tensor([PROMPTS[2]])
    for (name, laid), (_, plain) in zip(client.model.named_parameters(),
                                        fresh.named_parameters(), strict=True):
        assert torch.equal(laid, plain), name
    linears = [m for m in client.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.t().is_contiguous() for m in linears)
    with torch.inference_mode():
        torch.testing.assert_close(client.model(input_ids=ids).logits,
                                   fresh(input_ids=ids).logits, rtol=0, atol=LOGIT_TOL)


def test_compute_logprobs_reuses_a_scored_prefix_and_scores_as_a_fresh_forward(
    service: LocalServiceClient,
) -> None:
    """Replies scored after one shared prompt (TEMPO's median readout) run the prompt once;
    every logprob, the prompt's and the replies', is what a client without that cache (but
    with the sampling one) computes."""
    cached, fresh = sampler(service), sampler(service, scoring_cache_bytes=0)
    prompt = PROMPTS[2]
    replies = [[3, 4], [3, 5, 6], [8], [3, 4, 9]]
    for reply in replies:
        tokens = ModelInput.from_ints(prompt + reply)
        got, want = cached.compute_logprobs(tokens).result(), fresh.compute_logprobs(tokens).result()
        assert got[0] is None and want[0] is None and len(got) == len(want)
        np.testing.assert_allclose(got[1:], want[1:], atol=LOGPROB_TOL, rtol=0)
    # Each call's longest common prefix with an earlier one: none, prompt + [3], prompt,
    # prompt + [3, 4]. Its last position runs again, so one less is reused.
    shared = [len(prompt) + 1, len(prompt), len(prompt) + 2]
    assert cached.stats.scored_reused_tokens == sum(shared) - len(shared)
    again = ModelInput.from_ints(prompt + replies[1])  # scored before: read back, exactly
    assert cached.compute_logprobs(again).result() == cached.compute_logprobs(again).result()
    assert cached.stats.scored_reused_tokens == sum(shared) - len(shared) + 2 * len(prompt + replies[1])
    assert fresh.stats.scored_reused_tokens == 0
