"""The local backend at the machine's limits, each figure beside a baseline from the same run.

- rollouts: sampled tokens/s of ``agent_gym_train.run.rollout.rollout_groups`` on ALFWorld-v0
  (text protocol) and Search-v0, 4 tasks x 8 branches x up to 6 turns, with the batching
  sampler against (a) the path before it (``SerialSampler``: one call at a time, every call
  prefills its whole prompt, a call's rows decode until its slowest stops) and (b) one-row
  Hugging Face ``generate``, all on the same model object (so the ratios are the engine's
  alone); per wall second, per busy second and per CPU second of the sampling thread (the
  last barely moves with other processes' load). The batched run also gives its time split
  and ``decode_step_cost`` at 1-32 rows and 400/1000 positions: what bounds the ratio.
- prefill: prompt tokens run through the model per turn over a 10-turn ALFWorld episode,
  with the prefix cache and without it (same seeds, hence the same episode).
- scoring: TEMPO's median readout (``Critic.median``: five replies of a few tokens scored
  after one critic prompt) on the critic prompts of 8 Search-v0 openings, with
  ``compute_logprobs``'s prefix cache and without it: seconds and positions run.
- tempo: whole TEMPO updates (one warm-up, two TD; Search-v0, base model, median readout)
  with that cache and without it: the seconds of each update, and the TD updates' ratio.
- learner: ``forward_backward`` on 8 datums of 300 tokens (40% masked): time and peak
  memory (each variant in a fresh process) of the pass, without and with
  ``activation_checkpointing``, against the full-logits pass (logits everywhere), on
  unrelated datums, one GRPO group's and 8 TEMPO-like branches of one 500-token state.
- grpo: one GRPO step on GSM8K-v0 at the CPU defaults (``runtime.CPU_DEFAULTS``), with its
  phase split, and the step-cost estimate for it and for the GPU-scale defaults.

Everything runs on one torch thread (this machine is shared; see runtime.default_threads).

    python benchmarks/bench_local_backend.py [--out benchmarks/results/local_backend.json]
        [--sections rollouts,prefill,scoring,tempo,learner,grpo] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from harness import RESULTS, Result, figures_in, timed
from pytrio import Datum, ModelInput, SamplingParams
from pytrio.client.training_batch import plan_training_batch
from pytrio.types import SampleResponse, SampleSequence

from agent_gym.render import ChatRenderer, Conversation
from agent_gym_train.backends.batching import LENGTH, STOP
from agent_gym_train.backends.local import (
    CPU_MICROBATCH_TOKENS,
    LocalServiceClient,
    LocalTrainingClient,
    microbatches,
)
from agent_gym_train.backends.losses import check_loss, token_losses
from agent_gym_train.backends.runtime import CPU_DEFAULTS, StepShape, step_cost
from agent_gym_train.backends.sampler import LocalSamplingClient
from agent_gym_train.critic import VALUE_GRID, Critic
from agent_gym_train.run.envpool import EnvPool, env_factory
from agent_gym_train.run.rollout import RolloutConfig, rollout_groups

ENVS = {
    "ALFWorld-v0": ("agent_gym/ALFWorld-v0", {"protocol": "text"}),
    "Search-v0": ("agent_gym/Search-v0", {}),
}


# --------------------------------------------------------------------------- today's path
class SerialSampler:
    """The local sampler as it was before the batching engine, for the baseline: calls are
    served one at a time, each prefills its whole prompt (logits at every position), and
    the rows of a call (sharing that prefill) decode until the slowest one stops."""

    def __init__(self, client: LocalSamplingClient) -> None:
        self.model = client.model
        self.tokenizer = client.tokenizer
        self._stops = client._stops
        self._lock = threading.Lock()
        self.busy_seconds = 0.0  # time spent inside calls, under the lock
        self.busy_cpu_seconds = 0.0  # CPU time of the calling thread meanwhile

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def sample_async(
        self, prompt: ModelInput, num_samples: int = 1, sampling_params: SamplingParams = None
    ) -> SampleResponse:
        return await asyncio.to_thread(self._sample, prompt.to_ints(), num_samples,
                                       sampling_params)

    def _sample(self, prompt: list[int], n: int, params: SamplingParams) -> SampleResponse:
        stop_ids, stop_strings = self._stops(params.stop)
        with self._lock, torch.inference_mode():
            started, started_cpu = time.perf_counter(), time.thread_time()
            generator = torch.Generator().manual_seed(params.seed)
            out = self.model(input_ids=torch.tensor([prompt]), use_cache=True)
            cache = out.cache
            cache.batch_repeat_interleave(n)
            logits = out.logits[:, -1, :].float().expand(n, -1)
            tokens: list[list[int]] = [[] for _ in range(n)]
            logprobs: list[list[float]] = [[] for _ in range(n)]
            reasons: list[str | None] = [None] * n
            for _ in range(params.max_tokens):
                logp = torch.log_softmax(logits / params.temperature, dim=-1)
                chosen = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
                picked = logp.gather(1, chosen[:, None]).squeeze(1)
                for i in range(n):
                    if reasons[i] is None:
                        tokens[i].append(int(chosen[i]))
                        logprobs[i].append(float(picked[i]))
                        tail = self.tokenizer.decode(tokens[i][-8:]) if stop_strings else ""
                        if tokens[i][-1] in stop_ids or any(s in tail for s in stop_strings):
                            reasons[i] = STOP
                if all(r is not None for r in reasons):
                    break
                step = self.model(input_ids=chosen[:, None], cache=cache, use_cache=True)
                cache = step.cache
                logits = step.logits[:, -1, :].float()
            self.busy_seconds += time.perf_counter() - started
            self.busy_cpu_seconds += time.thread_time() - started_cpu
        sequences = [SampleSequence(stop_reason=r or LENGTH, tokens=t, logprobs=lp)
                     for t, lp, r in zip(tokens, logprobs, reasons, strict=True)]
        return SampleResponse(sequences=sequences, prompt_logprobs=[], input_tokens=len(prompt),
                              output_tokens=sum(len(t) for t in tokens))


def one_row_generate(
    client: LocalSamplingClient, prompt: list[int], tokens: int
) -> tuple[float, float]:
    """Tokens per wall second and per CPU second of Hugging Face ``generate`` on one row."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        start, start_cpu = time.perf_counter(), time.thread_time()
        out = client.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
            min_new_tokens=tokens, do_sample=True, top_k=0, top_p=1.0,
            pad_token_id=client.tokenizer.eos_token_id,
        )
        elapsed, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
    sampled = out.shape[1] - ids.shape[1]
    return sampled / elapsed, sampled / cpu


