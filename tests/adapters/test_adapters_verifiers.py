"""verifiers and GEM, each run by its own code against the project.

verifiers (0.4.0, ``verifiers.v1``) reaches Gym-style envs through its OpenEnv taskset. The
tests run its own CLI, ``vf-eval``, on that taskset against ``agent-gym serve``: verifiers'
``OpenEnvEnv.run`` steps OpenEnv's ``GenericEnvClient``, its null harness (the chat program
it ships) plays the model's side through its interception server, and the model is an
OpenAI-compatible endpoint on loopback (``tests.helpers.openai_server``): scripted with each
task's solution, or answering with the embedded SmolLM2. Two things stand in for what the
machine lacks: a ``uv`` that answers that the chat program's dependencies are installed
(they are, in this interpreter; the real one would download them), and a temporary
``HOME``, so nothing of verifiers' cache or a Prime login is read or written. GEM's own
wrappers and vector env run agent_gym envs through ``agent_gym.adapters.gem``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gymnasium
import pytest

from tests.helpers.openai_server import Behaviour, ChatServer
from tests.helpers.serve_process import running_server

pytest.importorskip("verifiers.v1.tasksets.openenv.taskset")
gem_core = pytest.importorskip("gem.core")

VF_EVAL = Path(sys.executable).with_name("vf-eval")
SEARCH = {"max_turns": 5}
UV = """#!/bin/sh
# verifiers prepares its chat program with `uv sync --script`; its dependencies are already
# installed beside this interpreter, so say so instead of downloading them.
case "$*" in
  *--help*) echo "--script" ;;
  "python find --script"*) echo "{python}" ;;
  "sync --script"*) ;;
  *) echo "uv stand-in: unsupported: $*" >&2; exit 2 ;;
esac
"""
PRIVILEGED_KEYS = ("privileged", "oracle_actions", "reference_answer", "gold_passage_ids")


@pytest.fixture(scope="module")
def search_url() -> Iterator[str]:
    with running_server("agent_gym/Search-v0", "--env-arg", "max_turns=5") as url:
        yield url


def vf_eval(tmp_path: Path, base_url: str, model_url: str, resets: list[dict[str, Any]],
            **sampling: Any) -> list[dict[str, Any]]:
    """Run ``vf-eval`` on verifiers' OpenEnv taskset; the episodes it wrote, in task order
    (each one the trace of its one seat, the player)."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "uv").write_text(UV.replace("{python}", sys.executable))
    (tools / "uv").chmod(0o755)
    config = {
        "model": "smollm2", "push": False, "output_dir": str(tmp_path / "runs"),
        "run": {"dir": "run"}, "client": {"base_url": model_url}, "sampling": sampling,
        "env": {"taskset": {"id": "openenv", "base_url": base_url, "resets": resets},
                "player": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}},
    }
    (tmp_path / "eval.json").write_text(json.dumps(config))
    environment = {**os.environ, "HOME": str(tmp_path / "home"),
                   "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"}
    process = subprocess.Popen([str(VF_EVAL), "@", str(tmp_path / "eval.json"), "--no-rich"],
                               cwd=tmp_path, env=environment, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True, text=True)
    try:
        output, _ = process.communicate(timeout=120)
    finally:  # the eval and the harness programs it started, whatever happened
        if process.poll() is None:
            # SIGTERM first: vf-eval then tears its rollouts (their own sessions) down.
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
    assert process.returncode == 0, output[-3000:]
    lines = (tmp_path / "runs" / "run" / "traces.jsonl").read_text().splitlines()
    episodes = sorted(map(json.loads, lines), key=lambda episode: episode["task"]["data"]["idx"])
    assert [(e["ok"], [t["errors"] for t in e["traces"]]) for e in episodes] == \
        [(True, [[]])] * len(resets), output[-3000:]
    return episodes


def reward(episode: dict[str, Any]) -> float:
    """The episode's reward as verifiers sums it: OpenEnv's rewards of every step."""
    return episode["traces"][0]["rewards"]["openenv_reward"]["score"]


def opening(body: dict[str, Any]) -> dict[str, Any]:
    """The observation verifiers showed the model first in the chat of a request: the
    episode's reset, which names the task and the turn the episode opened at."""
    first = next(m for m in body["messages"] if m["role"] == "user")
    return json.loads(first["content"])["observation"]


