"""``agent-gym view | compare | rescore``: reading saved eval runs (see ``agent_gym.eval.runs``)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agent_gym.cli.parsing import add_env_arg
from agent_gym.eval.compare import CompareError, compare, format_comparison
from agent_gym.eval.report import Compared, render_report
from agent_gym.eval.rescore import default_output, format_rescore, rescore_run
from agent_gym.eval.runfiles import RESCORE_FILE
from agent_gym.eval.runlog import write_file
from agent_gym.eval.runs import Run, RunDirError, check_output, find_runs, read_run

REPORT_FILE = "report.html"


def _sides(paths: Sequence[str]) -> list[list[Run]]:
    """Each path's runs: a run directory, or a suite's --out with a run per env below."""
    return [[read_run(run) for run in find_runs(Path(path))] for path in paths]


def _side_label(path: str, runs: Sequence[Run]) -> str:
    return runs[0].label if len(runs) == 1 else f"{path} ({len(runs)} runs)"


def _comparisons(paths: Sequence[str], sides: list[list[Run]], strict: bool) -> list[Compared]:
    """Every later side against the first; ``strict`` refuses sides without shared tasks
    (``compare``), else they are left out of the report (``view`` of unrelated runs)."""
    found = []
    for path, side in zip(paths[1:], sides[1:], strict=True):
        try:
            comparison = compare(sides[0], side, _side_label(paths[0], sides[0]),
                                 _side_label(path, side))
        except CompareError:
            if strict:
                raise
            continue
        found.append(Compared(comparison, sides[0], side))
    return found


def _write_output(out: Path, text: str) -> None:
    """Write a command's output file (which ``check_output`` has cleared, before the work
    of making it) as a whole, through a symlink: a failed write leaves the file that was
    there, and a path that cannot be written is one line."""
    target = out.resolve()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"cannot write {out}: {err.strerror or err}") from err
    write_file(target, text)


def _write_report(out: Path, sides: list[list[Run]], comparisons: list[Compared]) -> None:
    _write_output(out, render_report([run for side in sides for run in side], comparisons))
    print(f"report: {out.resolve().as_uri()}")


def _view(args: argparse.Namespace) -> int:
    sides = _sides(args.runs)
    out = Path(args.out or REPORT_FILE)  # never inside a run it reads unless told so
    check_output(out, [run for side in sides for run in side])
    if args.replay:  # per-step rewards for logs that do not hold them, written nowhere else
        sides = [[_replayed(run, dict(args.env_arg)) for run in side] for side in sides]
    comparisons = _comparisons(args.runs, sides, strict=False) if len(sides) > 1 else []
    _write_report(out, sides, comparisons)
    return 0


def _replayed(run: Run, host_kwargs: dict[str, Any]) -> Run:
    result = rescore_run(run, host_kwargs)
    return dataclasses.replace(
        run, rescored={(e.episode, e.rollout): dataclasses.asdict(e) for e in result.episodes})


def _compare(args: argparse.Namespace) -> int:
    sides = _sides(args.runs)
    if args.html:
        check_output(Path(args.html), [run for side in sides for run in side])
    comparisons = _comparisons(args.runs, sides, strict=True)
    print("\n\n".join(format_comparison(c.comparison) for c in comparisons))
    if args.html:
        _write_report(Path(args.html), sides, comparisons)
    return 0


def _rescore(args: argparse.Namespace) -> int:
    paths = find_runs(Path(args.run_dir))
    if len(paths) != 1:
        raise RunDirError(f"{args.run_dir} holds {len(paths)} runs; rescore one run directory")
    run = read_run(paths[0])
    out = Path(args.out) if args.out else default_output(run)
    check_output(out, [run], allowed=RESCORE_FILE)
    if out.exists() and not args.force:
        raise RunDirError(f"{out} exists (an earlier rescore?); pass --force to replace it "
                          "or --out another file")
    if not run.episodes:
        raise RunDirError(f"{run.path} has no finished episode to rescore")
    result = rescore_run(run, dict(args.env_arg))
    _write_output(out, result.to_json())
    print(format_rescore(result, out))
    return 1 if result.failed else 0


def register(commands: Any) -> None:
    """Add ``view``, ``compare`` and ``rescore`` to the top-level parser."""
    view = commands.add_parser(
        "view", help="write a static HTML report of eval runs (opens from disk)",
        description="Read each RUN (an eval --out directory, or a suite's, with a run per env "
        "below it) as written, even killed or resumed, and write one self-contained HTML file: "
        "summary with 95% intervals, histograms, every episode's full transcript with "
        "filters; runs of the same tasks are linked and compared with the first RUN.",
    )
    view.add_argument("runs", nargs="+", metavar="RUN", help="eval run directories")
    view.add_argument("--out", help=f"the HTML file (default: ./{REPORT_FILE}; never a run's "
                      "own file)")
    view.add_argument("--replay", action="store_true",
                      help="replay every episode's saved state to show its rewards per step "
                      "(a run's rescore.json is used without it)")
    add_env_arg(view, "with --replay: a host setting to build the envs with, as for rescore")
    view.set_defaults(run=_view)

    comparison = commands.add_parser(
        "compare", help="compare runs on the tasks they share, with paired intervals",
        description="Pair the episodes of each later RUN with RUN_A's by env, task and rollout; "
        "print per env the success of both, the difference with Newcombe's paired 95% "
        "interval, mean rewards, and the tasks that flipped.",
    )
    comparison.add_argument("runs", nargs="+", metavar="RUN",
                            help="RUN_A (the baseline), then one or more runs to compare with it")
    comparison.add_argument("--html", metavar="FILE",
                            help="also write the HTML report with the comparison in it")
    comparison.set_defaults(run=_checked_compare(comparison))

    rescore = commands.add_parser(
        "rescore", help="recompute a saved run's rewards with the current reward code",
        description="Replay each finished episode from its saved state (every observation is "
        "verified), score it with this version's env code, write the new summary and every "
        "episode's old and new reward to a new file, and list what changed. An episode that "
        "cannot be replayed is reported (exit status 1), never scored.",
    )
    rescore.add_argument("run_dir", metavar="RUN", help="an eval run directory")
    rescore.add_argument("--out", help="the result file (default: RUN/rescore.json)")
    rescore.add_argument("--force", action="store_true",
                         help="replace --out if it exists (never the run's own files)")
    add_env_arg(rescore)
    rescore.set_defaults(run=_rescore)


def _checked_compare(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        if len(args.runs) < 2:
            parser.error("give at least two runs: RUN_A RUN_B [RUN ...]")
        return _compare(args)

    return run
