"""The `agent-gym` command line as a newcomer meets it: one-line errors with exit status 2
(never a traceback), nothing written before the configuration is known to work, help that
names every form, and a non-zero exit when a whole run failed."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from agent_gym.alfworld.games import GameError, resolve_root
from agent_gym.cli.main import main

GSM8K = "agent_gym/GSM8K-v0"


def _fails_cleanly(argv: list[str], capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    """Run the CLI; it must exit 2 with one stderr line holding every needle."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_a_typo_in_the_env_id_keeps_did_you_mean_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    _fails_cleanly(["eval", "agent_gym/GSM8k-v0", "--out", str(out)], capsys,
                   "agent-gym eval: error:", "GSM8K")
    assert not out.exists()


def test_a_bad_env_arg_and_a_bad_policy_fail_before_the_run_directory_exists(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    _fails_cleanly(["eval", GSM8K, "--env-arg", "max_turnz=2", "--out", str(out)], capsys,
                   "cannot build agent_gym/GSM8K-v0", "max_turnz")
    _fails_cleanly(["eval", GSM8K, "--env-arg", "max_turns=0", "--out", str(out)], capsys,
                   "max_turns")
    _fails_cleanly(["eval", GSM8K, "--policy", "gpt", "--out", str(out)], capsys,
                   "unknown policy 'gpt'", "local[:MODEL]")
    _fails_cleanly(["eval", GSM8K, "--policy", "random", "--out", str(out)], capsys,
                   "admissible actions")
    assert not out.exists()


def test_a_corrected_command_runs_into_the_same_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main(["eval", "agent_gym/GSM8k-v0", "--out", str(out)]) == 2
    assert main(["eval", GSM8K, "--episodes", "2", "--quiet", "--out", str(out)]) == 0
    capsys.readouterr()
    assert json.loads((out / "summary.json").read_text())["episodes"] == 2
    # Another configuration into a used directory is refused in one line.
    _fails_cleanly(["eval", GSM8K, "--seed", "5", "--episodes", "2", "--quiet", "--out",
                    str(out)], capsys, "Use another --out directory")


def test_suites_refuse_env_args_and_policies_get_directories_of_their_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _fails_cleanly(["eval", "--suite", "default", "--env-arg", "max_turns=2", "--out",
                    str(tmp_path / "suite")], capsys, "do not apply to a suite")
    _fails_cleanly(["eval", "--suite", "default", "--split", "test", "--out",
                    str(tmp_path / "suite")], capsys, "do not apply to a suite")
    out = tmp_path / "two"
    assert main(["eval", "agent_gym/ALFWorld-v0", "--policy", "oracle", "--policy", "random",
                 "--episodes", "1", "--quiet", "--env-arg", "max_turns=3",
                 "--out", str(out)]) == 0
    assert (out / "oracle" / "episodes.jsonl").is_file()
    assert (out / "random" / "episodes.jsonl").is_file()
    endpoint = tmp_path / "endpoint"  # a spec's ':', '/', '@' and '#' stay out of the path
    main(["eval", GSM8K, "--policy", "oracle", "--policy", "openai:m@http://127.0.0.1:1/v1#text",
          "--episodes", "1", "--quiet", "--out", str(endpoint)])
    assert sorted(p.name for p in endpoint.iterdir()) == ["openai_m_http___127.0.0.1_1_v1_text",
                                                          "oracle"]


def test_a_run_whose_every_episode_failed_exits_non_zero_and_writes_no_nan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    code = main(["eval", GSM8K, "--policy", "openai:m@http://127.0.0.1:1/v1", "--episodes",
                 "1", "--quiet", "--out", str(out)])
    assert code == 1
    err = capsys.readouterr().err
    assert "every episode of agent_gym/GSM8K-v0" in err and "PolicyError" in err
    assert str(out / "errors.jsonl") in err
    text = (out / "summary.json").read_text()
    assert "NaN" not in text
    assert json.loads(text)["success_rate"] is None


def test_replay_reads_states_and_eval_logs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _fails_cleanly(["replay", str(tmp_path / "missing.json")], capsys, "does not exist")
    out = tmp_path / "run"
    assert main(["eval", GSM8K, "--episodes", "2", "--quiet", "--out", str(out)]) == 0
    capsys.readouterr()
    log = out / "episodes.jsonl"
    _fails_cleanly(["replay", str(log)], capsys, "--episode N", "from 0 to 1")
    _fails_cleanly(["replay", str(log), "--episode", "7"], capsys, "no finished episode 7")
    assert main(["replay", str(log), "--episode", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["turn"] == 1
    # A state whose digest was edited diverges: one line naming the step.
    record = json.loads(log.read_text().splitlines()[0])
    state = record["final_state"]
    state["digests"][1] = "0" * 16
    path = tmp_path / "tampered.json"
    path.write_text(json.dumps(state))
    _fails_cleanly(["replay", str(path)], capsys, "replay diverged at step 1")


def test_ray_without_a_cluster_says_how_to_start_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # "auto" finds a cluster through the address file in Ray's temp directory: this one is
    # empty, so a Ray that another test worker started on this machine is not joined.
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    _fails_cleanly(["eval", GSM8K, "--episodes", "1", "--quiet", "--ray", "auto", "--out",
                    str(tmp_path / "run")], capsys, "ray start --head")


def test_overview_version_and_help_name_every_policy_form(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([]) == 0
    overview = capsys.readouterr().out
    assert "eval" in overview and "train" in overview and "replay" in overview
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and "agent-gym" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for form in ("oracle", "random", "openai:MODEL@BASE_URL", "local[:MODEL][@CHECKPOINT]",
                 "tiny", "vllm[:MODEL][@CHECKPOINT]", "pytrio:MODEL[@CHECKPOINT]", "(default: 4)"):
        assert form in text, form


def test_a_user_error_prints_no_traceback_from_the_installed_command(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agent_gym.cli", "eval", "agent_gym/Nope-v0", "--out",
         str(tmp_path / "run")], capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1
    debug = subprocess.run(
        [sys.executable, "-m", "agent_gym.cli", "--debug", "eval", "agent_gym/Nope-v0",
         "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=120,
    )
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_a_policy_whose_extra_is_missing_says_which_in_one_line(tmp_path: Path) -> None:
    """`--policy local:...` without the train extra (its PyTRIO SDK stands in for the whole
    stack, made unimportable before the command runs), as `agent-gym train` words it."""
    script = ("import sys; sys.modules['pytrio'] = None\n"
              "from agent_gym.cli.main import main\nsys.exit(main())")
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", script, "eval", GSM8K, "--policy", "local:smollm2",
         "--episodes", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("agent-gym eval: error: this needs the train extra (")
    assert "pip install -e '.[train]'" in line and not out.exists()


def test_an_import_error_no_extra_mends_keeps_its_traceback() -> None:
    from agent_gym.cli.parsing import missing_extra

    assert missing_extra(ModuleNotFoundError("No module named 'nope'", name="nope")) is None
    assert "'search' extra" in str(missing_extra(ImportError("no", name="bm25s")))


def test_an_alfworld_split_missing_from_a_data_path_is_refused(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    with pytest.raises(GameError, match="no 'valid_unseen' split"):
        resolve_root(tmp_path, "valid_unseen")
    assert resolve_root(tmp_path, "train") == (tmp_path / "train", "path")
    flat = tmp_path / "flat"
    flat.mkdir()
    assert resolve_root(flat, "valid_unseen") == (flat, "path")


def test_eval_ends_an_episode_at_a_cut_reply_as_training_does(tmp_path: Path) -> None:
    """A reply stopped by the token budget is recorded as cut and never graded."""
    import asyncio

    from agent_gym.eval.config import EvalConfig
    from agent_gym.eval.policies import PolicyInput, Reply
    from agent_gym.eval.run import evaluate

    class CutOracle:
        name = "cut-oracle"

        async def act(self, observation: PolicyInput) -> Reply:
            return Reply(observation.privileged["oracle_actions"][0], cut=True)

    config = EvalConfig(GSM8K, "cut-oracle", episodes=2)
    summary = asyncio.run(evaluate(config, CutOracle(), tmp_path, progress=False))
    assert (summary.success_rate, summary.cut_replies) == (0.0, 2)
    for line in (tmp_path / "episodes.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert record["end_reason"] == "max_tokens" and record["reward"] == 0
        assert record["transcript"][-1]["role"] == "assistant"  # the env never answered
        assert record["final_state"]["actions"] == []


def test_train_errors_are_one_line_too(tmp_path: Path) -> None:
    """A usage error, and a run directory holding another run, from `agent-gym train`."""
    from tests.helpers import grpo_toy

    out = tmp_path / "run"
    command = [sys.executable, "-m", "agent_gym.cli", "train", "grpo"]
    env = {**__import__("os").environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    bad = subprocess.run([*command, "--loss", "dpo", "--out", str(out)], capture_output=True,
                         text=True, timeout=300, env=env)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
    assert "invalid choice: 'dpo'" in bad.stderr and not out.exists()
    first = [*command, "--env-id", f"tests.helpers.grpo_toy:{grpo_toy.ENV_ID}", "--model", "tiny",
             "--lora-rank", "0", "--steps", "1", "--batch-size", "2", "--group-size", "2",
             "--max-tokens", "4", "--max-trajectory-tokens", "64", "--no-progress",
             "--out", str(out)]
    assert subprocess.run(first, capture_output=True, timeout=300, env=env).returncode == 0
    clash = subprocess.run([*command, "--model", "smollm2", "--out", str(out)],
                           capture_output=True, text=True, timeout=300, env=env)
    assert clash.returncode == 2 and "Traceback" not in clash.stderr
    assert clash.stderr.strip().splitlines() == [
        f"agent-gym train grpo: error: {out} holds a run with model='tiny'; continue it with "
        "the same values or give another --out"]


def test_replay_of_an_edited_state_keeps_the_sandbox_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Defect 9: host settings come from --env-arg, never from the state file."""
    import gymnasium

    from agent_gym.envs.code import PROTOCOLS

    marker = Path(tempfile.gettempdir()) / f"agent-gym-replay-escape-{tmp_path.name}"
    env = gymnasium.make("agent_gym/CodeInterpreter-v0", max_turns=3)
    try:
        env.reset(seed=0)
        code = f"open({str(marker)!r}, 'w').write('out')\nprint('written')"
        env.step(PROTOCOLS[0].format(code))
        saved = json.loads(env.unwrapped.save_state().to_json())
    finally:
        env.close()
    saved["env_kwargs"]["isolation"] = "rlimits"
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(saved))
    try:
        assert main(["replay", str(path)]) == 0
        printed = json.loads(capsys.readouterr().out)
        assert printed["observation"] == "written" and not marker.exists()
        assert printed["host_settings_not_taken"] == {"isolation": "rlimits"}
        assert printed["reward_settings"]["reward_correct"] == 1.0
        assert main(["replay", str(path), "--env-arg", "timeout=5"]) == 0  # the caller's own
        assert json.loads(capsys.readouterr().out)["host_settings_not_taken"] == {
            "isolation": "rlimits", "timeout": 10.0}
    finally:
        marker.unlink(missing_ok=True)


def test_every_option_of_every_env_command_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    """Each flag of each `agent-gym` command says what it does (train has its own test)."""
    import argparse

    from agent_gym.cli.main import build_parser

    def walk(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.Action]]:
        found = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += [(f"{name} {where}", a) for where, a in walk(sub)]
            elif not isinstance(action, argparse._HelpAction):
                found.append((parser.prog, action))
        return found

    missing = [f"{where}: {action.dest}" for where, action in walk(build_parser())
               if not action.help]
    assert missing == []


def test_no_help_text_shows_an_escape_or_a_default_twice() -> None:
    """Issue 33: `--help` of eval, view and compare printed "95%%", and options whose help
    names their default got a second one appended ("(default: 10, ...) (default: None)")."""
    import argparse
    import re

    from agent_gym.cli.main import _plugins_for, build_parser

    def walk(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
        found = [parser]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in dict.fromkeys(action.choices.values()):  # aliases repeat a parser
                    found += walk(sub)
        return found

    parsers = walk(build_parser(_plugins_for([])))  # every plugin command too (train)
    assert {"agent-gym eval", "agent-gym view", "agent-gym compare"} <= {p.prog for p in parsers}
    escaped = [parser.prog for parser in parsers if "%%" in parser.format_help()]
    twice = [
        f"{parser.prog} {action.dest}: {text}"
        for parser in parsers for action in parser._actions if action.help
        for text in [" ".join(parser._get_formatter()._expand_help(action).split())]
        if len(re.findall(r"\bdefault:", text, re.IGNORECASE)) > 1
    ]
    assert (escaped, twice) == ([], [])


def test_eval_prints_invalid_shares_and_what_a_rerun_found(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 33: the table hid that every action was refused, and a rerun with fewer
    --episodes silently shrank summary.json."""
    from tests.helpers.openai_server import Behaviour, ChatServer

    out = tmp_path / "run"
    with ChatServer(Behaviour(reply=lambda body: {"content": "I am not sure."})) as server:
        command = ["eval", GSM8K, "--policy", f"openai:m@{server.url}", "--quiet",
                   "--out", str(out)]
        assert main([*command, "--episodes", "3"]) == 0
        first = capsys.readouterr()
        header, _, row = first.out.splitlines()[:3]
        start = header.index("invalid")
        assert row[start:].split()[:2] == ["1.00", "0.00"]  # invalid, cut
        assert (f"agent-gym eval: {GSM8K} / openai:m@{server.url}: most actions were invalid "
                "(3 of 3)") in first.err
        assert "found" not in first.err
        assert main([*command, "--episodes", "2"]) == 0
    again = capsys.readouterr()
    assert f"agent-gym eval: found 3 episodes in {out}; the 2 asked for are all there" in again.err
    assert json.loads((out / "summary.json").read_text())["episodes"] == 3


def test_eval_shows_replies_cut_by_max_tokens_in_its_table_and_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 33: with every reply cut by --max-tokens the table showed a plain 0.00."""
    from tests.helpers.openai_server import Behaviour, ChatServer

    with ChatServer(Behaviour(reply=lambda body: {"content": "Let me think step"},
                              finish_reason="length")) as server:
        assert main(["eval", GSM8K, "--policy", f"openai:m@{server.url}", "--quiet",
                     "--max-tokens", "4", "--episodes", "2", "--out", str(tmp_path / "run")]) == 0
    printed = capsys.readouterr()
    header, _, row = printed.out.splitlines()[:3]
    # no reply reached the env, so no action was judged: invalid "-", cut 1.00
    assert row[header.index("invalid"):].split()[:2] == ["-", "1.00"]
    assert "most replies were cut by --max-tokens 4: raise it (2 of 2" in printed.err


def test_env_kwargs_json_is_read_as_env_args_with_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One convention for env settings (``--env-arg KEY=VALUE``, every command); the
    trainers' former ``--env-kwargs JSON`` is accepted and says how it was read."""
    assert main(["eval", GSM8K, "--episodes", "1", "--quiet", "--env-kwargs",
                 '{"max_turns": 2}', "--env-arg", "reward_correct=2", "--out",
                 str(tmp_path / "run")]) == 0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["env_kwargs"] == {"max_turns": 2, "reward_correct": 2}
    assert "--env-kwargs is read as one --env-arg KEY=VALUE per key" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", GSM8K, "--env-kwargs", "[1]", "--out", str(tmp_path / "bad")])
    assert capsys.readouterr().err.strip().splitlines() == [
        "agent-gym eval: error: --env-kwargs: expected a JSON object, got '[1]' "
        "(see `agent-gym eval --help`)"]
    assert not (tmp_path / "bad").exists()
    # Values no JSON reader should take: each is one line, never a traceback.
    for option, value in (("--env-arg", "max_turns=" + "[" * 100_000),
                          ("--env-arg", "max_turns=" + "7" * 5000),
                          ("--env-arg", "reward_correct=NaN"),
                          ("--env-kwargs", '{"max_turns": ' + "7" * 5000 + "}")):
        code = 2
        try:
            code = main(["eval", GSM8K, option, value, "--out", str(tmp_path / "bad")])
        except SystemExit as exit_:
            code = int(str(exit_.code))
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("agent-gym eval: error:"), err
    assert not (tmp_path / "bad").exists()
