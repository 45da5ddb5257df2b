from pathlib import Path

import pytest

from agent_gym.cli.main import main
from agent_gym.eval.compare import compare, paired_difference
from agent_gym.eval.runs import read_run
from tests.helpers.eval_runs import GSM8K, WrongOnPolicy, episodes, make_run


def test_newcombe_paired_interval_against_hand_computed_values() -> None:
    # 12 paired tasks: 5 solved by both, 1 by A only, 4 by B only, 2 by neither. By hand:
    # p_A = 6/12 = .5, Wilson [.253778, .746222]; p_B = 9/12 = .75, Wilson [.467689, .911063];
    # phi = (5*2 - 1*4) / sqrt(6*6*9*3) = .192450;
    # delta = sqrt(.282311^2 - 2 phi .282311 * .246222 + .246222^2) = .337002,
    # epsilon = sqrt(.161063^2 - 2 phi .161063 * .246222 + .246222^2) = .267025,
    # so B - A = .25 in [.25 - .337002, .25 + .267025] = [-.087002, .517025].
    d = paired_difference(both=5, only_a=1, only_b=4, neither=2)
    assert d.difference == pytest.approx(0.25)
    assert (d.low, d.high) == pytest.approx((-0.087002, 0.517025), abs=2e-6)
    # All 10 solved by both: phi is undefined (taken as 0) and the interval is the Wilson
    # half-width of 10/10 on each side: 1 - .722460 = .277540.
    d = paired_difference(both=10, only_a=0, only_b=0, neither=0)
    assert (d.difference, d.low, d.high) == pytest.approx((0.0, -0.277540, 0.277540), abs=2e-6)
    # Every flip one way: the interval excludes 0 and stays inside [-1, 1].
    d = paired_difference(both=0, only_a=0, only_b=15, neither=0)
    assert d.difference == 1.0 and 0.5 < d.low < 1.0 and d.high == pytest.approx(1.0)


def test_compare_pairs_runs_made_here_and_names_the_flips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_run(tmp_path / "a", episodes=8, seed=1)
    tasks = [r["task_id"] for r in sorted(episodes(tmp_path / "a"), key=lambda r: r["episode"])]
    # B: same seed so the same tasks, wrong on three of them; and 2 more episodes than A.
    make_run(tmp_path / "b", WrongOnPolicy(tasks[:3]), episodes=10, seed=1)
    result = compare([read_run(tmp_path / "a")], [read_run(tmp_path / "b")], "A", "B")
    assert result.overall.pairs == 8 and result.only_in_b == 2
    assert result.overall.difference == pytest.approx(-3 / 8)
    # 3 flips of 8 one way: as McNemar would, the interval still holds 0 at this n.
    assert result.overall.low < -3 / 8 < 0 < result.overall.high
    assert [key[1] for key in result.broken] == tasks[:3] and result.fixed == []
    (env,) = result.envs
    assert env.env_id == GSM8K and env.reward_a == 1.0 and env.reward_b == pytest.approx(5 / 8)

    html = tmp_path / "compare.html"
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert "-0.375 [" in out and "broken (solved in A, failed in B): 3" in out
    assert all(task in out for task in tasks[:3])
    assert "Newcombe" in html.read_text() and tasks[0] in html.read_text()


def test_runs_without_shared_tasks_are_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_run(tmp_path / "a", episodes=1, seed=0)
    make_run(tmp_path / "b", episodes=1, seed=1)
    if episodes(tmp_path / "a")[0]["task_id"] == episodes(tmp_path / "b")[0]["task_id"]:
        pytest.fail("seeds 0 and 1 were expected to start on different tasks")
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no task in common" in err[0]
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "nowhere")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_compare_and_its_report_show_invalid_actions_and_cut_replies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 33: a side whose every reply was cut (or refused) read as a plain 0.000."""
    import re

    from agent_gym.eval.policies import PolicyInput, Reply

    class Cut:
        name = "cut"

        async def act(self, observation: PolicyInput) -> Reply:
            return Reply(observation.privileged["oracle_actions"][0], cut=True)

    class Unboxed:  # GSM8K refuses a reply without a boxed answer
        name = "unboxed"

        async def act(self, observation: PolicyInput) -> Reply:
            return Reply("I am not sure.")

    make_run(tmp_path / "a", episodes=4)
    make_run(tmp_path / "cut", Cut(), episodes=4)
    make_run(tmp_path / "unboxed", Unboxed(), episodes=4)
    html = tmp_path / "compare.html"
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "cut"), str(tmp_path / "unboxed"),
                 "--html", str(html)]) == 0
    cut, unboxed = capsys.readouterr().out.split("\n\n")

    def cells(text: str) -> dict[str, str]:
        lines = text.splitlines()
        rule = next(i for i, line in enumerate(lines) if line.startswith("---"))
        spans = [m.span() for m in re.finditer(r"-+", lines[rule])]
        return {lines[rule - 1][a:b].strip(): lines[rule + 1][a:b].strip() for a, b in spans}

    assert (cells(cut)["invalid A/B"], cells(cut)["cut A/B"]) == ("0.00/-", "0.00/1.00")
    assert (cells(unboxed)["invalid A/B"], cells(unboxed)["cut A/B"]) == ("0.00/1.00", "0.00/0.00")
    assert "note: B: most replies were cut by --max-tokens 256: raise it" in cut
    assert "note: B: most actions were invalid (4 of 4)" in unboxed
    assert "note: A:" not in cut + unboxed
    page = html.read_text()
    assert "<th>invalid actions</th>" in page and "<th>cut replies</th>" in page
    assert "most replies were cut by --max-tokens 256: raise it" in page