# --------------------------------------------------------------------------- rollouts
def bench_rollouts(service: LocalServiceClient, max_tokens: int) -> dict[str, Any]:
    base = service.create_sampling_client("smollm2")
    renderer = ChatRenderer(base.tokenizer)
    config = RolloutConfig(group_size=8, max_turns=6, max_tokens=max_tokens,
                           max_trajectory_tokens=4096)
    results: dict[str, Any] = {"tasks": 4, "branches": 8, "max_turns": 6,
                               "max_tokens_per_reply": max_tokens}
    for name, (env_id, kwargs) in ENVS.items():
        pool = EnvPool(env_factory(env_id, kwargs, None))
        borrowed = [pool() for _ in range(4 * 8)]  # build every env before timing
        for env in borrowed:
            env.close()
        opening = borrowed[0].reset(options={"index": 0})[1]
        prompt = renderer.prompt(opening["messages"], opening.get("tools") or None)
        row: dict[str, Any] = {"env_kwargs": kwargs, "opening_prompt_tokens": len(prompt),
                               "load_before": os.getloadavg()[0]}
        one_row, one_row_cpu = one_row_generate(base, prompt, 32)
        row["one_row_generate_tok_s"] = round(one_row, 2)
        row["one_row_generate_tok_per_cpu_s"] = round(one_row_cpu, 2)
        for label, sampler in (
            ("batched", service.make_sampler(base.model, base.tokenizer, "smollm2")),
            ("today", SerialSampler(base)),
        ):
            start = time.perf_counter()
            groups = asyncio.run(rollout_groups(
                pool, [{"index": i} for i in range(4)], sampler, renderer, config,
                seeds=list(range(4)), concurrency=4,
            ))
            elapsed = time.perf_counter() - start
            episodes = [e for g in groups for e in g]
            sampled = sum(e.sampled_tokens for e in episodes)
            figures = {
                "seconds": round(elapsed, 1),
                "sampled_tokens": sampled,
                "sampler_calls": sum(e.turns for e in episodes),
                "turns_mean": round(sum(e.turns for e in episodes) / len(episodes), 2),
                "end_reasons": dict(Counter(e.end_reason for e in episodes)),
                "tok_s": round(sampled / elapsed, 2),
            }
            timing = sampler.stats if isinstance(sampler, LocalSamplingClient) else sampler
            busy, cpu = timing.busy_seconds, timing.busy_cpu_seconds
            figures |= {"sampler_busy_seconds": round(busy, 1),
                        "tok_s_while_sampling": round(sampled / busy, 2),
                        "sampler_cpu_seconds": round(cpu, 1),
                        "tok_per_sampler_cpu_s": round(sampled / cpu, 2)}
            if isinstance(sampler, LocalSamplingClient):
                stats = sampler.stats
                decode = stats.busy_seconds - stats.prefill_seconds
                figures |= {
                    "prefill_tokens": stats.prefill_tokens,
                    "reused_prefix_tokens": stats.reused_tokens,
                    "mean_batch_rows": round(stats.decoded_rows / max(1, stats.decode_steps), 1),
                    "max_batch_rows": stats.max_batch_rows,
                    # Where the rollout's time went, and what decoding alone would reach.
                    "time_split": {
                        "prefill_seconds": round(stats.prefill_seconds, 1),
                        "decode_seconds": round(decode, 1),
                        "env_and_other_seconds": round(elapsed - stats.busy_seconds, 1),
                        "prefill_share": round(stats.prefill_seconds / elapsed, 3),
                    },
                    "decode_steps": stats.decode_steps,
                    "decode_steps_by_rows": _bands(stats.steps_by_rows),
                    "tok_s_if_prefill_were_free": round(sampled / decode, 2),
                }
            row[label] = figures
            print(f"{name} {label}: {figures}", file=sys.stderr, flush=True)
        row["batched_vs_one_row"] = round(row["batched"]["tok_s"] / one_row, 2)
        row["decode_only_vs_one_row"] = round(
            row["batched"]["tok_s_if_prefill_were_free"] / one_row, 2
        )
        row["batched_vs_today"] = round(row["batched"]["tok_s"] / row["today"]["tok_s"], 2)
        row["while_sampling_batched_vs_today"] = round(
            row["batched"]["tok_s_while_sampling"] / row["today"]["tok_s_while_sampling"], 2
        )
        row["while_sampling_batched_vs_one_row"] = round(
            row["batched"]["tok_s_while_sampling"] / one_row, 2
        )
        # Per CPU second of the sampling thread: what other processes' load does not move.
        row["cpu_batched_vs_today"] = round(
            row["batched"]["tok_per_sampler_cpu_s"] / row["today"]["tok_per_sampler_cpu_s"], 2
        )
        row["cpu_batched_vs_one_row"] = round(row["batched"]["tok_per_sampler_cpu_s"]
                                              / one_row_cpu, 2)
        pool.close()
        results[name] = row
    results["decode_step_cost"] = bench_decode_steps(service)
    return results


