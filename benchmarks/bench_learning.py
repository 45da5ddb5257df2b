"""Does SFT on oracle demonstrations make the embedded model succeed on held-out tasks?

    python benchmarks/bench_learning.py [--epochs 4] [--out benchmarks/results/learning.json]
    python benchmarks/bench_learning.py --only opd --sft-checkpoint PATH    # OPD, below
    python benchmarks/bench_learning.py --only tempo --sft-checkpoint PATH  # TEMPO, below

Env: Search-v0 on its bundled corpus. Why this one: its oracle episodes are short (2 to 4
replies of 10 to 30 tokens, about 350 tokens in all, against ~900 for an ALFWorld game and
code the model would have to write for CodeInterpreter-v0), its questions come in a dozen
templates over different entities, so a 135M model can learn the *procedure* (search the
entity, copy the answer out of the passage) rather than the facts, and a training step
fits in seconds on one CPU thread.

Split: the bundled set has a single split, so this script writes one from it: every fourth
question (index % 4 == 3) is held out, the rest is trained on. That spreads each template
over both sides and no held-out question is ever trained on. (The split belongs in the
env's data; the env package is being restructured, so it lives here until it can move.)

Measured: held-out success of the base model and of the SFT checkpoint with greedy
decoding (``agent-gym eval``, same seed, same tasks), each with its episode count and 95%
Wilson interval, and the held-out demonstrations' NLL per token before and after. Writes
``--out`` (JSON) and the training curve to the same name with ``.png``.

Measured here (one torch thread, 2 cores shared, load 2-10): base 0/18 [0.00, 0.18];
after 2 epochs (28 steps) 4/18 [0.09, 0.45], held-out NLL 2.14 -> 0.14; continued to 4
epochs (56 steps) 14/18 [0.55, 0.91], NLL 0.04 (9/10 one-hop, 5/7 two-hop, 0/1 three-hop).

OPD (``--only opd``): the SFT checkpoint (``--sft-checkpoint``, trained on the train split)
teaches the base model by on-policy distillation on the train split: the student samples,
the teacher scores the student's tokens, A_t = -(log pi_student - log pi_teacher) (no env
reward). Measured: ``reverse_kl_mean`` averaged over the first and last ``--opd-edge`` steps,
and greedy held-out success of base, student and teacher (same eval as above, with 95%
Wilson intervals). Writes the ``opd`` key of ``--out`` and ``learning-opd.png``.

TEMPO (``--only tempo``): TEMPO from the SFT checkpoint (its outcomes vary, so a constant
value is not perfect) on the train split, horizon 1: critic warm-up on Monte Carlo returns,
then TD updates. Measured after the warm-up: the critic's parse rate over all its samples
and its absolute error against the best constant in hindsight (per update, the median of
the targets) on the same parsed samples. Writes the ``tempo`` key and ``learning-tempo.png``.
Both sections record the load average next to their figures.

Measured here (one torch thread, 2 cores shared, load 8-35), TEMPO from the 2-epoch SFT
checkpoint (step 28), 3 warm-up + 4 TD updates, horizon 1, 2 tasks x 2 branches, K=4:
warm-up found 14 boundary states; after warm-up the critic parsed 53/54 samples (98%),
but its absolute error was 0.078 against 0.031 for the best constant on the same 32
parsed samples (8 states): not below it. The outcomes barely varied (train reward 0.06 on
average), so the constant was nearly right. OPD from the same checkpoint (teacher: 9/18
held out [0.29, 0.71]) into the base model, 16 steps of 2 tasks x 2 episodes at lr 1e-3:
reverse_kl_mean 0.71 over the first 3 steps, 0.75 over the last 3 (not lowered), held-out
success base 0/18 [0.00, 0.18], student 0/18 [0.00, 0.18]: not met.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainers.opd import Args as OpdArgs  # noqa: E402
from trainers.opd import train as opd_train  # noqa: E402
from trainers.sft import Args, train  # noqa: E402
from trainers.tempo import Args as TempoArgs  # noqa: E402
from trainers.tempo import train as tempo_train  # noqa: E402

ENV_ID = "agent_gym/Search-v0"
HELD_OUT_EVERY = 4  # index % 4 == 3 is held out


def write_split(folder: Path) -> tuple[Path, Path]:
    """The bundled questions as two JSONL files: train and held out."""
    source = ROOT / "agent_gym" / "datasets" / "search_qa.jsonl"
    rows = [line for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
    folder.mkdir(parents=True, exist_ok=True)
    train_path, test_path = folder / "train.jsonl", folder / "test.jsonl"
    train_path.write_text("".join(r + "\n" for i, r in enumerate(rows)
                                  if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1))
    test_path.write_text("".join(r + "\n" for i, r in enumerate(rows)
                                 if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1))
    return train_path, test_path


def evaluate(policy: str, test_path: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Greedy episodes of ``policy`` on every held-out task, through ``agent-gym eval``."""
    episodes = sum(1 for line in test_path.read_text().splitlines() if line.strip())
    command = [sys.executable, "-m", "agent_gym.cli", "eval", ENV_ID, "--policy", policy,
               "--episodes", str(episodes), "--concurrency", "1", "--out", str(out),
               "--max-tokens", str(args.max_tokens), "--env-arg", f"data_path={test_path}",
               "--env-arg", f"max_turns={args.max_turns}", "--quiet"]
    started = time.perf_counter()
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run(command, check=True, env=env)
    summary = json.loads((out / "summary.json").read_text())
    return {"policy": policy, "episodes": summary["episodes"],
            "successes": round(summary["success_rate"] * summary["episodes"]),
            "success_rate": summary["success_rate"],
            "success_ci95": [summary["success_low"], summary["success_high"]],
            "mean_turns": summary["mean_turns"], "errors": summary["errors"],
            "seconds": round(time.perf_counter() - started, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--max-tokens", type=int, default=48, help="per reply in eval")
    parser.add_argument("--max-turns", type=int, default=4, help="per held-out episode")
    parser.add_argument("--work", default="runs/bench-learning")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/learning.json"))
    parser.add_argument("--only", choices=SECTIONS, default=None,
                        help="one section (default: SFT, the section without a switch)")
    add_opd_options(parser)
    add_tempo_options(parser)
    options = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    work = Path(options.work)
    if options.only in SECTIONS:
        return SECTIONS[options.only](options, work)
    train_path, test_path = write_split(work / "data")
    load_before = os.getloadavg()
    started = time.perf_counter()

    base = evaluate("local:smollm2", test_path, work / "eval-base", options)
    sft_args = Args(env_id=ENV_ID, env_kwargs={"data_path": str(train_path)},
                    heldout_env_kwargs={"data_path": str(test_path)}, threads=1,
                    epochs=options.epochs, batch_size=options.batch_size,
                    learning_rate=options.learning_rate, out=str(work / "sft"),
                    save_every=1000, progress=False)
    t0 = time.perf_counter()
    history = train(sft_args)
    train_seconds = time.perf_counter() - t0
    checkpoint = json.loads((work / "sft" / "checkpoint.json").read_text())["path"]
    after = evaluate(f"local:smollm2@{checkpoint}", test_path, work / "eval-sft", options)
    demos = json.loads((work / "sft" / "demonstrations.json").read_text())

    result = {
        "command": " ".join(["python", *sys.argv]),
        "env_id": ENV_ID,
        "split": {"train_tasks": demos["used"], "heldout_tasks": base["episodes"],
                  "rule": "bundled search_qa.jsonl, index % 4 == 3 held out"},
        "sft": {"epochs": options.epochs, "steps": len(history),
                "batch_size": options.batch_size, "learning_rate": options.learning_rate,
                "lora_rank": sft_args.lora_rank, "demonstrations": demos,
                "heldout_nll_before": history[0].get("heldout_nll_before"),
                "heldout_nll_after": history[-1].get("heldout_nll"),
                "train_loss_first": history[0]["loss"], "train_loss_last": history[-1]["loss"],
                "seconds": round(train_seconds, 1)},
        "eval": {"decoding": "greedy", "max_tokens": options.max_tokens,
                 "max_turns": options.max_turns, "base": base, "sft": after},
        "total_seconds": round(time.perf_counter() - started, 1),
        "load_average_start": load_before, "load_average_end": os.getloadavg(),
        "torch_threads": 1,
    }
    out = Path(options.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    _plot([row["loss"] for row in history], out.with_suffix(".png"))
    print(json.dumps(result["eval"] | {"nll": [result["sft"]["heldout_nll_before"],
                                               result["sft"]["heldout_nll_after"]]}))
    return 0


def _plot(losses: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5, 3))
    axis.plot(range(1, len(losses) + 1), losses, marker="o", markersize=3)
    axis.set_xlabel("SFT step")
    axis.set_ylabel("train NLL per demonstrated token")
    axis.set_title(f"SFT on {ENV_ID} oracle demonstrations")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# --------------------------------------------------------------------- shared by OPD, TEMPO
def merge_result(path: Path, key: str, section: dict[str, Any]) -> None:
    """Write ``section`` under ``key`` of the results file, keeping every other key."""
    kept = json.loads(path.read_text()) if path.is_file() else {}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(kept | {key: section}, indent=1) + "\n")


def needs_checkpoint(options: argparse.Namespace, role: str) -> str:
    if not options.sft_checkpoint:
        sys.exit(f"bench_learning: --only {options.only} needs --sft-checkpoint PATH ({role}); "
                 "make one with: agent-gym train sft --env-kwargs "
                 "'{\"data_path\": \"DATA/train.jsonl\"}' --epochs 4 --out DIR, then pass the "
                 "path in DIR/checkpoint.json")
    return str(options.sft_checkpoint)


def _load() -> dict[str, Any]:
    return {"load_average": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
            "torch_threads": 1}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


# --------------------------------------------------------------------- OPD (--only opd)
def add_opd_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--only opd / --only tempo")
    group.add_argument("--sft-checkpoint", default=None,
                       help="an SFT checkpoint on the train split: OPD's teacher, TEMPO's "
                            "starting policy")
    group.add_argument("--sft-command", default=None,
                       help="the command that made --sft-checkpoint, recorded with the figures")
    group.add_argument("--opd-steps", type=int, default=16)
    group.add_argument("--opd-batch-size", type=int, default=2, help="tasks per OPD step")
    group.add_argument("--opd-group-size", type=int, default=2, help="episodes per task")
    group.add_argument("--opd-learning-rate", type=float, default=5e-4)
    group.add_argument("--opd-edge", type=int, default=3,
                       help="steps averaged at each end of the run for the KL ratio")


def run_opd(options: argparse.Namespace, work: Path) -> int:
    """On-policy distillation of the SFT checkpoint (teacher) into the base model (student)
    on the train split, then greedy held-out success of base, student and teacher.

    ``reverse_kl_mean`` is the per-token sample of KL(student || teacher) on the student's
    own episodes of each step; the first and last ``--opd-edge`` steps are averaged so one
    lucky step does not make the figure.
    """
    teacher = needs_checkpoint(options, "the teacher")
    train_path, test_path = write_split(work / "data")
    load_start = _load()
    args = OpdArgs(env_id=ENV_ID, env_kwargs={"data_path": str(train_path),
                                             "max_turns": options.max_turns},
                   teacher=f"local:smollm2@{teacher}", privileged=False,
                   steps=options.opd_steps, batch_size=options.opd_batch_size,
                   group_size=options.opd_group_size, max_tokens=options.max_tokens,
                   learning_rate=options.opd_learning_rate, threads=1,
                   save_every=options.opd_steps, out=str(work / "opd"), progress=False)
    # base and teacher are evaluated while the student trains (eval processes of one torch
    # thread each; the CPU is shared anyway), the student after
    with ThreadPoolExecutor(2) as pool:
        running = {name: pool.submit(evaluate, policy, test_path, work / f"eval-opd-{name}",
                                     options)
                   for name, policy in (("base", "local:smollm2"),
                                        ("teacher", f"local:smollm2@{teacher}"))}
        started = time.perf_counter()
        history = opd_train(args)
        train_seconds = time.perf_counter() - started
        load_trained = _load()
        student = json.loads((work / "opd" / "checkpoint.json").read_text())["path"]
        done = evaluate(f"local:smollm2@{student}", test_path, work / "eval-opd-opd", options)
        evals = {"base": running["base"].result(), "opd": done,
                 "teacher": running["teacher"].result()}
    kl = [row["reverse_kl_mean"] for row in history if row["reverse_kl_mean"] is not None]
    edge = min(options.opd_edge, len(kl) // 2) or 1
    section = {
        "command": " ".join(["python", *sys.argv]),
        "teacher": {"checkpoint": teacher, "made_by": options.sft_command},
        "student": "smollm2 (base), LoRA rank 32",
        "train_split": "bundled search_qa.jsonl, index % 4 != 3",
        "settings": {"steps": args.steps, "batch_size": args.batch_size,
                     "group_size": args.group_size, "max_tokens": args.max_tokens,
                     "max_turns": options.max_turns, "learning_rate": args.learning_rate,
                     "kl_coef": args.kl_coef, "reward_coef": args.reward_coef,
                     "privileged": args.privileged, "temperature": args.temperature},
        "reverse_kl_per_step": kl,
        "reverse_kl_first": _mean(kl[:edge]), "reverse_kl_last": _mean(kl[-edge:]),
        "reverse_kl_last_over_first": _mean(kl[-edge:]) / _mean(kl[:edge]),
        "averaged_steps_each_end": edge,
        "episodes_trained": sum(row["episodes"] for row in history),
        "train_reward_per_step": [row["reward_mean"] for row in history],
        "turns_mean_per_step": [row["turns_mean"] for row in history],
        "cut_rate_per_step": [row["cut_rate"] for row in history],
        "heldout": evals | {"decoding": "greedy", "max_tokens": options.max_tokens,
                            "max_turns": options.max_turns},
        "train_seconds": round(train_seconds, 1),
        "load_start": load_start, "load_after_training": load_trained, "load_end": _load(),
    }
    out = Path(options.out)
    merge_result(out, "opd", section)
    _plot_opd(history, out.with_name(out.stem + "-opd.png"))
    print(json.dumps({k: section[k] for k in ("reverse_kl_first", "reverse_kl_last",
                                              "reverse_kl_last_over_first")}
                     | {name: (e["successes"], e["episodes"], e["success_ci95"])
                        for name, e in evals.items()}))
    return 0


def _plot_opd(history: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row["step"] + 1 for row in history]
    figure, (kl_axis, reward_axis) = plt.subplots(1, 2, figsize=(9, 3))
    kl_axis.plot(steps, [row["reverse_kl_mean"] for row in history], marker="o", markersize=3)
    kl_axis.set_xlabel("OPD step")
    kl_axis.set_ylabel("reverse KL per sampled token")
    kl_axis.set_title("student (base) vs SFT teacher")
    reward_axis.plot(steps, [row["reward_mean"] for row in history], marker="o", markersize=3)
    reward_axis.set_xlabel("OPD step")
    reward_axis.set_ylabel("train episode reward (not optimised)")
    figure.suptitle(f"On-policy distillation on {ENV_ID} (train split)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# --------------------------------------------------------------------- TEMPO (--only tempo)
def add_tempo_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--only tempo")
    group.add_argument("--tempo-warmup", type=int, default=3)
    group.add_argument("--tempo-td", type=int, default=4)
    group.add_argument("--tempo-batch-size", type=int, default=2)
    group.add_argument("--tempo-branches", type=int, default=2)
    group.add_argument("--tempo-critic-samples", type=int, default=4)
    group.add_argument("--tempo-horizon", type=int, default=1)
    group.add_argument("--tempo-learning-rate", type=float, default=1e-4)


class FromCheckpoint:
    """The local service, except that a new training client starts from ``path``'s weights
    (a fresh optimizer): how a TEMPO run here continues the SFT policy rather than the base
    model. Everything else goes to the service itself."""

    def __init__(self, service: Any, path: str) -> None:
        self.service, self.path = service, path

    def __getattr__(self, name: str) -> Any:
        return getattr(self.service, name)

    def create_lora_training_client(self, *args: Any, **kwargs: Any) -> Any:
        return self.service.create_training_client_from_state(self.path)


def run_tempo(options: argparse.Namespace, work: Path) -> int:
    """TEMPO from the SFT checkpoint on the train split: critic warm-up on Monte Carlo
    returns, then TD updates. Measured after the warm-up (the TD updates): the critic's
    parse rate over every critic sample, and its absolute error against the best constant
    in hindsight on the same parsed samples (per update, the median of their targets: the
    constant is re-fitted to each update, which favours it), both pooled over samples."""
    from trainers.backends.local import LocalServiceClient

    start = needs_checkpoint(options, "the starting policy")
    train_path, _ = write_split(work / "data")
    load_start = _load()
    args = TempoArgs(env_id=ENV_ID, env_kwargs={"data_path": str(train_path),
                                               "max_turns": options.max_turns},
                     warmup_updates=options.tempo_warmup, td_updates=options.tempo_td,
                     batch_size=options.tempo_batch_size, branches=options.tempo_branches,
                     critic_samples=options.tempo_critic_samples, endpoint_samples=2,
                     horizon=options.tempo_horizon, fresh_fraction=0.5,
                     max_tokens=options.max_tokens, max_trajectory_tokens=4096,
                     learning_rate=options.tempo_learning_rate, threads=1,
                     save_every=1000, out=str(work / "tempo"), progress=False)
    service = LocalServiceClient(checkpoint_dir=work / "tempo" / "checkpoints", threads=1)
    started = time.perf_counter()
    history = tempo_train(args, FromCheckpoint(service, start))
    seconds = time.perf_counter() - started

    def pooled(rows: list[dict[str, Any]]) -> dict[str, Any]:
        samples = sum(row["critic/samples"] for row in rows)
        failed = sum(row["critic/parse_failure_rate"] * row["critic/samples"]
                     for row in rows if row["critic/samples"])
        scored = [row for row in rows if row["critic/parsed"]]
        parsed = sum(row["critic/parsed"] for row in scored)
        error = sum(row["critic/abs_error_mean"] * row["critic/parsed"] for row in scored)
        constant = sum(row["critic/abs_error_constant"] * row["critic/parsed"] for row in scored)
        return {"updates": len(rows), "critic_samples": samples,
                "parse_rate": (samples - failed) / samples if samples else None,
                "trained_samples_parsed": parsed,
                "abs_error": error / parsed if parsed else None,
                "abs_error_best_constant": constant / parsed if parsed else None,
                "states": sum(row["critic/states"] for row in rows),
                "target_mean": _mean([row["critic/target_mean"] for row in rows
                                      if row["critic/target_mean"] is not None] or [0.0])}

    warmup = [row for row in history if row["phase"] == "warmup"]
    td = [row for row in history if row["phase"] == "td"]
    kept = ("step", "phase", "critic/abs_error_mean", "critic/abs_error_constant",
            "critic/parse_failure_rate", "critic/samples", "critic/parsed", "critic/states",
            "critic/target_mean", "critic/value_mean", "critic/value_corr", "reward_mean",
            "turns_mean", "cut_replies", "warmup/boundary_states", "td/restored_states",
            "td/fresh_states", "td/store_size", "actor/datums", "critic/datums", "time_step")
    section = {
        "command": " ".join(["python", *sys.argv]),
        "start": {"checkpoint": start, "made_by": options.sft_command},
        "env": {"env_id": ENV_ID, "data": "train split (index % 4 != 3)",
                "max_turns": options.max_turns},
        "settings": {k: getattr(args, k) for k in (
            "warmup_updates", "td_updates", "batch_size", "horizon", "branches",
            "critic_samples", "endpoint_samples", "fresh_fraction", "max_tokens",
            "critic_max_tokens", "learning_rate", "lora_rank", "cut_continues")},
        "warmup": pooled(warmup),
        "after_warmup": pooled(td),
        "per_update": [{k: row.get(k) for k in kept} for row in history],
        "seconds": round(seconds, 1), "load_start": load_start, "load_end": _load(),
    }
    after = section["after_warmup"]
    section["targets"] = {
        "parse_rate_at_least_0.95": after["parse_rate"] is not None
        and after["parse_rate"] >= 0.95,
        "abs_error_below_best_constant": after["abs_error"] is not None
        and after["abs_error"] < after["abs_error_best_constant"],
    }
    out = Path(options.out)
    merge_result(out, "tempo", section)
    _plot_tempo(history, out.with_name(out.stem + "-tempo.png"))
    print(json.dumps({"warmup": section["warmup"], "after_warmup": after,
                      "targets": section["targets"]}))
    return 0


def _plot_tempo(history: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row["step"] + 1 for row in history]
    figure, (error_axis, parse_axis) = plt.subplots(1, 2, figsize=(9, 3))
    for key, label, style in (("critic/abs_error_mean", "critic", "-o"),
                              ("critic/abs_error_constant", "best constant", "--s")):
        error_axis.plot(steps, [row[key] for row in history], style, markersize=3, label=label)
    error_axis.set_ylabel("absolute error of the value")
    error_axis.legend()
    parse_axis.plot(steps, [1 - (row["critic/parse_failure_rate"] or 0.0) for row in history],
                    "-o", markersize=3)
    parse_axis.axhline(0.95, color="grey", linestyle=":")
    parse_axis.set_ylabel("critic parse rate")
    warm = sum(row["phase"] == "warmup" for row in history)
    for axis in (error_axis, parse_axis):
        axis.set_xlabel("TEMPO update")
        axis.axvspan(0.5, warm + 0.5, color="grey", alpha=0.15)
    figure.suptitle(f"TEMPO critic on {ENV_ID} from the SFT checkpoint (warm-up shaded)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


SECTIONS = {"opd": run_opd, "tempo": run_tempo}


if __name__ == "__main__":
    sys.exit(main())
