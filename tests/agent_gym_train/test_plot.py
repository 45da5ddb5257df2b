"""``agent-gym train plot``: a panel for every numeric metric of any trainer's run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from agent_gym_train.cli import register
from agent_gym_train.grpo import Args, train
from agent_gym_train.plot import constant_metrics, draw, main, numeric_metrics, plot
from agent_gym_train.run.files import METRICS_FILE, read_metrics
from tests.helpers import grpo_toy


def titles(figure: Figure) -> list[str]:
    return [axis.get_title() for axis in figure.axes if axis.get_visible()]


def test_a_grpo_run_gets_a_panel_for_every_metric_it_logged(tmp_path: Path) -> None:
    model = grpo_toy.save_tiny_model(tmp_path / "model")
    # Groups big enough that a step has a signal, so loss and grad norm are logged too.
    train(Args(env_id=grpo_toy.ENV_ID, model=model, lora_rank=0, steps=2, batch_size=4,
               group_size=8, learning_rate=1e-2, max_tokens=4, max_trajectory_tokens=64,
               out=str(tmp_path / "run"), progress=False))
    rows = read_metrics(tmp_path / "run" / METRICS_FILE)
    figure = draw(rows)
    shown, constant = titles(figure), constant_metrics(rows)
    for key in ("reward_mean", "degenerate_rate", "loss", "grad_norm", "sampled_tokens",
                "trained_tokens", "time_sampler", "time_rollout", "time_train", "time_step"):
        assert key in shown or key in constant, key
    assert "step" not in shown and "end_reasons" not in shown  # an axis and a dict of counts
    assert "groups" in constant  # batch_size groups at every step: listed, not drawn
    assert shown == [key for key in numeric_metrics(rows) if key not in constant]
    assert all(key in figure.get_suptitle() for key in constant)
    image = plot(tmp_path / "run")
    assert image == tmp_path / "run" / "metrics.png" and image.stat().st_size > 10_000


def test_warmup_is_shaded_and_the_critic_error_has_its_baseline() -> None:
    rows = [{"step": s, "phase": "warmup" if s < 2 else "td", "critic/abs_error_mean": 0.5 - s / 10,
             "critic/abs_error_constant": 0.4, "is/weight_mean": None if s < 2 else s / 4,
             "flag": True} for s in range(4)]
    figure = draw(rows)
    assert titles(figure) == ["critic/abs_error_mean", "is/weight_mean"]
    error, weight = figure.axes[:2]
    assert [line.get_label() for line in error.get_lines()][1] == "best constant"
    assert list(error.get_lines()[1].get_ydata()) == [0.4] * 4
    assert list(weight.get_lines()[0].get_xdata()) == [3, 4]  # None is not a point
    assert all(len(axis.patches) == 1 for axis in (error, weight))  # the warm-up span


def test_constant_metrics_are_listed_and_single_points_are_markers() -> None:
    """A series that never changed is a flat line (a panel for the batch size, the epoch):
    it is named with its value instead. A series of one point has no line to draw."""
    rows = [{"step": s, "epoch": 0, "datums": 8, "loss": 1.0 - s / 4,
             **({"heldout_nll": 2.5} if s == 3 else {})} for s in range(4)]
    figure = draw(rows)
    assert titles(figure) == ["loss", "heldout_nll"]
    assert constant_metrics(rows) == {"epoch": 0, "datums": 8}
    assert figure.get_suptitle() == "constant over the run: epoch 0, datums 8"
    loss, heldout = (axis.get_lines()[0] for axis in figure.axes[:2])
    assert list(loss.get_xdata()) == [1, 2, 3, 4]  # steps as users count them
    assert loss.get_linestyle() == "-"
    assert (heldout.get_linestyle(), heldout.get_marker()) == ("None", "o")
    assert list(heldout.get_xdata()) == [4]
    # One step: every metric is one point, none constant; all constant: just the list
    one = draw(rows[:1])
    assert titles(one) == ["epoch", "datums", "loss"] and not one.get_suptitle()
    assert all(axis.get_lines()[0].get_linestyle() == "None" for axis in one.axes[:3])
    flat = draw([{"step": s, "epoch": 0} for s in range(3)])
    assert titles(flat) == [] and flat.get_suptitle() == "constant over the run: epoch 0"


def test_plot_command_and_its_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(FileNotFoundError):
        plot(tmp_path)
    with pytest.raises(SystemExit):
        main([str(tmp_path)])
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / METRICS_FILE).write_text(json.dumps({"step": 0, "end_reasons": {}}) + "\n")
    with pytest.raises(SystemExit):
        main([str(tmp_path)])
    assert "no numeric metric" in capsys.readouterr().err
    (tmp_path / METRICS_FILE).write_text(json.dumps({"step": 0, "phase": "warmup",
                                                     "critic/abs_error_mean": 0.4}) + "\n")
    assert main([str(tmp_path), "--out", str(tmp_path / "p.png")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "p.png")
    assert (tmp_path / "p.png").is_file()
    # `agent-gym train plot RUN` is this command
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    parsed = parser.parse_args(["train", "plot", str(tmp_path)])
    assert parsed.run(parsed) == 0 and (tmp_path / "metrics.png").is_file()
