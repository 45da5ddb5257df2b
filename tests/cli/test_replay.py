"""``agent-gym replay`` on state files it must not trust: each is refused in one line."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import gymnasium
import pytest

from agent_gym.cli.main import main


def _state_payload() -> dict:
    env = gymnasium.make("agent_gym/GSM8K-v0", max_turns=3)
    env.reset(seed=2)
    env.step("thinking")
    payload = json.loads(env.unwrapped.save_state().to_json())
    env.close()
    return payload


def _replay_error(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("agent-gym replay: error:"), err
    return err


def test_replay_never_connects_where_a_state_says(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.3)
    payload = {**_state_payload(), "env_id": "agent_gym/Remote-v0", "task_id": "x",
               "env_kwargs": {"url": f"ws://127.0.0.1:{listener.getsockname()[1]}",
                              "token": "the file's token"}}
    path = tmp_path / "state.json"
    path.write_text(json.dumps(payload))
    with listener:
        assert "not an env that saves" in _replay_error(path, capsys)
        with pytest.raises(TimeoutError):
            listener.accept()


@pytest.mark.parametrize("damage", ["nested", "not utf-8", "foreign env", "bad setting",
                                    "nested episodes"])
def test_replay_refuses_a_hostile_state_in_one_line(
    damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    payload = _state_payload()
    path = tmp_path / "state.json"
    if damage == "nested":
        text = json.dumps({**payload, "env_kwargs": "@"}).replace('"@"', "[" * 50_000 + "]" * 50_000)
        path.write_text(text)
    elif damage == "not utf-8":
        path.write_bytes(b"\xfe" + json.dumps(payload).encode())
    elif damage == "foreign env":
        path.write_text(json.dumps({**payload, "env_id": "CartPole-v1"}))
    elif damage == "bad setting":
        path.write_text(json.dumps({**payload, "env_kwargs": {"max_turns": "many"}}))
    else:  # an eval log whose one line nests too deep is not an eval log, nor a state
        path = tmp_path / "episodes.jsonl"
        path.write_text('{"episode": 0, "final_state": ' + "[" * 50_000 + "]" * 50_000 + "}\n")
    _replay_error(path, capsys)


def test_replay_takes_an_episodes_state_from_a_line_whose_figures_are_damaged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.helpers.eval_runs import make_run

    run = tmp_path / "run"
    make_run(run, episodes=2)
    log = run / "episodes.jsonl"
    first, second = log.read_text().splitlines()
    damaged = json.dumps({**json.loads(first), "latency_s": "slow", "completion_tokens": -1})
    log.write_text(f"{damaged}\n{second}\nnot json\n")
    assert main(["replay", str(log), "--episode", "0"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["turn"] >= 1
    assert "line 3 is not valid JSON" in err and err.count("\n") == 1