def _bands(steps_by_rows: dict[int, int]) -> dict[str, dict[str, int]]:
    """Decode steps and the tokens they sampled, by how many rows the batch held."""
    bands = {"1-7": (1, 7), "8-19": (8, 19), "20+": (20, 1 << 30)}
    return {
        name: {"steps": sum(n for r, n in steps_by_rows.items() if lo <= r <= hi),
               "tokens": sum(r * n for r, n in steps_by_rows.items() if lo <= r <= hi)}
        for name, (lo, hi) in bands.items()
    }


def bench_decode_steps(
    service: LocalServiceClient, rows: Sequence[int] = (1, 4, 8, 16, 32),
    contexts: Sequence[int] = (400, 1000), tokens: int = 16,
) -> dict[str, Any]:
    """What one decode step of the engine costs with ``rows`` rows at ``contexts`` positions
    (rows of one call, so one prefill): the ceiling a batch of that shape puts on sampled
    tokens/s, whatever the rollout around it does."""
    base = service.create_sampling_client("smollm2")
    renderer = ChatRenderer(base.tokenizer)
    opening = gymnasium_opening("agent_gym/ALFWorld-v0", {"protocol": "text"})
    prompt = renderer.prompt(opening["messages"], opening.get("tools") or None)
    out: dict[str, Any] = {"sampled_per_row": tokens}
    for context in contexts:
        tokens_in = (prompt * (context // len(prompt) + 1))[:context]
        for count in rows:
            sampler = LocalSamplingClient(base.model, base.tokenizer, "smollm2",
                                          kv_cache_bytes=0)
            # A stop id no row samples in 16 tokens, so every row decodes all of them.
            params = SamplingParams(max_tokens=tokens, seed=count, stop=[0])
            sampler.sample(ModelInput.from_ints(tokens_in), count, params).result()
            stats = sampler.stats
            step = (stats.busy_seconds - stats.prefill_seconds) / stats.decode_steps
            mean_rows = stats.decoded_rows / stats.decode_steps
            out[f"{count}x{context}"] = {"step_ms": round(step * 1000, 1),
                                         "mean_rows": round(mean_rows, 1),
                                         "tok_s": round(mean_rows / step, 1)}
            print(f"decode {count}x{context}: {out[f'{count}x{context}']}", file=sys.stderr,
                  flush=True)
    return out


def gymnasium_opening(env_id: str, kwargs: dict[str, Any], index: int = 0) -> dict[str, Any]:
    pool = EnvPool(env_factory(env_id, kwargs, None))
    env = pool()
    try:
        return env.reset(options={"index": index})[1]
    finally:
        env.close()
        pool.close()


# --------------------------------------------------------------------------- prefill
def bench_prefill(service: LocalServiceClient, turns: int = 10) -> dict[str, Any]:
    import gymnasium

    base = service.create_sampling_client("smollm2")
    renderer = ChatRenderer(base.tokenizer)
    out: dict[str, Any] = {"env": "ALFWorld-v0 (text)", "turns": turns, "max_tokens": 24}
    for label, cache_bytes in (("with_cache", 1 << 30), ("without_cache", 0)):
        sampler = LocalSamplingClient(base.model, base.tokenizer, "smollm2",
                                      kv_cache_bytes=cache_bytes)
        env = gymnasium.make("agent_gym/ALFWorld-v0", protocol="text", max_turns=turns + 1)
        _, info = env.reset(options={"index": 0})
        conversation = Conversation.start(renderer, info["messages"], info.get("tools"))
        per_turn, prompts = [], []
        start = time.perf_counter()
        for turn in range(turns):
            before = sampler.stats.prefill_tokens
            params = SamplingParams(max_tokens=24, seed=turn, stop=list(renderer.stop_tokens))
            reply = sampler.sample(ModelInput.from_ints(conversation.tokens), 1,
                                   params).result().sequences[0]
            per_turn.append(sampler.stats.prefill_tokens - before)
            prompts.append(len(conversation.tokens))
            _, _, terminated, truncated, info = env.step(renderer.completion_text(reply.tokens))
            if terminated or truncated:
                break
            conversation.append(reply.tokens, [info["message"]])
        env.close()
        out[label] = {"prefill_tokens_per_turn": per_turn, "prompt_tokens_per_turn": prompts,
                      "prefill_tokens_total": sum(per_turn),
                      "seconds": round(time.perf_counter() - start, 1)}
    with_cache, without = out["with_cache"], out["without_cache"]
    out["same_episode"] = with_cache["prompt_tokens_per_turn"] == without["prompt_tokens_per_turn"]
    out["total_ratio_without_vs_with"] = round(
        without["prefill_tokens_total"] / with_cache["prefill_tokens_total"], 2
    )
    return out


# --------------------------------------------------------------------------- scoring
def bench_scoring(service: LocalServiceClient, states: int = 8) -> dict[str, Any]:
    base = service.create_sampling_client("smollm2")
    critic = Critic(ChatRenderer(base.tokenizer), r_max=1.0, max_tokens=8, temperature=0.0)
    prompts = []
    for index in range(states):
        info = gymnasium_opening("agent_gym/Search-v0", {"split": "train"}, index)
        messages = info["messages"]
        prompts.append(critic.prompt(messages, len(messages), info["privileged"]))
    out: dict[str, Any] = {"env": "Search-v0 (openings)", "states": states,
                           "mean_prompt_tokens": round(sum(map(len, prompts)) / states, 1),
                           "replies_per_state": len(VALUE_GRID)}
    medians = {}
    for label, cache_bytes in (("with_cache", 1 << 30), ("without_cache", 0)):
        sampler = LocalSamplingClient(base.model, base.tokenizer, "smollm2",
                                      scoring_cache_bytes=cache_bytes)

        async def readout(client: LocalSamplingClient = sampler) -> list[float]:
            return list(await asyncio.gather(*(critic.median(client, p) for p in prompts)))

        start = time.perf_counter()
        medians[label] = asyncio.run(readout())
        out[label] = {"seconds": round(time.perf_counter() - start, 2),
                      "positions_reused": sampler.stats.scored_reused_tokens}
    out["same_medians"] = medians["with_cache"] == medians["without_cache"]
    out["ratio_without_vs_with"] = round(
        out["without_cache"]["seconds"] / out["with_cache"]["seconds"], 2)
    return out


def bench_tempo(updates: int = 3) -> dict[str, Any]:
    """Whole TEMPO updates with the median readout, with the scoring cache and without it:
    what the cache saves once rollouts and learning are paid too. Both runs have the same
    seed, but sampling reads logprobs that differ by rounding, so their episodes may part."""
    from agent_gym_train.tempo import Args, train

    settings = {"env_id": "agent_gym/Search-v0", "env_kwargs": {"split": "train", "max_turns": 4},
                "warmup_updates": 1, "td_updates": updates - 1, "batch_size": 2, "branches": 4,
                "horizon": 2, "fresh_fraction": 0.5, "max_tokens": 48,
                "max_trajectory_tokens": 4096, "save_every": 1000}
    out: dict[str, Any] = {"model": "smollm2 (base)", "settings": settings}
    for label, scoring_bytes in (("with_cache", None), ("without_cache", 0)):
        with tempfile.TemporaryDirectory() as tmp:
            service = LocalServiceClient(checkpoint_dir=Path(tmp) / "ck", device="cpu",
                                         threads=1, scoring_cache_bytes=scoring_bytes)
            rows = train(Args(**settings, out=str(Path(tmp) / "run"), progress=False), service)
        td = [row for row in rows if row.get("phase") == "td"]
        out[label] = {
            "update_seconds": [round(row["time_step"], 1) for row in rows],
            "td_seconds": round(sum(row["time_step"] for row in td), 1),
            "td_rollout_seconds": round(sum(row["time_rollout"] for row in td), 1),
            "td_sampled_tokens": sum(row.get("sampled_tokens", 0) for row in td),
        }
    out["td_ratio_without_vs_with"] = round(
        out["without_cache"]["td_seconds"] / out["with_cache"]["td_seconds"], 2)
    return out


# --------------------------------------------------------------------------- learner
# The baseline (the full-logits pass), the learner, and the learner recomputing layers.
LEARNER_VARIANTS = ("full", "skip", "recompute")
# What each learner case holds: (masked opening tokens, shared by all 8 datums?).
LEARNER_CASES = {
    "unrelated": (120, False),  # 8 prompts of 120 tokens, 180-token replies: 40% masked
    "grpo_group": (120, True),  # one GRPO group: the same prompt, 8 sampled replies
    "tempo_branches": (500, True),  # 8 branches resumed from one saved 500-token state
}


def learner_datums(case: str, count: int = 8, reply: int = 180) -> list[Datum]:
    """``count`` datums of ``LEARNER_CASES[case]``'s masked opening plus a ``reply``-token
    trained reply (the last opening token predicts the reply's first)."""
    opening, shared = LEARNER_CASES[case]
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, 49000, (opening + 1,), generator=generator).tolist()
    datums = []
    for _ in range(count):
        if not shared:
            prompt = torch.randint(10, 49000, (opening + 1,), generator=generator).tolist()
        tokens = prompt + torch.randint(10, 49000, (reply,), generator=generator).tolist()
        targets = [-100 if i < opening else t for i, t in enumerate(tokens[1:])]
        datums.append(Datum(
            model_input=ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": targets,
                "logprobs": [-8.0 if t != -100 else 0.0 for t in targets],
                "advantages": [0.5 if t != -100 else 0.0 for t in targets],
            },
        ))
    return datums


