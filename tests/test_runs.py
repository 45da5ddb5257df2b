import json
from pathlib import Path

import pytest

from agent_gym.runs import RunDirError, find_runs, read_run
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
    assert any("line 6 is not JSON" in n for n in read.notes)
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
    # ...and a recorded rollout index is taken as it is, within the run's rollouts per task.
    config = run / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "rollouts_per_task": 5}))
    write_episodes(run, [{**r, "rollout": 5 - i} for i, r in enumerate(same_task)])
    assert list(read_run(run).episodes) == [(GSM8K, task, 4), (GSM8K, task, 3)]  # 5 is past it


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
