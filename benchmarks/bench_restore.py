"""Restore time against a state's length: it must grow linearly, refused or restored.

Every restore (``reset(options={"state": ...})``, ``make_from_state``, ``agent-gym replay``,
``rescore``, a server's reset) parses the state, names each prefix of its actions to look
for a snapshot or a host-store record, and replays the rest. Naming each prefix by its
whole action tuple made that quadratic: 10k / 20k / 40k empty actions took 0.6 / 2.3 /
8.7 s, and a state inside the server's 4 MiB request limit would have cost ~40 minutes.

Two cases at 1k, 10k and 100k actions of Search-v0 (empty replies, each an invalid step
that calls no backend, so the env's own work per step is constant):

* refused: a state claiming the default settings (max_turns 6) with n actions, as a
  hostile client would send it, restored from its JSON through ``make_from_state``;
* restored: a real episode played with ``max_turns=n``, restored from its JSON in a fresh
  env through ``make_from_state`` (parse, rebuild, replay, digest check of every step).

The figure is the exponent ``b`` of ``time ~ n**b`` fitted by least squares on log-log over
the three lengths, per case, in the same run; the check is ``b <= 1.2``. Times are the
median of ``--repeats`` runs of the process's CPU time (no step waits on anything).

    python benchmarks/bench_restore.py [--repeats 3] [--out benchmarks/results/restore.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import gymnasium
from harness import RESULTS, Result

from agent_gym import EnvState, StateError, make_from_state

LENGTHS = (1_000, 10_000, 100_000)
EXPONENT_LIMIT = 1.2
ENV_ID = "agent_gym/Search-v0"


def played(length: int) -> str:
    """The JSON state of a Search-v0 episode of ``length`` empty replies."""
    env = gymnasium.make(ENV_ID, max_turns=length)
    env.reset(seed=0)
    for _ in range(length):
        env.step("")
    text = env.unwrapped.save_state().to_json()
    env.close()
    return text


def hostile(length: int) -> str:
    """A state with the default settings and ``length`` actions: more than it allows."""
    env = gymnasium.make(ENV_ID)
    env.reset(seed=0)
    state = env.unwrapped.save_state()
    env.close()
    payload = json.loads(state.to_json())
    payload["actions"] = [""] * length
    payload["digests"] = [state.digests[0]] + ["0" * 16] * length
    return json.dumps(payload)


def refuse(text: str) -> None:
    try:
        make_from_state(text)
    except StateError as err:
        assert "max_turns" in str(err), err
        return
    raise AssertionError("a state longer than the env allows was restored")


def restore(text: str) -> None:
    env, _, info = make_from_state(text)
    assert info["restored_depth"] == EnvState.from_json(text).depth
    env.close()


def cpu_seconds(run: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        run()
        times.append(time.process_time() - start)
    return statistics.median(times)


def exponent(lengths: tuple[int, ...], seconds: list[float]) -> float:
    """The slope of log(seconds) on log(length), least squares."""
    xs = [math.log(n) for n in lengths]
    ys = [math.log(max(s, 1e-9)) for s in seconds]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    return (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
            / sum((x - mean_x) ** 2 for x in xs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "restore.json")
    args = parser.parse_args()
    result = Result()
    cases = {"refused": (hostile, refuse), "restored": (played, restore)}
    for name, (make_state, run) in cases.items():
        seconds = []
        for length in LENGTHS:
            text = make_state(length)
            seconds.append(cpu_seconds(lambda text=text, run=run: run(text), args.repeats))
            print(f"{name:9s} {length:>7,d} actions: {seconds[-1]:.4f} s CPU", flush=True)
        fitted = exponent(LENGTHS, seconds)
        result.figures[name] = {
            "lengths": list(LENGTHS), "cpu_seconds": [round(s, 5) for s in seconds],
            "fitted_exponent": round(fitted, 3), "limit": EXPONENT_LIMIT,
            "passed": fitted <= EXPONENT_LIMIT,
        }
        print(f"{name}: time ~ n^{fitted:.2f} (limit {EXPONENT_LIMIT})", flush=True)
    result.write(args.out)


if __name__ == "__main__":
    main()