def full_logits_losses(
    client: LocalTrainingClient, batch: Sequence[Any], loss_fn: str, config: dict[str, float]
) -> torch.Tensor:
    """Per-token losses with logits and log-softmax at every position of every row."""
    width = max(len(s.model_input) for s in batch)

    def padded(rows: Sequence[Sequence[float]], fill: float, dtype: torch.dtype) -> torch.Tensor:
        out = torch.full((len(rows), width), fill, dtype=dtype)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.tensor(row, dtype=dtype)
        return out

    ids = padded([s.model_input.to_ints() for s in batch], 0, torch.long)
    mask = padded([[1] * len(s.model_input) for s in batch], 0, torch.long)
    targets = padded([s.target_tokens for s in batch], -100, torch.long)
    counted = targets != -100
    inputs = {"logprobs": padded([s.logprobs for s in batch], 0.0, torch.float32),
              "advantages": padded([s.advantages for s in batch], 0.0, torch.float32)}
    logits = client.model(input_ids=ids, attention_mask=mask).logits.float()
    picked = logits.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    logprobs = torch.where(counted, picked - torch.logsumexp(logits, dim=-1), 0.0)
    return token_losses(loss_fn, logprobs, inputs, counted, config)


def full_logits_forward_backward(
    client: LocalTrainingClient, datums: Sequence[Datum], loss_fn: str
) -> dict[str, float]:
    """The learner before position skipping, the baseline: every datum whole, in
    consecutive microbatches of the backend's token budget, logits at every position; the
    same loss normalisation."""
    plan = plan_training_batch(list(datums), loss_fn=loss_fn, auto_shift=False,
                               limits=client._limits, tokenizer_vocab_size=client.vocab_size)
    samples = [s for chunk in plan.chunks for s in chunk.samples]
    denominator = plan.totals.total_active_tokens
    config = check_loss(loss_fn, None)
    loss_sum = 0.0
    budget = client._service.microbatch_tokens
    for part in microbatches([len(s.model_input) for s in samples], budget):
        total = full_logits_losses(client, [samples[i] for i in part], loss_fn, config).sum()
        (total / denominator).backward()
        loss_sum += float(total.detach())
    return {"loss_mean": loss_sum / denominator, "token_count": float(denominator)}


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def learner_variant(variant: str, case: str) -> dict[str, Any]:
    """One forward_backward in this process; peak = RSS high-water mark above the RSS before."""
    with tempfile.TemporaryDirectory() as tmp:
        service = LocalServiceClient(checkpoint_dir=tmp, device="cpu", threads=1,
                                     activation_checkpointing=variant == "recompute")
        client = service.create_lora_training_client("smollm2", rank=32, seed=0)
        datums = learner_datums(case)
        before = _rss_kb("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
        start, start_cpu = time.perf_counter(), time.process_time()
        if variant == "full":
            metrics = full_logits_forward_backward(client, datums, "importance_sampling")
        else:
            metrics = client.forward_backward(datums, "importance_sampling").result().metrics
        elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        peak = _rss_kb("VmHWM")
        grad_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum()
                                         for p in client.model.parameters() if p.grad is not None)))
    return {"seconds": round(elapsed, 2), "cpu_seconds": round(cpu, 2),
            "peak_mb": round((peak - before) / 1024, 1),
            "loss_mean": metrics["loss_mean"], "token_count": metrics["token_count"],
            "grad_norm": grad_norm, "load": os.getloadavg()[0]}


