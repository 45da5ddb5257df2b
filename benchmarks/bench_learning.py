"""Do the trainers make the embedded model better on a bundled env's held-out tasks?

    python benchmarks/bench_learning.py                 # every section, in order
    python benchmarks/bench_learning.py --only grpo     # one section (its inputs must exist)
    python benchmarks/bench_learning.py --only opd --sft-checkpoint PATH

Env: Search-v0 on its bundled corpus. Why this one: its oracle episodes are short (2 to 4
replies of 10 to 30 tokens, about 350 tokens in all, against ~900 for an ALFWorld game and
code the model would have to write for CodeInterpreter-v0), its questions come in a dozen
templates over different entities, so a 135M model can learn the *procedure* (search the
entity, copy the answer out of the passage) rather than the facts, and a training step
fits in seconds on one CPU thread.

Split: the env's own (``split="train"``: 56 questions, ``split="test"``: 18, every fourth
question held out, written in ``search_qa.jsonl``). Nothing trains on a test question.

Sections (``--only``), each merged into ``--out`` under its name, so one can be re-run:

- ``sft``: held-out success of the base model and of the SFT checkpoint (greedy
  ``agent-gym eval``, same seed, same tasks), with counts and 95% Wilson intervals; the
  held-out demonstrations' NLL per token before and after; a checkpoint every epoch.
- ``grpo``: GRPO continued from an SFT checkpoint (``--init-from``) on the train split:
  groups that trained (non-degenerate) and reward of the first vs the last steps, with
  episode counts and intervals, then held-out success of the GRPO checkpoint. It starts
  from the checkpoint after ``--grpo-from-epoch`` SFT epochs (default 1, the one
  ``make run`` trains): sampled at temperature 1 it solves some train tasks and not
  others, so groups can differ; a group of 4 that all succeed or all fail is degenerate
  and trains nothing, and those are counted.
- ``opd``: on-policy distillation of an SFT checkpoint (``--sft-checkpoint``, else the
  ``sft`` section's) into the base model on the train split: the student samples, the
  teacher scores the student's tokens, A_t = -(log pi_student - log pi_teacher), no env
  reward; with ``--opd-teacher-labels`` the teacher's greedy replies at the student's
  states train too (OPD's ``--teacher-labels``). ``reverse_kl_mean`` averaged over the
  first and last ``--opd-edge`` steps, and greedy held-out success of base, student and
  teacher. Also ``learning-opd.png``.
- ``tempo``: TEMPO from an SFT checkpoint (its outcomes vary, so a constant value is not
  perfect) on the train split: critic warm-up on Monte Carlo returns, then TD updates.
  After the warm-up: the critic's parse rate over all its samples and its absolute error
  against the best constant in hindsight on the same values (one constant for all of
  them, the median of their targets; the constant re-fitted to each update is reported
  too), with a bootstrap interval of the per-state gain. Also ``learning-tempo.png``.
- ``tempo_pooled`` (only with ``--only``): the after-warm-up figures of several TEMPO runs
  (``--pool-tempo`` their run directories, replicates with other ``--tempo-seed``s) pooled
  over all their states, and each run's.

SFT here is one epoch at learning rate 1e-3 by default (``--preset cpu-demo``'s, what
``make run`` trains); the earlier measurement of 4 epochs at 2e-4 (0/18 -> 14/18 held
out) took about an hour on the shared cores.

The training curves go to ``--out`` with ``.png``. Figures and their load: in ``--out``;
what the runs measured is in ``docs/experiments/learning.md`` and ``tempo.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import RESULTS, Result, figures_in, timed  # noqa: E402

from agent_gym.eval.stats import bootstrap_interval, wilson_interval  # noqa: E402
from agent_gym_train import grpo, sft  # noqa: E402
from agent_gym_train.critic import best_constant_error, value_corr  # noqa: E402
from agent_gym_train.opd import Args as OpdArgs  # noqa: E402
from agent_gym_train.opd import train as opd_train  # noqa: E402
from agent_gym_train.run.files import read_metrics  # noqa: E402
from agent_gym_train.tempo import Args as TempoArgs  # noqa: E402
from agent_gym_train.tempo import train as tempo_train  # noqa: E402

ENV_ID = "agent_gym/Search-v0"
TRAIN, TEST = {"split": "train"}, {"split": "test"}


def evaluate(policy: str, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Greedy episodes of ``policy`` on every held-out task, through ``agent-gym eval``."""
    command = [sys.executable, "-m", "agent_gym.cli", "eval", ENV_ID, "--policy", policy,
               "--episodes", "18", "--concurrency", "8", "--out", str(out),
               "--max-tokens", str(args.max_tokens), "--split", "test",
               "--env-arg", f"max_turns={args.max_turns}", "--quiet"]
    started = time.perf_counter()
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                        "AGENT_GYM_THREADS": "1"}
    subprocess.run(command, check=True, env=env)
    summary = json.loads((out / "summary.json").read_text())
    return {"policy": policy, "command": " ".join(command[2:]), "episodes": summary["episodes"],
            "successes": round(summary["success_rate"] * summary["episodes"]),
            "success_rate": summary["success_rate"],
            "success_ci95": [summary["success_low"], summary["success_high"]],
            "mean_turns": summary["mean_turns"], "errors": summary["errors"],
            "seconds": round(time.perf_counter() - started, 1)}


