"""The HTML report in a real headless Chromium, opened from a file URL."""

import json
import os
import shutil
from pathlib import Path

import pytest

from agent_gym.cli.main import main
from agent_gym.eval.policies import OraclePolicy, PolicyInput, Reply
from agent_gym.eval.report import render_report
from agent_gym.eval.runs import read_run
from tests.helpers.browser import Browser, chromium_path
from tests.helpers.eval_runs import WrongOnPolicy, episodes, make_run, write_episodes

CODE = "agent_gym/CodeInterpreter-v0"
# Where to keep the screenshot beyond the test (benchmarks/results/report.png for the
# record); unset, it stays in the test's tmp dir and the checkout is left as it was.
SCREENSHOT_ENV = "AGENT_GYM_REPORT_SCREENSHOT"
# 110,000 printable characters, markup among them: the report must show them whole, as text.
# The sandbox keeps the last 64 KiB of each stream, so they go out through both.
BIG_OUTPUT_CODE = (
    "import sys\n"
    "text = ''.join(chr(32 + (i * 7919) % 95) for i in range(110_000))\n"
    "print(text[:60_000])\n"
    "print(text[60_000:], file=sys.stderr)"
)


class BigOutputPolicy:
    """Runs code printing 100 KB, then gives the oracle's answer."""

    name = "big-output"

    async def act(self, observation: PolicyInput) -> Reply:
        if observation.turn == 0:
            call = {"name": "code_interpreter", "arguments": {"code": BIG_OUTPUT_CODE}}
            return Reply(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
        return await OraclePolicy().act(PolicyInput(**{**vars(observation), "turn": 99}))


def test_a_killed_run_is_shown_and_model_text_never_becomes_markup(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    make_run(run, episodes=2)
    records = episodes(run)
    records[0]["transcript"][-2]["content"] = "</pre><script>alert(1)</script>&amp;"
    # Killed while writing a third episode, before any summary.
    (run / "episodes.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records) + '{"episode": 2, "rew')
    (run / "summary.json").unlink()
    page = render_report([read_run(run)])
    assert "<script>alert(1)" not in page
    assert "wilson" in page and "terminated 2" in page
    assert "&lt;/pre&gt;&lt;script&gt;alert(1)&lt;/script&gt;&amp;amp;" in page
    assert "line 3 is cut off (a killed run)" in page and "2 of 2" in page
    assert "other-figures" not in page  # nothing beyond the table to say
    monkeypatch.chdir(tmp_path)
    assert main(["view", str(run)]) == 0
    assert (tmp_path / "report.html").read_text() == page
    assert "Rewards per step: not in this run's log" in page
    assert main(["view", str(run), "--replay", "--out", str(tmp_path / "replayed.html")]) == 0
    replayed = (tmp_path / "replayed.html").read_text()
    assert "Rewards per step (replayed from the saved state): 1<" in replayed
    assert "Not reproducible from its saved state: transcript message 2" in replayed
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "episodes.jsonl",
                                                     "eval.lock"]
    assert main(["view", str(tmp_path / "nowhere")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_report_in_a_headless_browser(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    executable = chromium_path()
    if executable is None:
        pytest.skip("no chromium on PATH: `apt-get install -y chromium` (make setup does)")
    make_run(tmp_path / "a", episodes=4)
    tasks = [r["task_id"] for r in sorted(episodes(tmp_path / "a"), key=lambda r: r["episode"])]
    make_run(tmp_path / "b", WrongOnPolicy(tasks[:2]), episodes=4)
    make_run(tmp_path / "code", BigOutputPolicy(), episodes=1, env_id=CODE,
             env_kwargs={"max_obs_chars": 150_000, "timeout": 30.0})
    (code_record,) = episodes(tmp_path / "code")
    big = code_record["transcript"][3]
    assert big["role"] == "tool" and len(big["content"]) >= 100_000, code_record["transcript"]
    assert code_record["success"]

    report = tmp_path / "report.html"
    assert main(["view", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "code"),
                 "--out", str(report)]) == 0
    assert report.as_uri() in capsys.readouterr().out
    url = report.as_uri()
    with Browser(executable) as browser:
        browser.open(url)
        assert browser.evaluate("document.querySelectorAll('#summary tbody tr').length") == 3
        summary = browser.evaluate("document.getElementById('summary').innerText")
        assert "GSM8K-v0" in summary and "0.500 [" in summary  # run b: 2 of 4
        assert "Newcombe" in browser.evaluate("document.querySelector('.comparison').innerText")
        assert browser.evaluate("document.querySelectorAll('svg rect').length") > 0
        # A transcript is shown: run a's first reply, open and laid out on the page.
        first = sorted(episodes(tmp_path / "a"), key=lambda r: r["episode"])[0]
        shown = browser.evaluate(
            "(() => { const m = document.querySelectorAll('#ep-0-0 details.msg')[2];"
            " const r = m.getBoundingClientRect();"
            " return [m.open, r.height > 0, m.querySelector('pre').textContent]; })()")
        assert shown == [True, True, first["transcript"][2]["content"]]
        # The 100 KB tool output is in the page whole, collapsed until clicked.
        whole = browser.evaluate(
            "(() => { const d = document.querySelectorAll('#ep-2-0 details.msg')[3];"
            " const closed = !d.open; d.querySelector('summary').click();"
            " return [closed, d.open, d.querySelector('pre').textContent]; })()")
        assert whole == [True, True, big["content"]]
        # The tool call that printed it, its code laid out as code.
        code = browser.evaluate(
            "document.querySelector('#ep-2-0 .tool-call .arg-value').textContent")
        assert code == BIG_OUTPUT_CODE

        def visible() -> list[str]:
            return browser.evaluate(
                "Array.from(document.querySelectorAll('.episode'))"
                ".filter(e => e.getClientRects().length > 0).map(e => e.id)")

        assert len(visible()) == 9
        # Filtering by the page's own controls: failures only, then one env.
        browser.evaluate("(() => { const s = document.getElementById('filter-success');"
                         " s.value = 'no'; s.dispatchEvent(new Event('change')); })()")
        assert visible() == ["ep-1-0", "ep-1-1"]
        assert browser.evaluate("location.hash") == "#success=no"
        assert browser.evaluate(
            "document.getElementById('shown-count').textContent") == "2 of 9 episodes shown"
        browser.evaluate("(() => { for (const [id, v] of [['filter-success', ''],"
                         f" ['filter-env', '{CODE}']]) {{ const s = document.getElementById(id);"
                         " s.value = v; s.dispatchEvent(new Event('change')); } })()")
        assert visible() == ["ep-2-0"]
        # A filtered view is a link: the URL's # part applies it on load.
        browser.open(url + "#run=1&end=terminated&success=yes")
        assert visible() == ["ep-1-2", "ep-1-3"]
        browser.open(url + "#run=0")
        browser.screenshot(tmp_path / "report.png")
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get(SCREENSHOT_ENV):
        shutil.copyfile(tmp_path / "report.png", os.environ[SCREENSHOT_ENV])


def test_several_rollouts_per_task_show_pass_at_k_in_the_summary(tmp_path: Path) -> None:
    make_run(tmp_path / "run", WrongOnPolicy(()), episodes=2, rollouts_per_task=2)
    page = render_report([read_run(tmp_path / "run")])
    # Two tasks that always succeed: Wilson's floor for two draws, not a point.
    assert "pass@1 1.000 [0.342, 1.000]<br>pass@2 1.000 [0.342, 1.000]" in page
    assert "bootstrap over tasks, Wilson floor" in page


def test_reply_latencies_are_in_the_table_never_a_stray_bullet(tmp_path: Path) -> None:
    """A reply latency too small to round to 0.00 reached the page as a bare JSON bullet."""
    make_run(tmp_path, episodes=2)
    records = episodes(tmp_path)
    for record in records:
        for reply in record["replies"]:
            reply["latency_s"] = 0.0001
    write_episodes(tmp_path, records)
    page = render_report([read_run(tmp_path)])
    assert "reply_latency" not in page and "other-figures" not in page
    assert "<small>0.00 / 0.00</small>" in page