def bench_learner(repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {"datums": 8, "reply_tokens": 180, "microbatch_tokens":
                           CPU_MICROBATCH_TOKENS, "masked_opening_tokens":
                           {case: opening for case, (opening, _) in LEARNER_CASES.items()}}
    for datums in LEARNER_CASES:
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in LEARNER_VARIANTS}
        for _ in range(repeats):
            for variant in LEARNER_VARIANTS:  # alternated, so load drift hits each alike
                command = [sys.executable, __file__, "--learner-variant", variant]
                done = subprocess.run(
                    [*command, "--learner-datums", datums],
                    check=True, capture_output=True, text=True,
                    # Every allocation mmap'd: freed tensors leave the RSS at once, so the RSS
                    # high-water mark is the peak of live memory, not of malloc's arenas.
                    env=os.environ | {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"},
                )
                runs[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"learner {datums} {variant}: {runs[variant][-1]}", file=sys.stderr,
                      flush=True)
        best = {v: min(r["seconds"] for r in rs) for v, rs in runs.items()}
        best_cpu = {v: min(r["cpu_seconds"] for r in rs) for v, rs in runs.items()}
        peak = {v: min(r["peak_mb"] for r in rs) for v, rs in runs.items()}
        full = runs["full"][0]
        out[datums] = {"runs": runs}
        for variant in LEARNER_VARIANTS[1:]:
            this = runs[variant][0]
            out[datums][variant] = {
                "speedup": round(best["full"] / best[variant], 2),
                "speedup_cpu_time": round(best_cpu["full"] / best_cpu[variant], 2),
                "peak_memory_ratio": round(peak[variant] / peak["full"], 3),
                "loss_rel_diff": abs(full["loss_mean"] - this["loss_mean"])
                / abs(full["loss_mean"]),
                "grad_norm_rel_diff": abs(full["grad_norm"] - this["grad_norm"])
                / full["grad_norm"],
            }
    return out


# --------------------------------------------------------------------------- grpo
def bench_grpo() -> dict[str, Any]:
    from agent_gym_train.grpo import Args, train

    shape = CPU_DEFAULTS
    with tempfile.TemporaryDirectory() as tmp:
        service = LocalServiceClient(checkpoint_dir=Path(tmp) / "ck", device="cpu", threads=1)
        args = Args(env_id="agent_gym/GSM8K-v0", steps=1, batch_size=shape.batch_size,
                    group_size=shape.group_size, max_tokens=shape.max_tokens,
                    max_turns=shape.max_turns, out=str(Path(tmp) / "run"), progress=False)
        start = time.perf_counter()
        row = train(args, service)[0]
        elapsed = time.perf_counter() - start
    phases = {k: round(v, 1) for k, v in row.items() if k.startswith("time_")}
    gpu_scale = StepShape(batch_size=8, group_size=8, max_tokens=512)
    return {
        "settings": {"batch_size": shape.batch_size, "group_size": shape.group_size,
                     "max_tokens": shape.max_tokens, "max_turns": shape.max_turns},
        "seconds_including_model_load": round(elapsed, 1),
        "phases": phases,
        "sampled_tokens": row["sampled_tokens"], "trained_tokens": row["trained_tokens"],
        "reward_mean": row["reward_mean"], "degenerate_groups": row["degenerate_groups"],
        "estimated_step_seconds": round(step_cost(shape), 1),
        "estimated_gpu_scale_step_seconds (8x8x512)": round(step_cost(gpu_scale), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "local_backend.json"))
    parser.add_argument("--sections",
                        default="rollouts,prefill,scoring,tempo,learner,grpo")
    parser.add_argument("--max-tokens", type=int, default=48, help="per reply in rollouts")
    parser.add_argument("--learner-repeats", type=int, default=2)
    parser.add_argument("--learner-variant", choices=LEARNER_VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--learner-datums", choices=tuple(LEARNER_CASES), default="unrelated",
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.learner_variant:
        print(json.dumps(learner_variant(args.learner_variant, args.learner_datums)))
        return 0
    record = Result()
    sections: dict[str, Callable[[], dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        service = LocalServiceClient(checkpoint_dir=tmp, device="cpu", threads=1)
        sections = {
            "rollouts": lambda: bench_rollouts(service, args.max_tokens),
            "prefill": lambda: bench_prefill(service),
            "scoring": lambda: bench_scoring(service),
            "tempo": bench_tempo,
            "learner": lambda: bench_learner(args.learner_repeats),
            "grpo": bench_grpo,
        }
        out_path = Path(args.out)
        record.figures = figures_in(out_path)  # the sections not run this time keep theirs
        result = record.figures
        result |= {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                   "model": "SmolLM2-135M-Instruct (float32, LoRA r32 for the learner)"}
        for name in args.sections.split(","):
            result[name] = figures = timed(sections[name])
            record.write(out_path)  # after every section
            print(json.dumps({name: figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