def counted(successes: int, episodes: int) -> dict[str, Any]:
    low, high = wilson_interval(successes, episodes)
    return {"successes": successes, "episodes": episodes,
            "rate": successes / episodes if episodes else None,
            "ci95": [round(low, 3), round(high, 3)]}


def fresh(*folders: Path) -> None:
    """A section re-measures: its previous run and eval directories (which would resume
    instead) are removed first."""
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def section_sft(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    fresh(work / "eval-base", work / "sft", work / "eval-sft")
    base = evaluate("local:smollm2", work / "eval-base", args)
    steps_per_epoch = 14  # 56 train demonstrations / batch 4
    sft_args = sft.Args(env_id=ENV_ID, env_kwargs=TRAIN, heldout_env_kwargs=TEST,
                        threads=1, epochs=args.epochs, batch_size=4,
                        learning_rate=args.sft_learning_rate, out=str(work / "sft"),
                        save_every=steps_per_epoch, heldout_every=steps_per_epoch,
                        progress=False)
    t0 = time.perf_counter()
    history = sft.train(sft_args)
    train_seconds = time.perf_counter() - t0
    checkpoint = json.loads((work / "sft" / "checkpoint.json").read_text())["path"]
    after = evaluate(f"local:smollm2@{checkpoint}", work / "eval-sft", args)
    demos = json.loads((work / "sft" / "demonstrations.json").read_text())
    epochs = {str(row["epoch"] + 1): row.get("heldout_nll") for row in history
              if "heldout_nll" in row}
    return {
        "command": f"agent-gym train sft --env-kwargs '{json.dumps(TRAIN)}' "
                   f"--heldout-env-kwargs '{json.dumps(TEST)}' --epochs {args.epochs} "
                   f"--batch-size 4 --learning-rate {args.sft_learning_rate} --threads 1",
        "epochs": args.epochs, "steps": len(history), "batch_size": 4,
        "learning_rate": args.sft_learning_rate, "lora_rank": sft_args.lora_rank,
        "demonstrations": demos,
        "heldout_nll_before": history[0].get("heldout_nll_before"),
        "heldout_nll_by_epoch": epochs,
        "train_loss_first": history[0]["loss"], "train_loss_last": history[-1]["loss"],
        "step_seconds_mean": round(train_seconds / len(history), 1),
        "seconds": round(train_seconds, 1),
        "checkpoints": {str(i + 1): str(p) for i, p in enumerate(
            sorted(Path(checkpoint).parent.glob("step-*")))},
        "eval": {"decoding": "greedy", "max_tokens": args.max_tokens,
                 "max_turns": args.max_turns, "base": base, "sft": after},
    }


def section_grpo(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    sft_checkpoints = sorted((work / "sft" / "checkpoints").glob("run-*/step-*"))
    if len(sft_checkpoints) < args.grpo_from_epoch:
        raise SystemExit(f"run the sft section first: no epoch-{args.grpo_from_epoch} "
                         f"checkpoint under {work / 'sft'}")
    start = str(sft_checkpoints[args.grpo_from_epoch - 1])
    fresh(work / "grpo", work / "eval-grpo")
    grpo_args = grpo.Args(env_id=ENV_ID, env_kwargs=TRAIN, init_from=start, threads=1,
                          steps=args.grpo_steps, batch_size=2, group_size=4,
                          max_tokens=args.max_tokens, max_turns=args.max_turns,
                          learning_rate=args.grpo_learning_rate, out=str(work / "grpo"),
                          save_every=args.grpo_steps, progress=False)
    t0 = time.perf_counter()
    grpo.train(grpo_args)
    train_seconds = time.perf_counter() - t0
    rows = read_metrics(work / "grpo" / "metrics.jsonl")
    checkpoint = json.loads((work / "grpo" / "checkpoint.json").read_text())["path"]
    after = evaluate(f"local:smollm2@{checkpoint}", work / "eval-grpo", args)
    window = max(1, len(rows) // 3)

    def steps_summary(chosen: list[dict[str, Any]]) -> dict[str, Any]:
        episodes = sum(int(r["groups"]) * 4 for r in chosen)
        successes = round(sum(float(r["reward_mean"]) * int(r["groups"]) * 4 for r in chosen))
        return {"steps": [r["step"] for r in chosen], **counted(successes, episodes),
                "groups": sum(int(r["groups"]) for r in chosen),
                "degenerate_groups": sum(int(r["degenerate_groups"]) for r in chosen)}

    return {
        "command": f"agent-gym train grpo --env-id {ENV_ID} --env-kwargs '{json.dumps(TRAIN)}' "
                   f"--init-from {start} --steps {args.grpo_steps} --batch-size 2 "
                   f"--group-size 4 --max-tokens {args.max_tokens} --max-turns "
                   f"{args.max_turns} --learning-rate {args.grpo_learning_rate} --threads 1",
        "from_sft_epoch": args.grpo_from_epoch, "init_from": start,
        "steps": len(rows), "batch_size": 2, "group_size": 4,
        "learning_rate": args.grpo_learning_rate,
        "trained_steps": sum(1 for r in rows if r["datums"]),
        "groups": sum(int(r["groups"]) for r in rows),
        "degenerate_groups": sum(int(r["degenerate_groups"]) for r in rows),
        "reward_by_step": [round(float(r["reward_mean"]), 3) for r in rows],
        "first_steps": steps_summary(rows[:window]), "last_steps": steps_summary(rows[-window:]),
        "step_seconds_mean": round(train_seconds / max(1, len(rows)), 1),
        "seconds": round(train_seconds, 1),
        "eval": {"decoding": "greedy", "max_tokens": args.max_tokens,
                 "max_turns": args.max_turns, "grpo": after},
    }


def needs_checkpoint(options: argparse.Namespace, work: Path, role: str) -> str:
    """``--sft-checkpoint``, else the checkpoint the ``sft`` section left in ``work``."""
    if options.sft_checkpoint:
        return str(options.sft_checkpoint)
    made = work / "sft" / "checkpoint.json"
    if not made.is_file():
        sys.exit(f"bench_learning: {role} is an SFT checkpoint: run the sft section first "
                 "or pass --sft-checkpoint PATH")
    return str(json.loads(made.read_text())["path"])


def _load() -> dict[str, Any]:
    return {"load_average": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
            "torch_threads": 1}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _gain_interval(valued: list[tuple[float, float]]) -> list[float] | None:
    """95% bootstrap interval of |target - constant| - |value - target| over (value, target)
    pairs, the constant being the median target; None without pairs."""
    if not valued:
        return None
    constant = statistics.median(t for _, t in valued)
    low, high = bootstrap_interval([abs(t - constant) - abs(v - t) for v, t in valued])
    return [round(low, 4), round(high, 4)]


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
    group.add_argument("--opd-kl-coef", type=float, default=1.0,
                       help="OPD's --kl-coef (0 with --opd-teacher-labels: labels alone)")
    group.add_argument("--opd-teacher-labels", type=float, default=0.0,
                       help="OPD's --teacher-labels (0: pure sampled reverse KL)")
    group.add_argument("--opd-edge", type=int, default=3,
                       help="steps averaged at each end of the run for the KL ratio")


def section_opd(options: argparse.Namespace, work: Path) -> dict[str, Any]:
    """On-policy distillation of the SFT checkpoint (teacher) into the base model (student)
    on the train split, then greedy held-out success of base, student and teacher.

    ``reverse_kl_mean`` is the per-token sample of KL(student || teacher) on the student's
    own episodes of each step; the first and last ``--opd-edge`` steps are averaged so one
    lucky step does not make the figure.
    """
    teacher = needs_checkpoint(options, work, "the teacher")
    load_start = _load()
    args = OpdArgs(env_id=ENV_ID, env_kwargs={**TRAIN, "max_turns": options.max_turns},
                   teacher=f"local:smollm2@{teacher}", privileged=False,
                   steps=options.opd_steps, batch_size=options.opd_batch_size,
                   group_size=options.opd_group_size, max_tokens=options.max_tokens,
                   learning_rate=options.opd_learning_rate,
                   kl_coef=options.opd_kl_coef, teacher_labels=options.opd_teacher_labels,
                   threads=1,
                   save_every=options.opd_steps, out=str(work / "opd"), progress=False)
    # base and teacher are evaluated while the student trains (eval processes of one torch
    # thread each; the CPU is shared anyway), the student after
    with ThreadPoolExecutor(2) as pool:
        running = {name: pool.submit(evaluate, policy, work / f"eval-opd-{name}", options)
                   for name, policy in (("base", "local:smollm2"),
                                        ("teacher", f"local:smollm2@{teacher}"))}
        started = time.perf_counter()
        history = opd_train(args)
        train_seconds = time.perf_counter() - started
        load_trained = _load()
        student = json.loads((work / "opd" / "checkpoint.json").read_text())["path"]
        done = evaluate(f"local:smollm2@{student}", work / "eval-opd-opd", options)
        evals = {"base": running["base"].result(), "opd": done,
                 "teacher": running["teacher"].result()}
    kl = [row["reverse_kl_mean"] for row in history if row["reverse_kl_mean"] is not None]
    edge = min(options.opd_edge, len(kl) // 2) or 1
    section = {
        "command": " ".join(["python", *sys.argv]),
        "teacher": {"checkpoint": teacher, "made_by": options.sft_command},
        "student": "smollm2 (base), LoRA rank 32",
        "train_split": "Search-v0 split=train",
        "settings": {"steps": args.steps, "batch_size": args.batch_size,
                     "group_size": args.group_size, "max_tokens": args.max_tokens,
                     "max_turns": options.max_turns, "learning_rate": args.learning_rate,
                     "kl_coef": args.kl_coef, "reward_coef": args.reward_coef,
                     "teacher_labels": args.teacher_labels,
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
    _plot_opd(history, out.with_name(out.stem + "-opd.png"))
    print(json.dumps({k: section[k] for k in ("reverse_kl_first", "reverse_kl_last",
                                              "reverse_kl_last_over_first")}
                     | {name: (e["successes"], e["episodes"], e["success_ci95"])
                        for name, e in evals.items()}))
    return section


def _plot_opd(history: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row["step"] + 1 for row in history]
    figure, (kl_axis, reward_axis) = plt.subplots(1, 2, figsize=(9, 3))
    kl_axis.plot(steps, [row["reverse_kl_mean"] for row in history], marker="o", markersize=3,
                 label="reverse KL per sampled token")
    if any(row.get("supervised_loss") is not None for row in history):
        kl_axis.plot(steps, [row.get("supervised_loss") for row in history], marker="s",
                     markersize=3, label="NLL of the teacher's labels")
        kl_axis.legend(fontsize=8)
    kl_axis.set_xlabel("OPD step")
    kl_axis.set_ylabel("nats per token")
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
    group.add_argument("--tempo-horizon", type=int, default=1)
    group.add_argument("--tempo-learning-rate", type=float, default=1e-4)
    group.add_argument("--tempo-critic-replay", type=int, default=8)
    group.add_argument("--pool-tempo", nargs="+", default=[], metavar="RUN_DIR",
                       help="--only tempo_pooled: the TEMPO run directories to pool")
    group.add_argument("--tempo-seed", type=int, default=0,
                       help="the run's seed (tasks and sampling): replicates differ here")


def section_tempo(options: argparse.Namespace, work: Path) -> dict[str, Any]:
    """TEMPO from the SFT checkpoint on the train split: critic warm-up on Monte Carlo
    returns, then TD updates. Measured after the warm-up (the TD updates): the critic's
    parse rate over every critic sample, and its absolute error against the best constant
    in hindsight on the same parsed samples (one constant for all of them: the median of
    their targets), both pooled over the updates. Also reported: the constant re-fitted to
    each update's two or so states (not a constant predictor: it knows every update's
    targets) and the correlation of the critic's per-state mean value with the target."""
    start = needs_checkpoint(options, work, "the starting policy")
    load_start = _load()
    args = TempoArgs(env_id=ENV_ID, env_kwargs={**TRAIN, "max_turns": options.max_turns},
                     init_from=start,
                     warmup_updates=options.tempo_warmup, td_updates=options.tempo_td,
                     batch_size=options.tempo_batch_size, branches=options.tempo_branches,
                     horizon=options.tempo_horizon, fresh_fraction=0.5,
                     critic_replay=options.tempo_critic_replay, seed=options.tempo_seed,
                     max_tokens=options.max_tokens, max_trajectory_tokens=4096,
                     learning_rate=options.tempo_learning_rate, threads=1,
                     save_every=1000, out=str(work / "tempo"), progress=False)
    started = time.perf_counter()
    history = tempo_train(args)
    seconds = time.perf_counter() - started

    warmup = [row for row in history if row["phase"] == "warmup"]
    td = [row for row in history if row["phase"] == "td"]
    kept = ("step", "phase", "critic/abs_error_mean", "critic/abs_error_constant",
            "critic/parse_failure_rate", "critic/samples", "critic/parsed", "critic/states",
            "critic/target_mean", "critic/value_mean", "critic/value_corr", "reward_mean",
            "turns_mean", "cut_replies", "warmup/boundary_states", "td/restored_states",
            "td/fresh_states", "td/store_size", "actor/datums", "critic/datums",
            "critic/replayed", "time_step")
    section = {
        "command": " ".join(["python", *sys.argv]),
        "start": {"checkpoint": start, "made_by": options.sft_command},
        "env": {"env_id": ENV_ID, "data": "split=train",
                "max_turns": options.max_turns},
        "settings": {k: getattr(args, k) for k in (
            "warmup_updates", "td_updates", "batch_size", "horizon", "branches",
            "fresh_fraction", "max_tokens", "critic_max_tokens", "critic_replay",
            "learning_rate", "lora_rank", "seed")},
        "warmup": pooled_critic(warmup),
        "after_warmup": pooled_critic(td),
        "per_update": [{k: row.get(k) for k in kept} for row in history],
        "seconds": round(seconds, 1), "load_start": load_start, "load_end": _load(),
    }
    after = section["after_warmup"]
    section["targets"] = {
        "parse_rate_at_least_0.95": after["parse_rate"] is not None
        and after["parse_rate"] >= 0.95,
        "abs_error_below_best_constant": after["abs_error"] is not None
        and after["abs_error"] < after["abs_error_best_constant"],
        "abs_error_below_constant_refitted_per_update": after["abs_error"] is not None
        and after["abs_error"] < after["abs_error_constant_refitted_per_update"],
    }
    out = Path(options.out)
    _plot_tempo(history, out.with_name(out.stem + "-tempo.png"))
    print(json.dumps({"warmup": section["warmup"], "after_warmup": after,
                      "targets": section["targets"]}))
    return section


def section_tempo_pooled(options: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The after-warm-up critic figures of several TEMPO runs pooled (``--pool-tempo``:
    their run directories, each holding ``metrics.jsonl``): replicates with other seeds,
    so that one run's luck is not the claim."""
    if not options.pool_tempo:
        raise SystemExit("--only tempo_pooled needs --pool-tempo RUN_DIR [RUN_DIR ...]")
    runs = {str(path): [row for row in read_metrics(Path(path) / "metrics.jsonl")
                        if row["phase"] == "td"] for path in options.pool_tempo}
    return {"runs": {path: pooled_critic(rows) for path, rows in runs.items()},
            "after_warmup": pooled_critic([row for rows in runs.values() for row in rows])}


def pooled_critic(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The critic's figures over some updates of a TEMPO run, pooled (``section_tempo``)."""
    samples = sum(row["critic/samples"] for row in rows)
    failed = sum(row["critic/parse_failure_rate"] * row["critic/samples"]
                 for row in rows if row["critic/samples"])
    scored = [row for row in rows if row["critic/parsed"]]
    parsed = sum(row["critic/parsed"] for row in scored)
    error = sum(row["critic/abs_error_mean"] * row["critic/parsed"] for row in scored)
    refitted = sum(row["critic/abs_error_constant"] * row["critic/parsed"] for row in scored)
    states = [state for row in rows for state in row["critic/per_state"]]
    valued = [(value, target) for target, _, value in states if value is not None]
    return {"updates": len(rows), "critic_samples": samples,
            "parse_rate": (samples - failed) / samples if samples else None,
            "trained_samples_parsed": parsed,
            "abs_error": error / parsed if parsed else None,
            "abs_error_best_constant": best_constant_error(states),
            "abs_error_constant_refitted_per_update": refitted / parsed if parsed else None,
            "value_target_corr": value_corr(*zip(*valued, strict=True)) if valued else None,
            # the critic's estimate as TEMPO uses it at an endpoint (the median readout),
            # one per state, against the median target
            "abs_error_of_state_means": _mean([abs(v - t) for v, t in valued])
            if valued else None,
            "abs_error_best_constant_per_state": best_constant_error(
                [[t, 1, v] for v, t in valued]),
            # per state, how much closer the critic came than that constant: a paired
            # bootstrap interval of the mean, since errors of 0, 0.25, ... or 1 over a
            # few dozen states move by hundredths from noise alone
            "gain_over_best_constant_per_state_95": _gain_interval(valued),
            "states": len(states),
            "targets_distinct": len({round(target, 6) for target, _, _ in states}),
            "target_mean": _mean([row["critic/target_mean"] for row in rows
                                  if row["critic/target_mean"] is not None] or [0.0])}


def _plot_tempo(history: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row["step"] + 1 for row in history]
    figure, (error_axis, parse_axis) = plt.subplots(1, 2, figsize=(9, 3))
    for key, label, style in (("critic/abs_error_mean", "critic", "-o"),
                              ("critic/abs_error_constant", "constant fitted per update",
                               "--s")):
        error_axis.plot(steps, [row[key] for row in history], style, markersize=3, label=label)
    td = [row for row in history if row["phase"] == "td"]
    pooled = best_constant_error([state for row in td for state in row["critic/per_state"]])
    if pooled is not None:
        error_axis.hlines(pooled, td[0]["step"] + 1, td[-1]["step"] + 1, colors="black",
                          linestyles=":", label="one constant for all TD updates")
    error_axis.set_ylabel("absolute error of the value")
    error_axis.legend(fontsize=7)
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


SECTIONS: dict[str, Callable[[argparse.Namespace, Path], dict[str, Any]]] = {
    "sft": section_sft, "grpo": section_grpo, "opd": section_opd, "tempo": section_tempo,
    "tempo_pooled": section_tempo_pooled,
}
# What runs without --only: every section that trains (pooling only reads earlier runs).
DEFAULT_SECTIONS = ("sft", "grpo", "opd", "tempo")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append",
                        help="run only this section (repeatable; default: all, in order)")
    parser.add_argument("--epochs", type=int, default=1, help="SFT epochs")
    parser.add_argument("--sft-learning-rate", type=float, default=1e-3)
    parser.add_argument("--grpo-from-epoch", type=int, default=1)
    parser.add_argument("--grpo-steps", type=int, default=12)
    parser.add_argument("--grpo-learning-rate", type=float, default=1e-4)
    parser.add_argument("--max-tokens", type=int, default=48, help="per reply")
    parser.add_argument("--max-turns", type=int, default=4, help="per episode")
    parser.add_argument("--work", default="runs/bench-learning")
    parser.add_argument("--out", default=str(RESULTS / "learning.json"))
    add_opd_options(parser)
    add_tempo_options(parser)
    options = parser.parse_args()
    record = Result()
    import torch

    torch.set_num_threads(1)
    work = Path(options.work)
    out = Path(options.out)
    for name in [n for n in SECTIONS if n in (options.only or DEFAULT_SECTIONS)]:
        section = timed(lambda name=name: SECTIONS[name](options, work))
        section["bench_command"] = " ".join(["python", *sys.argv])
        # Read just before writing: the other sections' figures stay as they were measured.
        # Each section keeps its own command, seconds and load (sections come from different
        # runs); the file's command, commit, load and seconds are the last run's.
        record.figures = results = figures_in(out)
        results |= {"env_id": ENV_ID, "torch_threads": 1, name: section, "split": {
            "train_tasks": 56, "heldout_tasks": 18,
            "rule": "Search-v0 split=train / split=test: the split field of search_qa.jsonl "
                    "(question i held out when i % 4 == 3)"}}
        record.write(out)
        print(name, json.dumps(section.get("eval")))
    _plot(work, out.with_suffix(".png"))
    return 0


def _plot(work: Path, path: Path) -> None:
    """One panel per section that has run: SFT's train and held-out NLL, GRPO's reward.
    (OPD and TEMPO have figures of their own: they write no ``reward_mean`` curve.)"""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {name: read_metrics(work / name / "metrics.jsonl") for name in ("sft", "grpo")
            if (work / name / "metrics.jsonl").is_file()}
    if not runs:
        return
    figure, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.2), squeeze=False)
    for axis, (name, rows) in zip(axes[0], runs.items(), strict=True):
        if name == "sft":
            axis.plot([r["step"] + 1 for r in rows], [r["loss"] for r in rows],
                      label="train NLL / token")
            held = [(r["step"] + 1, r["heldout_nll"]) for r in rows if "heldout_nll" in r]
            if rows and "heldout_nll_before" in rows[0]:
                held.insert(0, (0, rows[0]["heldout_nll_before"]))
            axis.plot(*zip(*held, strict=True), marker="o", label="held-out NLL / token")
            axis.set_ylabel("NLL per demonstrated token")
        else:
            axis.plot([r["step"] + 1 for r in rows], [r["reward_mean"] for r in rows],
                      marker="o", label="reward (train split)")
            axis.plot([r["step"] + 1 for r in rows], [r["degenerate_rate"] for r in rows],
                      linestyle="--", label="degenerate-group rate")
            axis.set_ylim(-0.05, 1.05)
        axis.set_xlabel(f"{name.upper()} step")
        axis.set_title(f"{name.upper()} on {ENV_ID}", fontsize=10)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
