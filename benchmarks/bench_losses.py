"""What a loss through ``forward_backward_custom`` costs on the local backend, against the
built-in loss in the same run, and whether it trains the same update.

SmolLM2-135M with LoRA r32 on one torch thread; one GRPO group's datums (one shared prompt,
the first 40% of positions masked) whose sampler logprobs are the learner's own plus noise
(sd ``--noise`` 0.3, so some ratios leave ppo's clip range). Variants, alternated
``--repeats`` times so load drift hits all of them, each on the same weights with its
gradient cleared:

- ``ppo``: the built-in ``forward_backward(datums, "ppo")`` (the baseline);
- ``ppo_custom``: the same objective as ``agent_gym_train.run.losses.policy_loss`` through
  ``forward_backward_custom`` (one extra forward pass, as on pytrio);
- ``gspo``, ``ppo_sequence_mean``: losses only the custom path has.

Reported: best wall and CPU seconds per variant, their ratio to ``ppo``, and the relative
difference between ``ppo_custom``'s parameter gradient and ``ppo``'s.

    PYTHONPATH=. python benchmarks/bench_losses.py [--out benchmarks/results/losses.json]
        [--datums 4] [--tokens 160] [--repeats 2] [--noise 0.3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from harness import RESULTS, Result
from pytrio import Datum, ModelInput

from agent_gym_train.backends.local import LocalServiceClient, LocalTrainingClient
from agent_gym_train.run.losses import Objective, policy_loss

PPO = Objective("ppo")


def custom_ppo(client: LocalTrainingClient, datums: list[Datum]) -> Any:
    """ppo's token-mean objective, forced through the custom path."""
    config = {"loss": "ppo", "aggregation": "token-mean", **(PPO.thresholds() or {})}
    return client.forward_backward_custom(datums, policy_loss, config)


VARIANTS: dict[str, Callable[[LocalTrainingClient, list[Datum]], Any]] = {
    "ppo": PPO.forward_backward,
    "ppo_custom": custom_ppo,
    "gspo": Objective("gspo").forward_backward,
    "ppo_sequence_mean": Objective("ppo", "sequence-mean").forward_backward,
}


def group_datums(count: int, length: int, masked: float = 0.4) -> list[Datum]:
    """One GRPO group: ``count`` sequences of ``length`` tokens sharing a prompt (the first
    ``masked`` of the positions), random token ids, advantages +-0.5 in turn."""
    generator = torch.Generator().manual_seed(0)
    prompt_length = int(length * masked) + 1
    prompt = torch.randint(10, 49000, (prompt_length,), generator=generator).tolist()
    datums = []
    for i in range(count):
        reply = torch.randint(10, 49000, (length + 1 - prompt_length,), generator=generator)
        tokens = prompt + reply.tolist()
        targets = [-100 if j < prompt_length - 1 else t for j, t in enumerate(tokens[1:])]
        advantage = 0.5 if i % 2 else -0.5
        datums.append(Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": targets,
            "logprobs": [0.0] * len(targets),  # replaced by near_policy
            "advantages": [advantage if t != -100 else 0.0 for t in targets],
        }))
    return datums


def near_policy(client: LocalTrainingClient, datums: list[Datum], noise: float) -> list[Datum]:
    """The datums with sampler logprobs = the learner's own plus Gaussian noise."""
    own = client.forward(datums, "cross_entropy").result().loss_fn_outputs
    generator = torch.Generator().manual_seed(1)
    out = []
    for datum, scored in zip(datums, own, strict=True):
        learner = torch.tensor(scored["logprobs"].data)
        trained = torch.tensor(datum.loss_fn_inputs["target_tokens"].data) != -100
        shifted = learner + noise * torch.randn(learner.shape, generator=generator)
        inputs = dict(datum.loss_fn_inputs)
        inputs["logprobs"] = torch.where(trained, shifted, 0.0).tolist()
        out.append(Datum(model_input=datum.model_input, loss_fn_inputs=inputs))
    return out


def run_variant(client: LocalTrainingClient, variant: str, datums: list[Datum]
                ) -> tuple[dict[str, Any], torch.Tensor]:
    for parameter in client.model.parameters():
        parameter.grad = None
    start, start_cpu = time.perf_counter(), time.process_time()
    metrics = VARIANTS[variant](client, datums).result().metrics
    elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    grad = torch.cat([p.grad.flatten() for p in client.model.parameters() if p.grad is not None])
    return {"seconds": round(elapsed, 2), "cpu_seconds": round(cpu, 2),
            "loss_mean": metrics["loss_mean"], "clip_fraction": metrics.get("clip_fraction"),
            "load": round(os.getloadavg()[0], 2)}, grad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "losses.json"))
    parser.add_argument("--datums", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--noise", type=float, default=0.3)
    args = parser.parse_args(argv)
    record = Result()
    with tempfile.TemporaryDirectory() as tmp:
        service = LocalServiceClient(checkpoint_dir=tmp, device="cpu", threads=1)
        client = service.create_lora_training_client("smollm2", rank=32, seed=0)
        datums = near_policy(client, group_datums(args.datums, args.tokens), args.noise)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
        grads: dict[str, torch.Tensor] = {}
        for _ in range(args.repeats):
            for name in VARIANTS:
                row, grads[name] = run_variant(client, name, datums)
                runs[name].append(row)
                print(f"{name}: {row}", file=sys.stderr, flush=True)
    best = {name: min(r["seconds"] for r in rows) for name, rows in runs.items()}
    best_cpu = {name: min(r["cpu_seconds"] for r in rows) for name, rows in runs.items()}
    difference = (grads["ppo_custom"] - grads["ppo"]).abs().max() / grads["ppo"].abs().max()
    result = record.figures
    result |= {
        "model": "smollm2", "lora_rank": 32, "threads": 1, "datums": args.datums,
        "tokens_per_datum": args.tokens, "masked_fraction": 0.4, "repeats": args.repeats,
        "noise": args.noise,
        "runs": runs,
        "seconds_vs_builtin_ppo": {n: round(best[n] / best["ppo"], 2) for n in best},
        "cpu_seconds_vs_builtin_ppo": {n: round(best_cpu[n] / best_cpu["ppo"], 2)
                                       for n in best_cpu},
        "ppo_custom_grad_max_rel_diff": float(difference),
        "ppo_custom_loss_mean_diff": abs(runs["ppo_custom"][0]["loss_mean"]
                                         - runs["ppo"][0]["loss_mean"]),
    }
    record.write(args.out)
    print(json.dumps({k: result[k] for k in ("seconds_vs_builtin_ppo",
                                             "cpu_seconds_vs_builtin_ppo",
                                             "ppo_custom_grad_max_rel_diff")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
