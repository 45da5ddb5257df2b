"""`make run`, timed: the embedded model before training, after SFT and after SFT + GRPO on
100 held-out Search-v0 ``world-large`` questions, with paired intervals between stages.

    rm -rf runs/demo && python benchmarks/bench_demo.py     # benchmarks/results/demo.json

It runs ``agent-gym train demo --out WORK`` (a run already finished there is only read) in
a child process, so the record's CPU seconds are the demo's own (its vLLM server's
included: a child of the child), and writes the demo's ``summary.json`` with the wall-clock
and the load around it. Time it from an empty ``--work``: a continued demo is quicker.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import RESULTS, Result  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="runs/demo", help="the demo's run directory")
    parser.add_argument("--out", default=str(RESULTS / "demo.json"))
    args = parser.parse_args()
    work = Path(args.work).resolve()
    record = Result(placeholders={str(work): "$WORK"})
    fresh = not (work / "summary.json").is_file()
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "agent_gym_train.demo", "--out", str(work),
                           "--no-progress"], cwd=ROOT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the demo failed (exit {done.returncode})")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    record.figures |= {
        "demo_command": f"agent-gym train demo --out {work}",
        "from_empty_work": fresh,
        "wall_seconds": round(time.perf_counter() - started, 1),
        "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 1),
        "summary": json.loads((work / "summary.json").read_text()),
    }
    record.write(args.out)
    print(f"{args.out}: {record.figures['wall_seconds'] / 60:.1f} min", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
