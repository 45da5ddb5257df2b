"""``agent-gym train plot RUN``: a panel for every numeric metric a training run logged.

Works on any trainer's ``metrics.jsonl`` (one line per step, see
``agent_gym_train.run.files``): every key whose values are numbers gets a panel, in the order
the run first logged it, except those that never changed over the run (a batch size, the
epoch of a one-epoch run), which a flat line would only make look like curves: they are
listed, with their value, above the panels. A metric logged at one step only is a marker,
not a line. Steps are numbered from 1, as the progress bar and the trainer's last line count
them (a row's ``step`` is 0-based). Steps whose ``phase`` is ``warmup`` (TEMPO's critic-only
updates) are shaded, and a metric with a baseline logged beside it (the critic's error next
to the best constant's) draws the baseline dashed in its own panel.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from agent_gym.cli.parsing import OneLineParser
from agent_gym_train.run.files import METRICS_FILE, Metrics, read_metrics

PLOT_FILE = "metrics.png"
COLUMNS = 5
CONSTANTS_WIDTH = 200  # characters per line of the list of constant metrics
# metric -> the baseline drawn in its panel (and not in a panel of its own)
BASELINES = {"critic/abs_error_mean": ("critic/abs_error_constant", "best constant")}
NOT_PLOTTED = frozenset({"step"})


def numeric_metrics(rows: Sequence[Metrics]) -> list[str]:
    """The keys the rows hold numbers under (booleans and nested values are not), in the
    order they first appear, without ``step`` and without the baselines."""
    hidden = NOT_PLOTTED | {baseline for baseline, _ in BASELINES.values()}
    keys: dict[str, None] = {}
    for row in rows:
        for key, value in row.items():
            if key not in hidden and _is_number(value):
                keys.setdefault(key)
    return list(keys)


def constant_metrics(rows: Sequence[Metrics]) -> dict[str, float]:
    """The numeric metrics logged at two steps or more with one value throughout, each
    with that value."""
    constant = {}
    for key in numeric_metrics(rows):
        steps, values = _series(rows, key)
        if len(steps) > 1 and len(set(values)) == 1:
            constant[key] = values[0]
    return constant


def draw(rows: Sequence[Metrics]) -> Figure:
    """The figure: one panel per numeric metric that changed, titled with its key, under
    the list of those that did not."""
    numeric = numeric_metrics(rows)
    if not numeric:
        raise ValueError("the run logged no numeric metric")
    constant = constant_metrics(rows)
    shown = [key for key in numeric if key not in constant]
    lines = max(1, math.ceil(len(shown) / COLUMNS))
    figure = Figure(figsize=(16, 3 * lines), layout="constrained")
    if constant:
        listed = ", ".join(f"{key} {value:g}" for key, value in constant.items())
        figure.suptitle(textwrap.fill(f"constant over the run: {listed}", CONSTANTS_WIDTH),
                        fontsize=8)
    axes = list(figure.subplots(lines, COLUMNS, squeeze=False).flat)
    warmup = [row["step"] + 1 for row in rows if row.get("phase") == "warmup"]
    for axis, key in zip(axes, shown, strict=False):
        steps, values = _series(rows, key)
        if len(steps) == 1:  # no line to draw: a marker that can be seen, at its step
            axis.plot(steps, values, linestyle="none", marker="o", markersize=7)
            axis.set_xticks(steps)
        else:
            axis.plot(steps, values, marker="o", markersize=3)
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
        if key in BASELINES:
            baseline, label = BASELINES[key]
            steps, values = _series(rows, baseline)
            if steps:
                axis.plot(steps, values, linestyle="--", color="0.4", label=label)
                axis.legend(fontsize=7)
        if warmup:
            axis.axvspan(min(warmup) - 0.5, max(warmup) + 0.5, color="0.9")
        axis.set_title(key, fontsize=9)
        axis.set_xlabel("step", fontsize=8)
        axis.tick_params(labelsize=7)
    for axis in axes[len(shown):]:
        axis.set_visible(False)
    return figure


def plot(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw a run's metrics to ``out`` (default ``RUN_DIR/metrics.png``); returns the path."""
    source = Path(run_dir) / METRICS_FILE
    if not source.is_file():
        raise FileNotFoundError(f"{source} does not exist: is {run_dir} a training run?")
    try:
        figure = draw(read_metrics(source))
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from err
    target = Path(out) if out else Path(run_dir) / PLOT_FILE
    figure.savefig(target, dpi=100)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="agent-gym train plot", description=plot.__doc__)
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None, help="PNG path (default RUN_DIR/metrics.png)")
    options = parser.parse_args(argv)
    try:
        print(plot(options.run_dir, options.out))
    except (FileNotFoundError, ValueError) as err:
        parser.error(str(err))
    return 0


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _series(rows: Sequence[Metrics], key: str) -> tuple[list[int], list[float]]:
    """The steps (from 1) at which ``key`` holds a number, and the numbers."""
    points = [(row["step"] + 1, row[key]) for row in rows if _is_number(row.get(key))]
    return [step for step, _ in points], [value for _, value in points]
