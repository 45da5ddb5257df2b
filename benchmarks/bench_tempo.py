"""TEMPO over a longer run: the critic's absolute error across updates, next to the error
of the best constant predictor measured on the same samples in the same updates.

    python benchmarks/bench_tempo.py [--warmup 4] [--td 16] [--out benchmarks/results/tempo.json]

Setting: the bundled ALFWorld games (8 turns), macro-steps of H=2 turns, N=4 branches,
4 groups per update, on the local backend.

Model: the value-speaking tiny model of the tests (``tests/helpers/tempo_toy.py``, trained in a
few seconds). On these two shared cores SmolLM2-135M-Instruct sampled 8 critic replies of
96 tokens in 86 s and none held a parsable ``<value>`` tag, so a few minutes of it would
measure nothing. What this run measures is the machinery: whether the critic's error
against its targets (Monte Carlo returns in warm-up, the mean macro-step return G in TD
updates) falls as the one update trains actor and critic together. It does not measure
a capable critic: the toy never wins a game, so the values it learns are small.

Writes the per-update metrics and a summary (ratios) to ``--out`` and the run's metric
panels (critic error with the constant baseline dashed) to the same name with ``.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for the tests' toy model

from harness import RESULTS, Result  # noqa: E402

from agent_gym_train.plot import plot  # noqa: E402
from agent_gym_train.tempo import Args, train  # noqa: E402
from tests.helpers.tempo_toy import save_value_model  # noqa: E402

KEPT = ("step", "phase", "critic/abs_error_mean", "critic/abs_error_constant",
        "critic/value_corr", "critic/value_mean", "critic/target_mean",
        "critic/parse_failure_rate", "reward_mean", "actor/degenerate_group_rate",
        "actor/value_gap_zero_reward", "td/fresh_states", "td/restored_states",
        "td/store_size", "is/weight_mean", "is/clip_rate", "datums", "time_step")


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def summarise(rows: list[dict[str, Any]], window: int) -> dict[str, Any]:
    errors = [row["critic/abs_error_mean"] for row in rows
              if row["critic/abs_error_mean"] is not None]
    first, last = mean(errors[:window]), mean(errors[-window:])
    td = [row for row in rows if row["phase"] == "td"
          and row["critic/abs_error_mean"] is not None
          and row["critic/abs_error_constant"] is not None]
    critic_td = mean([row["critic/abs_error_mean"] for row in td])
    constant_td = mean([row["critic/abs_error_constant"] for row in td])
    failures = [row["critic/parse_failure_rate"] for row in rows
                if row["critic/parse_failure_rate"] is not None]
    return {
        "critic_abs_error_first": first,
        "critic_abs_error_last": last,
        "last_vs_first": ratio(last, first),
        "critic_abs_error_td_mean": critic_td,
        "constant_abs_error_td_mean": constant_td,
        "critic_vs_constant_td": ratio(critic_td, constant_td),
        "parse_failure_first": mean(failures[:window]),
        "parse_failure_last": mean(failures[-window:]),
        "restored_states": sum(row.get("td/restored_states") or 0 for row in rows),
        "seconds_per_update": mean([row["time_step"] for row in rows]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--td", type=int, default=16)
    parser.add_argument("--window", type=int, default=3, help="updates averaged at each end")
    parser.add_argument("--out", default=str(RESULTS / "tempo.json"))
    options = parser.parse_args()
    record = Result()
    with tempfile.TemporaryDirectory() as scratch:
        model = save_value_model(Path(scratch) / "model")
        run_dir = Path(scratch) / "run"
        args = Args(
            env_id="agent_gym/ALFWorld-v0", env_kwargs={"max_turns": 8}, model=model,
            lora_rank=0, warmup_updates=options.warmup, td_updates=options.td, batch_size=4,
            horizon=2, branches=4, store_capacity=64,
            fresh_fraction=0.25, staleness=4, learning_rate=1e-3, max_tokens=16,
            critic_max_tokens=12, max_trajectory_tokens=6000, out=str(run_dir),
            progress=False, save_every=1000,
        )
        history = train(args)
        image = plot(run_dir, Path(options.out).with_suffix(".png"))
    rows = [{key: row.get(key) for key in KEPT} for row in history]
    result = record.figures
    result |= {
        "setting": {k: v for k, v in vars(args).items() if k not in ("out", "model", "api_key")},
        "model": "tests/helpers/tempo_toy.py value-speaking tiny model",
        "summary": summarise(rows, options.window),
        "updates": rows,
    }
    record.write(options.out)

    print(f"{'update':>6} {'phase':>6} {'critic |V-G|':>12} {'constant':>9} {'parse fail':>10} "
          f"{'store':>5} {'IS w':>5}")
    for row in rows:
        print(f"{row['step']:>6} {row['phase']:>6} {_fmt(row['critic/abs_error_mean']):>12} "
              f"{_fmt(row['critic/abs_error_constant']):>9} "
              f"{_fmt(row['critic/parse_failure_rate']):>10} {row['td/store_size']:>5} "
              f"{_fmt(row['is/weight_mean']):>5}")
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {options.out} and {image}")
    return 0


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    sys.exit(main())
