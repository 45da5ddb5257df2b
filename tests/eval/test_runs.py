import json
from pathlib import Path

import pytest

from agent_gym.eval.runs import RunDirError, find_runs, read_run
from tests.helpers.eval_runs import GSM8K, episodes, make_run, write_episodes


def test_a_killed_and_resumed_log_is_read_as_written_and_left_unchanged(tmp_path: Path) -> None:
    run = tmp_path / "run"
    make_run(run, episodes=4)
    records = episodes(run)
    log = run / "episodes.jsonl"
    # A resume that logged episode 1 again, a line that is not JSON, and a kill mid-line.
    text = (log.read_text() + json.dumps(records[1]) + "\n" + "{oops\n"
            + json.dumps({**records[2], "episode": 7, "reward": "1"}) + "\n" + '{"episode": 4, "ta')
    log.write_text(text)
    read = read_run(run)
    assert log.read_text() == text  # reading never repairs or cuts
    assert [r["episode"] for r in read.episodes.values()] == [0, 1, 2, 3]
    assert set(read.episodes) == {(GSM8K, r["task_id"], 0) for r in records}
    assert any("logged twice" in n for n in read.notes)
    assert any("line 6 is not valid JSON" in n for n in read.notes)
    assert any("line 7 has no valid reward" in n for n in read.notes)
    assert any("cut off" in n for n in read.notes)
    summary = read.summary()
    assert summary.episodes == 4 and summary.success_rate == 1.0


def test_rollouts_key_episodes_apart(tmp_path: Path) -> None:
    run = tmp_path / "run"
    make_run(run, episodes=3)
    records = episodes(run)
    # Without a rollout field (lines of an eval older than rollouts per task), a task's
    # next episode is its next rollout...
    older = {k: v for k, v in records[0].items() if k != "rollout"}
    same_task = [{**older, "episode": i} for i in range(3)]
    write_episodes(run, same_task)
    task = records[0]["task_id"]
    assert list(read_run(run).episodes) == [(GSM8K, task, 0), (GSM8K, task, 1), (GSM8K, task, 2)]
    # ...and a recorded rollout index is kept, even past the run's rollouts per task (what
    # an older eval left when rerun with fewer), which the notes say; each episode that
    # plays the task again is its next K plays (K = 6 rollouts, read from the log).
    config = run / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "rollouts_per_task": 5}))
    write_episodes(run, [{**r, "rollout": 5 - i} for i, r in enumerate(same_task)])
    read = read_run(run)
    assert list(read.episodes) == [(GSM8K, task, 5), (GSM8K, task, 6 + 4), (GSM8K, task, 12 + 3)]
    assert read.config.rollouts_per_task == 6
    assert read.notes == ["episodes.jsonl holds 1 episode beyond config.json's 3 episodes of 5 "
                          "rollouts (a rerun with fewer --episodes by an older agent-gym shrank "
                          "it); every episode is read"]


def test_a_newer_config_and_a_suite_directory_are_read(tmp_path: Path) -> None:
    make_run(tmp_path / "suite" / "GSM8K-v0" / "oracle", episodes=2)
    config = tmp_path / "suite" / "GSM8K-v0" / "oracle" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "rollouts_per_task": 3}))
    (found,) = find_runs(tmp_path / "suite")
    assert read_run(found).config.episodes == 2
    assert find_runs(tmp_path) == [found]
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match="holds no eval run"):
        find_runs(tmp_path / "empty")
    with pytest.raises(RunDirError, match="not a directory"):
        find_runs(tmp_path / "missing")


def test_a_run_shrunk_by_an_older_eval_is_read_whole_and_says_so(tmp_path: Path) -> None:
    """Issue 33: an older eval rerun with --episodes 3 into a 6-episode run rewrote its
    config.json to 3, and view and compare then read 3 of the 6 episodes on disk."""
    run = tmp_path / "run"
    make_run(run, episodes=6)
    config = run / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "episodes": 3}))
    read = read_run(run)
    assert len(read.episodes) == 6 and read.summary().episodes == 6
    assert read.config.episodes == 6
    assert any("holds 3 episodes beyond config.json's 3 episodes" in n for n in read.notes)
    # The next eval into it heals config.json to what the directory holds.
    make_run(run, episodes=3)
    assert json.loads(config.read_text())["episodes"] == 6 and read_run(run).notes == []
