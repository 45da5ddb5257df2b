"""What each extra costs to install from a clone: wall-clock time and disk, cold.

A user choosing between ``pip install -e .`` and ``-e '.[all]'`` wants to know that one is
seconds and the other is two compilations. Each route here is installed into a new virtual
environment with pip's cache off (``--no-cache-dir``: nothing downloaded or built before
helps), the way the README says, and measured as wall-clock seconds and the venv's size.
The baseline is the core package alone, measured in the same run: every extra's figure is
also given as a ratio to it. Package downloads go over this machine's network, so the
seconds depend on the registry's speed; the disk figures do not.

    python benchmarks/bench_install.py [--routes core,code,...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import RESULTS, Result

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # the CPU build kept on these machines; installed first, as documented
# route -> (the extras, whether torch goes in first)
ROUTES: dict[str, tuple[str, bool]] = {
    "core": ("", False),  # GSM8K alone: the baseline
    "code": ("code", False),
    "search": ("search", False),
    "light": ("code,search", False),  # evaluation only: every env but ALFWorld
    "alfworld": ("alfworld", False),
    "serve": ("serve", False),
    "train": ("train", True),
    "all": ("all", True),
}


def _size_mb(path: Path) -> float:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            if not os.path.islink(full):
                total += os.path.getsize(full)
    return round(total / 2**20, 1)


def install(route: str, work: Path) -> dict[str, Any]:
    extras, torch_first = ROUTES[route]
    venv = work / route
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-cache-dir"]
    # Packages that compile run `python`: the venv's goes first, as in an activated venv.
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    base = _size_mb(venv)
    started = time.perf_counter()
    if torch_first:
        subprocess.run([*pip, TORCH], check=True, env=env)
    target = f"{ROOT}[{extras}]" if extras else str(ROOT)
    done = subprocess.run([*pip, "-e", target], env=env, capture_output=True, text=True)
    seconds = round(time.perf_counter() - started, 1)
    row = {"route": route, "command": f"pip install -e '.[{extras}]'" if extras
           else "pip install -e .", "torch_first": torch_first, "ok": done.returncode == 0,
           "seconds": seconds, "disk_mb": round(_size_mb(venv) - base, 1)}
    if done.returncode:
        row["error"] = done.stderr[-2000:]
    shutil.rmtree(venv, ignore_errors=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description="Each install route's time and size, cold.")
    parser.add_argument("--routes", default=",".join(ROUTES),
                        help="comma-separated routes, of: " + ", ".join(ROUTES))
    parser.add_argument("--out", default=str(RESULTS / "install.json"))
    args = parser.parse_args()
    routes = ["core", *(r for r in args.routes.split(",") if r != "core")]
    result = Result()
    rows = []
    with tempfile.TemporaryDirectory(prefix="agent-gym-install-") as work:
        for route in routes:
            rows.append(install(route, Path(work)))
            print(json.dumps(rows[-1]), flush=True)
    baseline = rows[0]
    for row in rows:
        row["time_vs_core"] = round(row["seconds"] / baseline["seconds"], 1)
        row["disk_vs_core"] = round(row["disk_mb"] / max(baseline["disk_mb"], 0.1), 1)
    result.figures["routes"] = rows
    result.write(args.out)


if __name__ == "__main__":
    main()
