"""The commands that read and write run directories, from outside (issue 35): no output
lands on a file of a run being read, a crafted or unwritable run is one line (exit 2,
no traceback), one eval writes a run at a time, and a full disk stops a run with its saved
episodes kept and counted as they are."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from agent_gym.cli.main import main
from tests.helpers.eval_runs import GSM8K, make_run, run_held_by_another_process
from tests.helpers.nodes import special_nodes


def _fails_cleanly(argv: list[str], capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    """Run the CLI; it must exit 2 with one stderr line holding every needle."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _snapshot(run: Path) -> dict[str, bytes]:
    """The run's files (but the lock, which names the last eval that took it)."""
    return {p.name: p.read_bytes() for p in sorted(run.iterdir())
            if p.is_file() and p.name != "eval.lock"}


def test_no_output_lands_on_a_file_of_a_run_it_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run, other = tmp_path / "run", tmp_path / "other"
    make_run(run, episodes=2)
    make_run(other, episodes=2)
    before = {path: _snapshot(path) for path in (run, other)}
    (tmp_path / "link").symlink_to(run, target_is_directory=True)
    (tmp_path / "summary-link.html").symlink_to(run / "summary.json")
    os.link(run / "episodes.jsonl", tmp_path / "hard-link.html")
    for argv in (
        ["view", str(run), "--out", str(run / "episodes.jsonl")],
        ["view", str(run), "--out", str(tmp_path / "link" / "config.json")],
        ["view", str(run), "--out", str(tmp_path / "summary-link.html")],
        ["view", str(run), "--out", str(tmp_path / "hard-link.html")],
        ["view", str(run), "--out", str(run / "rescore.json")],  # view reads it
        ["view", str(run), str(other), "--out", str(other / "errors.jsonl")],
        ["compare", str(run), str(other), "--html", str(other / "summary.json")],
        ["compare", str(run), str(other), "--html", str(tmp_path / "link" / "errors.jsonl")],
        ["rescore", str(run), "--out", str(tmp_path / "link" / "episodes.jsonl"), "--force"],
    ):
        _fails_cleanly(argv, capsys, "would overwrite", "a file of a run being read")
    assert {path: _snapshot(path) for path in (run, other)} == before
    # A directory as the output is one line too, never a traceback.
    _fails_cleanly(["view", str(run), "--out", str(run)], capsys, "is a directory")
    _fails_cleanly(["compare", str(run), str(other), "--html", str(tmp_path)], capsys,
                   "is a directory")
    _fails_cleanly(["rescore", str(run), "--out", str(run)], capsys, "is a directory")
    (tmp_path / "a-file").write_text("")
    _fails_cleanly(["view", str(run), "--out", str(tmp_path / "a-file" / "report.html")],
                   capsys, "cannot write")
    assert {path: _snapshot(path) for path in (run, other)} == before
    # What each command is there to write it still writes: view's report in the working
    # directory (never in the run unless told), rescore's own file, and any file elsewhere.
    monkeypatch.chdir(tmp_path)
    assert main(["view", str(run)]) == 0 and (tmp_path / "report.html").is_file()
    assert not (run / "report.html").exists()
    assert main(["view", str(run), "--out", str(run / "report.html")]) == 0
    assert main(["rescore", str(run)]) == 0 and (run / "rescore.json").is_file()
    assert main(["compare", str(run), str(other), "--html", str(tmp_path / "c.html")]) == 0


