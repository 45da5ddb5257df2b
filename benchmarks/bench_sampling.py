"""How far the local sampler is from what this machine's memory allows, on a real GRPO step,
with float32 weights and with a bfloat16 sampling copy (``--sampler-precision``).

    python benchmarks/bench_sampling.py [--out benchmarks/results/sampling.json]

A decode step of a 135M-parameter model on a CPU does little arithmetic per byte it
reads: every step streams all the weights (float32: ~540 MB, the tied LM head included;
bfloat16: half, with the head stored apart from the embedding) plus each row's keys and
values (SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x 2 values per position, 4 or 2
bytes each). So the floor of a step is those bytes over the memory's read bandwidth,
measured here on one thread (a ``sum`` over 1 GiB, best of 5; the sampler runs on one
thread when it shares the machine with the learner). With many rows the arithmetic (2
flops per parameter per row, plus attention over the context) overtakes the bytes, so the
roofline of a step is the larger of the two, the arithmetic at the large-matmul rate of the
weights' dtype. Sections, all in one run, per precision (bfloat16 only where this CPU has
bf16 units):

- ``roofs``: read GB/s and large-matmul GFLOP/s of one thread (float32 and bfloat16).
- ``decode``: the engine's decode step at 1-32 rows and 400/1000 positions against its
  roofline (``memory_bound_ms``, ``compute_bound_ms``, ``step_over_bound``).
- ``grpo_step``: one real ``agent-gym train grpo`` step on ALFWorld-v0 (text protocol,
  4 tasks x 8 branches, at most 6 turns, 48-token replies, base SmolLM2, one thread): the
  sampled tokens per second of its rollout phase against one-row Hugging Face ``generate``
  of the float32 model measured in the same process before and after, the engine's time
  split (prefill, decode, env and the rest) and its mean batch rows; the profile that says
  what bounds the ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_local_backend import bench_decode_steps, gymnasium_opening, one_row_generate
from harness import RESULTS, Result

from agent_gym.render import ChatRenderer
from agent_gym_train.backends import SAMPLER_PRECISIONS
from agent_gym_train.backends.local import LocalServiceClient
from agent_gym_train.backends.runtime import native_bf16, sampler_dtype
from agent_gym_train.backends.sampler import LocalSamplingClient

KV_VALUES_PER_POSITION = 30 * 3 * 64 * 2  # SmolLM2-135M: layers x KV heads x dims x (k, v)
# a new token attends to every position: q.k and the weighted sum of values, 9 heads x 64
# dims x 2 flops each, in 30 layers
ATTENTION_FLOPS_PER_POSITION = 30 * 9 * 64 * 2 * 2


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second one thread reads (a float32 sum over ``gib`` GiB, best of
    ``repeats``)."""
    data = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def matmul_flops(dtype: torch.dtype, repeats: int = 5, size: int = 1024) -> float:
    """Floating-point operations per second of one thread on a large matrix product in
    ``dtype`` (best of ``repeats``): the compute roof."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters a decode step reads whole: every one, a tied embedding and
    head once (the step reads all of it as the head, and only a row per token as the
    embedding)."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


def bench_decode(service: LocalServiceClient, bandwidth: float, flops: float) -> dict[str, Any]:
    """Each decode shape against its roofline: the larger of reading the weights and the
    rows' keys and values at ``bandwidth`` and doing its arithmetic at ``flops``."""
    steps = bench_decode_steps(service)
    base = service.create_sampling_client("smollm2")
    weights = weight_bytes(base.model)
    params = sum(p.numel() for p in {p.data_ptr(): p for p in base.model.parameters()}.values())
    kv_bytes = KV_VALUES_PER_POSITION * service.sampler_dtype.itemsize
    out: dict[str, Any] = {"weight_bytes": weights, "parameters": params,
                           "kv_bytes_per_position": kv_bytes}
    for shape, figures in steps.items():
        if "x" not in shape:
            continue
        rows, context = (int(part) for part in shape.split("x"))
        memory = (weights + rows * context * kv_bytes) / bandwidth
        work = rows * (2 * params + ATTENTION_FLOPS_PER_POSITION * context) / flops
        bound = max(memory, work)
        out[shape] = {**figures, "memory_bound_ms": round(memory * 1000, 1),
                      "compute_bound_ms": round(work * 1000, 1),
                      "step_over_bound": round(figures["step_ms"] / (bound * 1000), 2)}
    return out


