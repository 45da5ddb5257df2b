"""`agent-gym view | compare | rescore` on runs as eval leaves them: one count of tasks and
episodes for every command, and comparisons that say why they pair nothing or what differs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from agent_gym.cli.main import main

GSM8K = "agent_gym/GSM8K-v0"


@pytest.fixture
def four_tasks(tmp_path: Path) -> str:
    """GSM8K on a data file of four problems: an env with fewer tasks than episodes."""
    path = tmp_path / "four.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{n}", "question": f"What is {n} + 1?",
                                        "answer": f"#### {n + 1}"}) + "\n" for n in range(4)))
    return f"data_path={path}"


def test_every_command_counts_ten_episodes_of_four_tasks_alike(
        tmp_path: Path, four_tasks: str, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert main(["eval", GSM8K, "--env-arg", four_tasks, "--episodes", "10", "--quiet",
                 "--out", str(run)]) == 0
    printed = capsys.readouterr()
    saved = json.loads((run / "summary.json").read_text())
    basis = "bootstrap over tasks, Wilson floor"
    assert (saved["episodes"], saved["tasks"], saved["success_interval"]) == (10, 4, basis)
    interval = f"[{saved['success_low']:.2f}, {saved['success_high']:.2f}]"
    assert interval == "[0.51, 1.00]"  # four tasks' worth, where ten episodes read [0.72, 1.00]
    header, _, row = printed.out.splitlines()[:3]
    cells = dict(zip(re.split(r"\s{2,}", header), re.split(r"\s{2,}", row), strict=False))
    assert (cells["episodes"], cells["tasks"]) == ("10", "4")
    assert cells["success [95% CI over tasks]"] == f"1.00 {interval}"
    assert "10 episodes played 4 distinct tasks" in printed.err  # said at eval time

    report = tmp_path / "report.html"
    assert main(["view", str(run), "--out", str(report)]) == 0
    page = report.read_text()
    assert "10 of 10 <small>4 tasks</small>" in page and basis in page
    assert f"[{saved['success_low']:.3f}, {saved['success_high']:.3f}]" in page

    capsys.readouterr()
    assert main(["rescore", str(run), "--env-arg", four_tasks]) == 0
    assert capsys.readouterr().out.startswith("rescored 10 episodes of 4 tasks: 0 changed")
    rescored = json.loads((run / "rescore.json").read_text())["summary"]
    assert {k: rescored[k] for k in saved if k.startswith(("episodes", "tasks", "success"))} == {
        k: saved[k] for k in saved if k.startswith(("episodes", "tasks", "success"))}


def test_compare_says_why_runs_pair_nothing_and_warns_when_settings_differ(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def run(name: str, *options: str) -> str:
        out = str(tmp_path / name)
        assert main(["eval", GSM8K, "--episodes", "2", "--quiet", "--out", out, *options]) == 0
        return out

    base, reseeded = run("base"), run("seed1", "--seed", "1")
    capsys.readouterr()
    assert main(["compare", base, reseeded]) == 2
    assert capsys.readouterr().err.strip() == (
        "agent-gym compare: error: GSM8K-v0 / oracle and GSM8K-v0 / oracle have no task in "
        "common to compare: A ran with --seed 0 and B with --seed 1, and the seed chooses "
        "which tasks the episodes play; rerun B with --seed 0 (or more --episodes) to play "
        "A's tasks")
    longer = run("turns", "--env-arg", "max_turns=3", "--max-tokens", "128")
    capsys.readouterr()
    assert main(["compare", base, longer]) == 0
    assert ("note: A and B ran agent_gym/GSM8K-v0 with different settings (max_turns (the "
            "default) in A, 3 in B; --max-tokens 256 in A, 128 in B): a difference may be the "
            "settings', not the policies'") in capsys.readouterr().out.splitlines()
