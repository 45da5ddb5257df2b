import json
from pathlib import Path

import pytest

from agent_gym import rewards
from agent_gym.cli.main import main
from agent_gym.envs import gsm8k
from agent_gym.eval.report import render_report
from agent_gym.eval.runs import read_run
from tests.helpers.eval_runs import episodes, make_run, write_episodes


def test_rescore_replays_each_episode_with_the_current_reward_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    make_run(run, episodes=7)
    records = sorted(episodes(run), key=lambda r: r["episode"])
    # 1: logged as a failure (as an older reward code might have scored it);
    # 2: its saved actions edited; 3: its reply edited; 4: its state unreadable.
    records[1] = {**records[1], "reward": 0.0, "success": False}
    records[2]["final_state"]["actions"][0] = "The answer is \\boxed{1}."
    records[3]["transcript"][-2]["content"] = "I would never say that."
    records[4]["final_state"] = "not a state"
    records[6]["transcript"][1]["content"] = "What is 2 + 2?"  # 6: its question edited
    write_episodes(run, records)
    before = {name: (run / name).read_bytes() for name in ("episodes.jsonl", "config.json",
                                                          "summary.json")}
    # The reward code as it is now: episode 5's task is no longer scored correct.
    strict = records[5]["final_state"]["task_id"]

    def score_now(text: str, reference: str, timeout: float) -> rewards.MathScore:
        score = rewards.score_math(text, reference, timeout)
        task = next(t for t in gsm8k.load_tasks(None, "bundled", None) if t.task_id == strict)
        if reference == task.payload["reference"]:
            return type(score)(score.answer, False)
        return score

    monkeypatch.setattr(gsm8k, "score_math", score_now)

    assert main(["rescore", str(run)]) == 1  # some episodes could not be replayed
    out = capsys.readouterr().out
    result = json.loads((run / "rescore.json").read_text())
    assert result["changed"] == [1, 5] and result["failed"] == [2, 3, 4, 6]
    assert result["original_summary"]["success_rate"] == pytest.approx(6 / 7)
    assert result["summary"]["episodes"] == 3 and result["summary"]["errors"] == 4
    assert result["summary"]["success_rate"] == pytest.approx(2 / 3)
    by_episode = {e["episode"]: e for e in result["episodes"]}
    assert by_episode[1]["new_reward"] == 1.0 and by_episode[1]["step_rewards"] == [1.0]
    assert by_episode[5]["new_success"] is False
    assert "replay diverged at step 1" in by_episode[2]["error"]
    assert "transcript message 2 (assistant) differs" in by_episode[3]["error"]
    assert "transcript message 1 (user) differs" in by_episode[6]["error"]
    assert "must be a JSON object" in by_episode[4]["error"]
    assert "2 changed, 4 not reproducible" in out and "episode 5" in out
    assert {name: (run / name).read_bytes() for name in before} == before

    # Never replaced silently, and never over the run's own files.
    assert main(["rescore", str(run)]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert main(["rescore", str(run), "--out", str(run / "episodes.jsonl"), "--force"]) == 2
    assert "would overwrite" in capsys.readouterr().err
    assert (run / "episodes.jsonl").read_bytes() == before["episodes.jsonl"]

    # The report shows the replayed rewards per step.
    assert "Rewards per step (replayed from the saved state): 1" in render_report(
        [read_run(run)])