def bench_grpo_step(precision: str) -> dict[str, Any]:
    from agent_gym_train.grpo import Args, train

    with tempfile.TemporaryDirectory() as tmp:
        base = LocalServiceClient(device="cpu", threads=1).create_sampling_client("smollm2")
        service = LocalServiceClient(checkpoint_dir=Path(tmp) / "ck", device="cpu", threads=1,
                                     sampler_precision=precision)
        renderer = ChatRenderer(base.tokenizer)
        opening = gymnasium_opening("agent_gym/ALFWorld-v0", {"protocol": "text"})
        prompt = renderer.prompt(opening["messages"], opening.get("tools") or None)
        before = one_row_generate(base, prompt, 32)
        engines: list[LocalSamplingClient] = []
        make = service.make_sampler

        def keep(*args: Any, **kwargs: Any) -> LocalSamplingClient:
            engines.append(make(*args, **kwargs))
            return engines[-1]

        service.make_sampler = keep  # type: ignore[method-assign]
        args = Args(env_id="agent_gym/ALFWorld-v0", env_kwargs={"protocol": "text"}, steps=1,
                    batch_size=4, group_size=8, max_turns=6, max_tokens=48,
                    out=str(Path(tmp) / "run"), progress=False, save_every=1,
                    sampler_precision=precision)
        row = train(args, service)[0]
        after = one_row_generate(base, prompt, 32)
    stats = engines[0].stats
    rollout = row["time_rollout"]
    one_row = (before[0] + after[0]) / 2
    decode = stats.busy_seconds - stats.prefill_seconds
    return {
        "command": "agent-gym train grpo --env-id agent_gym/ALFWorld-v0 --env-kwargs "
                   "'{\"protocol\": \"text\"}' --batch-size 4 --group-size 8 --max-turns 6 "
                   f"--max-tokens 48 --steps 1 --threads 1 --sampler-precision {precision}",
        "sampled_tokens": row["sampled_tokens"], "episodes": row["episodes"],
        "turns_mean": row["turns_mean"], "rollout_seconds": round(rollout, 1),
        "rollout_tok_s": round(row["sampled_tokens"] / rollout, 2),
        "one_row_generate_tok_s": [round(before[0], 2), round(after[0], 2)],
        "rollout_vs_one_row": round(row["sampled_tokens"] / rollout / one_row, 2),
        "profile": {
            "prefill_seconds": round(stats.prefill_seconds, 1),
            "prefill_tokens": stats.prefill_tokens,
            "reused_prefix_tokens": stats.reused_tokens,
            "decode_seconds": round(decode, 1),
            "decode_steps": stats.decode_steps,
            "mean_batch_rows": round(stats.decoded_rows / max(1, stats.decode_steps), 1),
            "decode_step_ms_mean": round(1000 * decode / max(1, stats.decode_steps), 1),
            "env_and_other_seconds": round(rollout - stats.busy_seconds, 1),
            "decode_only_vs_one_row": round(row["sampled_tokens"] / decode / one_row, 2),
        },
        "load_after": os.getloadavg()[0],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "sampling.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    precisions = [p for p in SAMPLER_PRECISIONS if p == "float32" or native_bf16(cpu)]
    result = Result()
    bandwidth = read_bandwidth()
    flops = {p: matmul_flops(sampler_dtype(p, cpu)) for p in precisions}
    result.figures["roofs"] = {"read_gb_s_one_thread": round(bandwidth / 1e9, 2),
                               **{f"matmul_gflop_s_one_thread_{p}": round(f / 1e9, 1)
                                  for p, f in flops.items()}}
    print(result.figures, file=sys.stderr, flush=True)
    result.figures["decode"], result.figures["grpo_step"] = {}, {}
    for precision in precisions:
        service = LocalServiceClient(device="cpu", threads=1, sampler_precision=precision)
        result.figures["decode"][precision] = bench_decode(service, bandwidth, flops[precision])
        result.write(args.out)
    for precision in precisions:
        result.figures["grpo_step"][precision] = bench_grpo_step(precision)
        result.write(args.out)
    print(result.figures, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