def solutions(resets: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Each task's solution by task id, from a local env: the test knows the answers, the
    wire does not carry them."""
    env = gymnasium.make("agent_gym/Search-v0", **SEARCH)
    try:
        solved = {}
        for reset in resets:
            _, info = env.reset(options={"index": reset["index"]})
            solved[info["task_id"]] = info["privileged"]["oracle_actions"]
        return solved
    finally:
        env.close()


def scripted(solved: dict[str, list[str]]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A model that plays each task's solution: the task and the turn come from the first
    observation shown in the chat (a restored episode opens at its depth)."""

    def reply(body: dict[str, Any]) -> dict[str, Any]:
        info = opening(body)["info"]
        turn = info["turn"] + sum(m["role"] == "assistant" for m in body["messages"])
        return {"content": solved[info["task_id"]][turn]}

    return reply


def test_vf_eval_plays_agent_gym_serve_and_restores(search_url: str, tmp_path: Path) -> None:
    opened = [{"index": 0}, {"index": 7}]
    solved = solutions(opened)
    # A mid-episode point (one search done), restored by the server from its state.
    env = gymnasium.make("agent_gym/Search-v0", **SEARCH)
    try:
        _, info = env.reset(options={"index": 3})
        solved[info["task_id"]] = info["privileged"]["oracle_actions"]
        env.step(solved[info["task_id"]][0])
        state = env.unwrapped.save_state().to_json()
    finally:
        env.close()
    model = Behaviour(reply=scripted(solved))
    with ChatServer(model) as chat:
        episodes = vf_eval(tmp_path, search_url, chat.url, [*opened, {"state": state}])
    assert [reward(episode) for episode in episodes] == [1.0, 1.0, 1.0]
    # The restored episode went on from its saved point: the model's first look was there.
    openings = {opening(body)["info"]["task_id"]: opening(body)["info"]["turn"]
                for body in model.requests}
    assert openings == {**dict.fromkeys(solved, 0), info["task_id"]: 1}
    # Nothing the model was sent holds an answer the env keeps back.
    finals = [actions[-1] for actions in solved.values()]
    for body in model.requests:
        sent = json.dumps(body["messages"])
        assert not any(key in sent for key in PRIVILEGED_KEYS)
        assert not any(json.dumps(final)[1:-1] in sent for final in finals)


def test_vf_eval_with_the_embedded_model(tmp_path: Path) -> None:
    """SmolLM2 answers verifiers' prompts within seconds; each episode's reward is what the
    env gives its reply, which it could not copy from the observation."""
    torch = pytest.importorskip("torch")
    from agent_gym_train.backends.models import load_model, load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    model = load_model("smollm2", tokenizer)
    lock = threading.Lock()
    answered: dict[str, str] = {}

    def reply(body: dict[str, Any]) -> dict[str, Any]:
        prompt = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
        with lock, torch.no_grad():
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                out = model.generate(**prompt, do_sample=False,
                                     max_new_tokens=body.get("max_tokens") or 48)
            finally:
                torch.set_num_threads(threads)
        text = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
        answered[opening(body)["info"]["task_id"]] = text
        return {"content": text}

    gsm8k = {"max_turns": 1}
    behaviour = Behaviour(reply=reply)
    with running_server("agent_gym/GSM8K-v0", "--env-arg", "max_turns=1") as url, \
            ChatServer(behaviour) as chat:
        episodes = vf_eval(tmp_path, url, chat.url, [{"index": 0}, {"index": 1}],
                           max_tokens=48)
    env = gymnasium.make("agent_gym/GSM8K-v0", **gsm8k)
    try:
        for index, episode in enumerate(episodes):
            _, info = env.reset(options={"index": index})
            assert info["task_id"] in answered
            _, expected, *_ = env.step(answered[info["task_id"]])
            assert reward(episode) == expected
            sent = json.dumps([body["messages"] for body in behaviour.requests])
            assert json.dumps(info["privileged"]["oracle_actions"][0])[1:-1] not in sent
            assert not any(key in sent for key in PRIVILEGED_KEYS)
    finally:
        env.close()


def test_gem_wrappers_and_vector_env_run_agent_gym_envs() -> None:
    from gem.vector.sync_vector_env import SyncVectorEnv
    from gem.wrappers.episode_tracking_wrapper import EpisodeTrackingWrapper

    from agent_gym.adapters.gem import GemEnv

    env = EpisodeTrackingWrapper(GemEnv("agent_gym/GSM8K-v0", max_turns=2))
    obs, info = env.reset(3)  # GEM's wrappers pass the seed positionally
    assert obs == info["messages"][1]["content"] and info["step_counter"] == 0
    reference = env.unwrapped.privileged["reference_answer"]  # a critic's, not in info
    _, _, terminated, _, info = env.step("no answer yet")
    assert not terminated and info["cumulative_rewards"] == 0.0
    twin = env.unwrapped.spawn(same_state=True)  # GEM's copy-at-this-point, via restore
    for copy in (env, twin):
        obs, reward_, terminated, *_ = copy.step(f"\\boxed{{{reference}}}")
        assert terminated and reward_ == 1.0

    vec = SyncVectorEnv(["agent_gym/GSM8K-v0"] * 2,
                        [lambda: GemEnv("agent_gym/GSM8K-v0", {"index": 0})] * 2)
    observations, _ = vec.reset(seed=0)
    assert observations[0] == observations[1]
    _, rewards, terminated, _, _ = vec.step(["\\boxed{0}", "\\boxed{0}"])
    assert list(terminated) == [True, True] and list(rewards) == [0.0, 0.0]
