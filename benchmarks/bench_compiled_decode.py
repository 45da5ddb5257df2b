"""Would a compiled decode step bring the sampler closer to its memory-bandwidth floor?

    python benchmarks/bench_compiled_decode.py [--rows 1 8 32] [--positions 400]

``bench_sampling.py`` finds the bfloat16 decode step at 3-4x its floor and about 10 ms of
it in small operators and the Python between them: the overhead a compiler removes by
fusing them. This measures what ``torch.compile`` (Inductor, this machine's C++ compiler)
buys a SmolLM2 decode step, in the case most favourable to it: the bfloat16 sampling copy
the sampler reads (``sampling_copy``), one thread, and a static KV cache of fixed shape
(``StaticCache``), so no step changes a shape. The engine's own step, over a ragged buffer
whose width grows each step, would need dynamic shapes or a recompile per width, so its
gain could only be smaller. Inductor's ``freezing`` (weights folded in as constants for
oneDNN to prepack, PyTorch's advice for CPU inference) is left out: with the static cache
its first step's logits differed from eager's by 5.8 (against 0.5 without it), so it did
not compute the same step.

Per row count: a ``--positions`` prompt per row fills the cache, then decode steps; the
median of 10 timed steps (after 2 untimed) for eager, each variant and eager again, all in
one process, so a change of load hits them alike. ``compile_seconds`` is the first
compiled pass, compilation included; ``max_logit_difference`` compares the compiled first
step with eager's (fused bfloat16 arithmetic rounds differently, so it is small, not 0).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch._dynamo
from transformers import StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import RESULTS, Result

from agent_gym_train.backends.models import load_model
from agent_gym_train.backends.sampler import sampling_copy

WARM, TIMED = 2, 10
Forward = Callable[..., torch.Tensor]


def step_times(forward: Forward, model: torch.nn.Module, rows: int, positions: int
               ) -> tuple[list[float], torch.Tensor]:
    """Seconds of each timed decode step after a ``positions``-token prompt on every row,
    and the logits of the first step (to check a compiled step computes what eager does)."""
    cache = StaticCache(config=model.config, max_batch_size=rows,
                        max_cache_len=positions + 64)
    generator = torch.Generator().manual_seed(rows)
    prompt = torch.randint(100, 30_000, (rows, positions), generator=generator)
    with torch.no_grad():
        logits = model(input_ids=prompt, cache=cache, use_cache=True,
                       cache_position=torch.arange(positions)).logits
        token = logits[:, -1:].argmax(-1)
        times, first = [], None
        for step in range(WARM + TIMED):
            at = positions + step
            started = time.perf_counter()
            logits = forward(input_ids=token, cache=cache, use_cache=True,
                             cache_position=torch.tensor([at]),
                             position_ids=torch.full((rows, 1), at))
            token = logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - started)
            first = logits.float() if first is None else first
    assert first is not None
    return times[WARM:], first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--positions", type=int, default=400)
    parser.add_argument("--out", default=str(RESULTS / "compiled_decode.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = sampling_copy(load_model(), torch.bfloat16).eval()

    def eager(**inputs: torch.Tensor) -> torch.Tensor:
        return model(**inputs).logits

    result = Result()
    result.figures |= {"model": "SmolLM2-135M, bfloat16 sampling copy", "threads": 1,
                       "positions": args.positions, "timed_steps": TIMED, "rows": {}}
    for rows in args.rows:
        times, reference = step_times(eager, model, rows, args.positions)
        before = statistics.median(times)
        torch._dynamo.reset()
        compiled = torch.compile(eager, dynamic=False)
        started = time.perf_counter()
        step_times(compiled, model, rows, args.positions)  # compiles
        compile_seconds = time.perf_counter() - started
        times, logits = step_times(compiled, model, rows, args.positions)
        compiled_ms = 1000 * statistics.median(times)
        after = statistics.median(step_times(eager, model, rows, args.positions)[0])
        eager_ms = 1000 * (before + after) / 2
        result.figures["rows"][str(rows)] = row = {
            "eager_step_ms": round(eager_ms, 1),
            "eager_step_ms_before_after": [round(1000 * before, 1), round(1000 * after, 1)],
            "compiled_step_ms": round(compiled_ms, 1),
            "compiled_speedup": round(eager_ms / compiled_ms, 2),
            "compile_seconds": round(compile_seconds, 1),
            "max_logit_difference": round(float((logits - reference).abs().max()), 3)}
        print(rows, row, file=sys.stderr, flush=True)
        result.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