def test_no_output_replaces_a_device_or_a_fifo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As root, ``view --out /dev/null``, ``compare --html /dev/null`` and ``rescore --out
    /dev/full`` exited 0 and left a regular file where the device was. The nodes here are
    made in a temporary directory (a FIFO, and a copy of /dev/null's device where this user
    may make one), reached directly and through a symlink."""
    run, other = tmp_path / "run", tmp_path / "other"
    make_run(run, episodes=2)
    make_run(other, episodes=2)
    nodes = special_nodes(tmp_path)
    (tmp_path / "link").symlink_to(nodes[-1])
    kinds = {node: stat.S_IFMT(os.lstat(node).st_mode) for node in nodes}
    for target in [*nodes, tmp_path / "link"]:
        for argv in (["view", str(run), "--out", str(target)],
                     ["compare", str(run), str(other), "--html", str(target)],
                     ["rescore", str(run), "--out", str(target), "--force"]):
            _fails_cleanly(argv, capsys, "is not a regular file")
    assert {node: stat.S_IFMT(os.lstat(node).st_mode) for node in nodes} == kinds
    assert (tmp_path / "link").is_symlink()


@pytest.mark.parametrize(("config", "needle"), [
    ('{"env_id": "agent_gym/GSM8K-v0", "policy": "oracle", "episodes": 0}',
     "episodes must be from 1"),
    ('{"env_id": "agent_gym/GSM8K-v0", "policy": "oracle", "episodes": 2, '
     '"rollouts_per_task": 10000}', "rollouts_per_task must be from 1 to 1000"),
    ("not json at all", "is not valid JSON"),
])
def test_a_crafted_config_is_one_line_for_every_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: str, needle: str
) -> None:
    run = tmp_path / "run"
    make_run(run, episodes=2)
    (run / "config.json").write_text(config)
    before = _snapshot(run)
    for argv in (["view", str(run)], ["compare", str(run), str(run)], ["rescore", str(run)],
                 ["eval", GSM8K, "--episodes", "2", "--out", str(run), "--quiet"]):
        _fails_cleanly(argv, capsys, "config.json", needle)
    assert _snapshot(run) == before


def test_view_shows_a_run_with_crafted_figures_and_says_what_it_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    make_run(run, episodes=3)
    log = run / "episodes.jsonl"
    first, *rest = log.read_text().splitlines()
    record = json.loads(first)
    nan = json.dumps(record).replace('"latency_s": ', '"latency_s": NaN, "x": ')
    infinite = json.dumps({**record, "episode": 1}).replace('"reward": ',
                                                            '"reward": Infinity, "x": ')
    log.write_text("\n".join([nan, infinite, *rest, json.dumps({**record, "turns": 10**8})])
                   + "\n")
    assert main(["view", str(run), "--out", str(tmp_path / "report.html")]) == 0
    page = (tmp_path / "report.html").read_text()
    assert "line 1 holds the non-finite number NaN; skipped" in page
    assert "line 2 holds the non-finite number Infinity; skipped" in page
    assert "100000000 turns" in page and page.count("<rect") <= 30


def test_an_eval_out_of_range_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    _fails_cleanly(["eval", GSM8K, "--episodes", "-1", "--out", str(out)], capsys,
                   "episodes must be from 1")
    _fails_cleanly(["eval", GSM8K, "--rollouts-per-task", "5000", "--out", str(out)], capsys,
                   "rollouts_per_task must be from 1 to 1000")


def test_a_second_eval_on_one_out_is_refused_naming_the_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    with run_held_by_another_process(run) as first:
        before = _snapshot(run)
        _fails_cleanly(["eval", GSM8K, "--episodes", "2", "--out", str(run), "--quiet"],
                       capsys, "is being written by another eval", f"pid {first.pid} on",
                       "another --out")
        assert _snapshot(run) == before
    assert main(["eval", GSM8K, "--episodes", "2", "--out", str(run), "--quiet"]) == 0


def test_a_full_disk_stops_the_run_in_one_line_with_the_saved_episodes_counted(
    tmp_path: Path
) -> None:
    """Real refusals of the file system: the child may write files of at most 20,000 bytes
    (RLIMIT_FSIZE, with SIGXFSZ ignored, so a write past it fails with EFBIG as a full disk
    fails with ENOSPC); episodes.jsonl outgrows that after about 16 of 30 episodes."""
    run = tmp_path / "run"
    argv = ["eval", GSM8K, "--episodes", "30", "--out", str(run)]
    child = subprocess.run(
        [sys.executable, "-c", (
            "import resource, signal, sys\n"
            "from agent_gym.cli.main import main\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.RLIM_INFINITY))\n"
            "sys.exit(main(sys.argv[1:]))\n"
        ), *argv],
        capture_output=True, text=True, timeout=120,
    )
    assert child.returncode == 2, child.stderr[-3000:]
    assert "Traceback" not in child.stderr
    messages = [line for line in child.stderr.splitlines() if line.startswith("agent-gym")]
    assert len(messages) == 1, child.stderr[-3000:]
    saved = run.joinpath("episodes.jsonl").read_bytes().split(b"\n")[:-1]  # whole lines
    assert 5 <= len(saved) < 30
    assert (f"cannot write {run / 'episodes.jsonl'}: File too large; the run stopped with "
            f"{len(saved)} finished episodes saved") in messages[0]
    # The progress bar counted exactly the episodes saved, not those played.
    counts = re.findall(r"(\d+)/30", child.stderr)
    assert counts and int(counts[-1]) == len(saved)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["episodes"] == len(saved) and summary["interrupted"] is True

    # Room again: the rerun keeps every saved episode and sets the cut line aside.
    assert main([*argv, "--quiet"]) == 0
    after = run.joinpath("episodes.jsonl").read_bytes()
    assert after.startswith(b"\n".join(saved) + b"\n")
    assert sorted(json.loads(line)["episode"] for line in after.splitlines()) == list(range(30))
