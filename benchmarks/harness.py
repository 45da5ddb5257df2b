"""One schema for every benchmark's result file: what ran, on what, under what load.

A figure means little without the command that produced it, the commit it measured, the
machine and how busy that machine was: a 2-core host shared with other work can be several
times slower than a quiet one. ``Result`` records those around a benchmark's own figures,
and ``write`` puts them in ``benchmarks/results/<name>.json``, the one current file of that
benchmark (earlier or ablation runs belong in ``benchmarks/experiments/<name>/``).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent_gym.durable import replace_file
from agent_gym.eval.compare import PairedDifference, compare, paired_difference
from agent_gym.eval.runs import read_run

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# The keys ``Result.record`` puts around the figures
RUN_KEYS = ("command", "commit", "machine", "load_average_at_start", "load_average_at_end",
            "seconds")


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _commit() -> str | None:
    """The commit measured, with ``+changes`` when the tracked files differ from it: a
    figure measured on uncommitted code must not claim to be the commit's."""
    head = _git("rev-parse", "HEAD")
    if not head:
        return None
    changed = _git("status", "--porcelain", "--untracked-files=no")
    return f"{head}+changes" if changed else head


def timed(measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A section's figures with its own seconds and the load average around it: the
    sections of one result file may come from runs on differently busy days."""
    load_start, started = os.getloadavg(), time.perf_counter()
    figures = measure()
    return figures | {"section_seconds": round(time.perf_counter() - started, 1),
                      "load_average_start": [round(x, 2) for x in load_start],
                      "load_average_end": [round(x, 2) for x in os.getloadavg()]}


def summary(run: Path) -> dict[str, Any]:
    """An eval run's held-out figures, from its ``summary.json``."""
    saved = json.loads((run / "summary.json").read_text())
    return {key: saved[key] for key in ("episodes", "success_rate", "success_low",
                                        "success_high", "mean_turns", "cut_replies")}


def solved(run: Path) -> list[str]:
    """The tasks an eval run solved, by id: in a record beside its summary they let a later
    run be paired with this one after the run's directory is gone (``paired_solved``)."""
    return sorted(str(episode["task_id"]) for episode in read_run(run).episodes.values()
                  if episode["success"])


def paired(before: Path, after: Path) -> dict[str, Any]:
    """Eval run ``after`` minus ``before``, paired by task: Newcombe's 95% interval and the
    counts, as ``agent-gym compare`` gives them."""
    return _paired_figures(compare([read_run(before)], [read_run(after)], "before",
                                   "after").overall)


def paired_solved(before: list[str], after: list[str], tasks: int) -> dict[str, Any]:
    """``paired`` from two records' ``solved`` lists, both runs having played the same
    ``tasks`` tasks."""
    a, b = set(before), set(after)
    return _paired_figures(paired_difference(len(a & b), len(a - b), len(b - a),
                                             tasks - len(a | b)))


def _paired_figures(result: PairedDifference) -> dict[str, Any]:
    return {"difference": round(result.difference, 3),
            "ci95": [round(result.low, 3), round(result.high, 3)],
            "both": result.both, "only_before": result.only_a, "only_after": result.only_b,
            "neither": result.neither}


def metric_mean(rows: list[dict[str, Any]], key: str, digits: int = 4) -> float | None:
    """The mean of ``key`` over a run's metrics lines that have it (``None``: none has)."""
    values = [row[key] for row in rows if row.get(key) is not None]
    return round(sum(values) / len(values), digits) if values else None


def figures_in(path: str | Path) -> dict[str, Any]:
    """The figures of a result file already written, without its run's keys (``RUN_KEYS``).

    For a benchmark whose sections can be re-run one at a time into the same file: the
    sections not re-run keep their figures, and this run's keys replace the old run's.
    """
    path = Path(path)
    if not path.is_file():
        return {}
    record = json.loads(path.read_text(encoding="utf-8"))
    return {key: value for key, value in record.items() if key not in RUN_KEYS}


@dataclass
class Result:
    """A run in progress: started now, its figures added as they are measured."""

    figures: dict[str, Any] = field(default_factory=dict)
    # Paths of this machine (work and input directories) written as names (``$WORK``), so
    # the record reads the same wherever it ran; longer paths are replaced first.
    placeholders: dict[str, str] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    load_at_start: float = field(default_factory=lambda: round(os.getloadavg()[0], 2))

    @property
    def seconds(self) -> float:
        """Wall-clock seconds since the run started, as the record gives them."""
        return round(time.perf_counter() - self.started, 1)

    def record(self) -> dict[str, Any]:
        return {
            "command": " ".join(["python", *sys.argv]),
            "commit": _commit(),
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                        "platform": platform.platform()},
            "load_average_at_start": self.load_at_start,
            "load_average_at_end": round(os.getloadavg()[0], 2),
            "seconds": self.seconds,
            **self.figures,
        }

    def write(self, out: str | Path) -> Path:
        """Write the record so far; call again (after each section, say) to bring it up to date.
        A benchmark killed mid-write keeps the record it wrote before, not half of this one."""
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.record(), indent=2) + "\n"
        for local, name in sorted(self.placeholders.items(), key=lambda kv: -len(kv[0])):
            text = text.replace(local, name)
        replace_file(path, text)
        return path
