"""The rollout phase of a real GRPO step sampled by vLLM, against the local sampler and
against one-row Hugging Face ``generate``, all in one run.

    python benchmarks/bench_vllm.py [--threads 1]          # benchmarks/results/vllm-cpu.json
    python benchmarks/bench_vllm.py --device cuda          # on a GPU machine: vllm-cuda.json

On a GPU machine the learner, the local sampler and ``generate`` run on CUDA and
``.venv-vllm`` holds the CUDA build of vLLM (docs/training.md); the result file is named
for the device, so no CPU figure reads as a GPU one.

The step: ``agent-gym train grpo`` on ALFWorld-v0 (text protocol), 4 tasks x 8 branches,
at most 6 turns, 48-token replies, the embedded SmolLM2 from its base weights, the learner
on the local backend. Arms, in this order: one-row ``generate`` of the float32 model (the
baseline, measured again at the end: the machine's load may drift), the step with
``--sampler local`` (the bfloat16 copy where this CPU has bf16 units, else float32), the
step with ``--sampler vllm`` (a server the run starts; vLLM keeps one core for its API
process and runs its engine on the rest, so on 2 cores the engine has one, as the local
sampler does), once with the weights merged and reloaded (``--vllm-weights merged``, the
default) and once through the LoRA adapter (``adapter``). Each arm's figure is sampled
tokens per second of the rollout phase (``time_rollout``: env steps included, the engine's
start and the weights' publication not), and its ratio to the baseline; the vLLM arms add
the share of prompt tokens the prefix cache held (``engine_prefix_hit_rate``), the
learner's logprob gap to the engine's on the sampled tokens and the engine's CPU seconds.
``lora_cost`` says what bounds the adapter arm: the engine's prefill of a 1500-token prompt
and its decode rate at 32 rows, on the base model and through a LoRA adapter (the
learner's, rank 32, as the trainers publish it), on one server. ``contexts`` says what the
engine does with longer prompts and more threads: 4 calls x 8 rows x 48 tokens on the base
model, each call its own random prompt of 100, 700 or 1500 tokens (prefill included), with
its threads bound to 1 core and to 2.

    python benchmarks/bench_vllm.py --sections contexts    # re-run one section in place
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from bench_local_backend import gymnasium_opening, one_row_generate
from harness import RESULTS, Result, figures_in, timed

from agent_gym.render import ChatRenderer
from agent_gym_train.backends.local import LocalServiceClient
from agent_gym_train.backends.runtime import native_bf16

SETTINGS = {"env_id": "agent_gym/ALFWorld-v0", "env_kwargs": {"protocol": "text"},
            "steps": 1, "batch_size": 4, "group_size": 8, "max_turns": 6, "max_tokens": 48,
            "progress": False, "save_every": 1000}


def baseline(device: str, threads: int) -> float:
    """One-row ``generate`` tokens per second on the ALFWorld opening, float32."""
    base = LocalServiceClient(device=device, threads=threads).create_sampling_client("smollm2")
    renderer = ChatRenderer(base.tokenizer)
    opening = gymnasium_opening("agent_gym/ALFWorld-v0", {"protocol": "text"})
    prompt = renderer.prompt(opening["messages"], opening.get("tools") or None)
    return one_row_generate(base, prompt, 32)[0]


def grpo_step(sampler: str, precision: str, device: str, threads: int,
              weights: str = "merged") -> dict[str, Any]:
    from agent_gym_train.grpo import Args, train

    with tempfile.TemporaryDirectory() as tmp:
        args = Args(**SETTINGS, sampler=sampler, sampler_precision=precision, device=device,
                    threads=threads, vllm_weights=weights, out=str(Path(tmp) / "run"))
        train(args)
        # the metrics line, not train()'s return: cpu_step and the engine's figures are there
        row = json.loads((Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()[0])
    engine = f" --vllm-weights {weights}" if sampler == "vllm" else ""
    return {
        "command": "agent-gym train grpo --env-id agent_gym/ALFWorld-v0 --env-kwargs "
                   "'{\"protocol\": \"text\"}' --batch-size 4 --group-size 8 --max-turns 6 "
                   f"--max-tokens 48 --steps 1 --threads {threads} --sampler {sampler}{engine} "
                   f"--sampler-precision {precision} --device {device}",
        "sampled_tokens": row["sampled_tokens"], "episodes": row["episodes"],
        "turns_mean": row["turns_mean"], "rollout_seconds": round(row["time_rollout"], 1),
        "rollout_tok_s": round(row["sampled_tokens"] / row["time_rollout"], 2),
        **{key: row[key] for key in ("engine_prefix_hit_rate", "logprob_gap_abs_mean",
                                     "truncated_fraction", "engine_cpu_step", "cpu_step")
           if key in row},
    }


def lora_cost(threads: int) -> dict[str, Any]:
    """Prefill seconds of one 1500-token prompt and sampled tokens per second of 4 calls x 8
    rows x 48 tokens, base model against adapter, on one vLLM server."""
    import asyncio
    import random
    import time

    from pytrio import ModelInput, SamplingParams

    from agent_gym_train.backends.models import load_tokenizer, smollm2_dir
    from agent_gym_train.backends.vllm import Engine, EngineConfig, VLLMSampler, VLLMWeights

    async def decode(sampler: VLLMSampler, prompt: list[int]) -> float:
        started = time.perf_counter()
        replies = await asyncio.gather(*(sampler.sample_async(
            ModelInput.from_ints(prompt), 8, SamplingParams(max_tokens=48, temperature=1.0))
            for _ in range(4)))
        tokens = sum(len(s.tokens) for reply in replies for s in reply.sequences)
        return tokens / (time.perf_counter() - started)

    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine.start(EngineConfig(smollm2_dir(), "smollm2", 32, 1,
                                           Path(tmp) / "vllm.log", threads=threads))
        try:
            tokenizer = load_tokenizer("smollm2")
            weights = VLLMWeights(engine, tokenizer, Path(tmp) / "adapters", keep=1)
            learner = LocalServiceClient(checkpoint_dir=Path(tmp) / "ck", device="cpu",
                                         threads=threads)
            adapter = weights.publish(
                learner.create_lora_training_client("smollm2", rank=32, seed=0).save_adapter)
            short = tokenizer.encode("Tell me about a robot that cleans a kitchen. " * 10)
            for name, sampler in (("base", weights.base()), ("lora", adapter)):
                asyncio.run(decode(sampler, short))  # warm-up
                long = [random.Random(0).randrange(100, 40000) for _ in range(1500)]
                started = time.perf_counter()
                asyncio.run(sampler.sample_async(ModelInput.from_ints(long), 1,
                                                 SamplingParams(max_tokens=1)))
                prefill = time.perf_counter() - started
                figures[name] = {"prefill_1500_tokens_s": round(prefill, 2),
                                 "decode_32_rows_tok_s": round(
                                     asyncio.run(decode(sampler, short)), 1)}
        finally:
            engine.close()
    return figures


def contexts(threads: int) -> dict[str, float]:
    """Sampled tokens per second of 4 calls x 8 rows x 48 tokens, by prompt length."""
    import asyncio
    import random
    import time

    from pytrio import ModelInput, SamplingParams

    from agent_gym_train.backends.models import load_tokenizer, smollm2_dir
    from agent_gym_train.backends.vllm import Engine, EngineConfig, VLLMSampler, VLLMWeights

    async def rows(sampler: VLLMSampler, length: int) -> float:
        draw = random.Random(length)
        prompts = [[draw.randrange(100, 40000) for _ in range(length)] for _ in range(4)]
        started = time.perf_counter()
        replies = await asyncio.gather(*(sampler.sample_async(
            ModelInput.from_ints(prompt), 8, SamplingParams(max_tokens=48, temperature=1.0))
            for prompt in prompts))
        tokens = sum(len(s.tokens) for reply in replies for s in reply.sequences)
        return tokens / (time.perf_counter() - started)

    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine.start(EngineConfig(smollm2_dir(), "smollm2", 0, 1,
                                           Path(tmp) / "vllm.log", threads=threads))
        try:
            sampler = VLLMWeights(engine, load_tokenizer("smollm2"), Path(tmp), 1).base()
            asyncio.run(rows(sampler, 50))  # warm-up
            for length in (100, 700, 1500):
                figures[f"prompt_{length}_tok_s"] = round(asyncio.run(rows(sampler, length)), 1)
        finally:
            engine.close()
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/vllm-DEVICE.json")
    parser.add_argument("--sections", nargs="+", choices=("steps", "contexts"),
                        default=["steps", "contexts"],
                        help="what to measure (the others keep their figures in --out)")
    options = parser.parse_args()
    out = options.out or str(RESULTS / f"vllm-{options.device.partition(':')[0]}.json")
    if "steps" not in options.sections:
        record = Result(figures_in(out))
        record.figures["contexts"] = {
            f"threads_{n}": timed(lambda n=n: contexts(n)) for n in (1, 2)}
        record.write(out)
        return 0
    torch.set_num_threads(options.threads)
    device = options.device
    precision = "bfloat16" if native_bf16(torch.device(device)) else "float32"
    record = Result()
    figures = record.figures
    figures["device"] = device
    first = baseline(device, options.threads)
    figures["local"] = timed(lambda: grpo_step("local", precision, device, options.threads))
    record.write(out)
    figures["vllm"] = timed(lambda: grpo_step("vllm", "float32", device, options.threads))
    record.write(out)
    figures["vllm_adapter"] = timed(
        lambda: grpo_step("vllm", "float32", device, options.threads, "adapter"))
    figures["lora_cost"] = timed(lambda: lora_cost(options.threads))
    last = baseline(device, options.threads)
    one_row = (first + last) / 2
    figures["one_row_generate_tok_s"] = [round(first, 2), round(last, 2)]
    arms = ("local", "vllm", "vllm_adapter")
    for arm in arms:
        figures[arm]["vs_one_row_generate"] = round(figures[arm]["rollout_tok_s"] / one_row, 2)
    figures["vllm_vs_local"] = round(figures["vllm"]["rollout_tok_s"]
                                     / figures["local"]["rollout_tok_s"], 2)
    if "contexts" in options.sections:
        figures["contexts"] = {f"threads_{n}": timed(lambda n=n: contexts(n)) for n in (1, 2)}
    record.write(out)
    print({arm: figures[arm]["vs_one_row_generate"] for arm in arms},
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
