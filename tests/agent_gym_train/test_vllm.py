"""The vLLM sampler against a real vLLM server (``make setup`` builds its venv): token ids
both ways, the learner's weights (merged and reloaded, or its adapter loaded) after every
update sampling next, a server that dies is one line, and no engine process outlives the
run that started it.

One server serves the module, started as a run starts its own for merged weights (the base
model with its head untied, the reload endpoints open) and with LoRA on for the adapter
path."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from pytrio import ModelInput, SamplingParams

from agent_gym.render import ChatRenderer
from agent_gym_train.backends.local import LocalServiceClient
from agent_gym_train.backends.merged import save_engine_model
from agent_gym_train.backends.models import load_model, load_tokenizer, smollm2_dir
from agent_gym_train.backends.vllm import (
    BASE_WEIGHTS,
    Engine,
    EngineConfig,
    EngineError,
    MergedWeights,
    Scratch,
    VLLMSampler,
    VLLMWeights,
    vllm_python,
)
from agent_gym_train.grpo import Args, train
from agent_gym_train.run.episode import IGNORE_TARGET

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("vllm"),  # one worker, one server for the module (--dist loadgroup)
    pytest.mark.skipif(not vllm_python().is_file(),
                       reason=f"no vLLM venv at {vllm_python()} (make setup builds it)"),
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    folder = tmp_path_factory.mktemp("vllm")
    base = save_engine_model(load_model("smollm2"), smollm2_dir(), folder / BASE_WEIGHTS)
    running = Engine.start(EngineConfig(
        model_dir=base, served_name="smollm2", max_lora_rank=32, max_loras=2,
        log=folder / "vllm.log", threads=1, reloads=True))
    yield running
    running.close()


def test_prompts_and_completions_travel_as_token_ids(engine: Engine, tmp_path: Path) -> None:
    tokenizer = load_tokenizer("smollm2")
    renderer = ChatRenderer(tokenizer)
    sampler = VLLMWeights(engine, tokenizer, tmp_path, keep=1).base()
    prompt = renderer.prompt([{"role": "user", "content": "Name a colour."}])
    reply = asyncio.run(sampler.sample_async(
        ModelInput.from_ints(prompt), num_samples=3,
        sampling_params=SamplingParams(max_tokens=12, temperature=1.0,
                                       stop=sorted(renderer.stop_tokens))))
    assert len(reply.sequences) == 3
    for sequence in reply.sequences:
        assert 0 < len(sequence.tokens) == len(sequence.logprobs) <= 12
        assert all(lp <= 0 for lp in sequence.logprobs)
        if sequence.stop_reason == "stop":  # the stop token is kept, as pytrio keeps it
            assert sequence.tokens[-1] in renderer.stop_tokens
    # the engine's score of its own sample agrees with what it reported while sampling
    first = list(reply.sequences[0].tokens)
    scored = asyncio.run(sampler.compute_logprobs_async(ModelInput.from_ints(prompt + first)))
    assert scored[0] is None and len(scored) == len(prompt) + len(first)
    assert scored[len(prompt):] == pytest.approx(list(reply.sequences[0].logprobs), abs=0.05)


# Alone, with the module's server start that its timeout counts when it runs first on its
# worker, it took 189 s on 2 cores; beside the rest of the suite that passed 300 s once
@pytest.mark.timeout(600)
def test_the_engine_samples_the_learners_distribution(engine: Engine, tmp_path: Path) -> None:
    """At temperature 1 the engine's samples follow the learner's softmax: a server default
    that cut the tail (top-k, top-p), tempered or went greedy, or samples that shared their
    random draws, would bias GRPO's groups while every sampled token's logprob still agreed."""
    tokenizer = load_tokenizer("smollm2")
    prompt = tokenizer("My favourite colour is")["input_ids"]  # a next token of high entropy
    with torch.no_grad():
        logits = load_model("smollm2")(torch.tensor([prompt])).logits[0, -1].float()
    top = torch.softmax(logits, -1).topk(20)
    expected = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    tail = 1 - sum(expected.values())
    assert max(expected.values()) < 0.2 and tail > 0.3  # so that each check below can fail
    sampler = VLLMWeights(engine, tokenizer, tmp_path, keep=1).base()
    n = 1000
    reply = asyncio.run(sampler.sample_async(
        ModelInput.from_ints(prompt), num_samples=n,
        sampling_params=SamplingParams(max_tokens=1, temperature=1.0)))
    drawn = Counter(sequence.tokens[0] for sequence in reply.sequences)

    def close(share: float, p: float) -> bool:  # 4 standard errors, plus bf16's rounding
        return abs(share - p) <= 4 * (p * (1 - p) / n) ** 0.5 + 0.01

    for token, p in list(expected.items())[:5]:
        assert close(drawn[token] / n, p), (tokenizer.decode([token]), drawn[token], p)
    outside = sum(count for token, count in drawn.items() if token not in expected)
    assert close(outside / n, tail), (outside, tail)


def test_grpo_steps_train_on_the_engines_tokens_and_the_new_adapter_samples_next(
    engine: Engine, tmp_path: Path
) -> None:
    args = Args(env_id="agent_gym/Search-v0", env_kwargs={"split": "train"},
                sampler="vllm", vllm_url=engine.url, vllm_weights="adapter",
                steps=2, batch_size=2, group_size=2,
                max_tokens=24, max_turns=2, learning_rate=1e-3, threads=1,
                out=str(tmp_path / "run"), progress=False)
    before = {m["id"] for m in json.loads(_get(engine, "/v1/models"))["data"]}
    history = train(args)
    assert [row["sampler_version"] for row in history] == [0, 1]
    for row in history:
        if row["datums"]:
            # the learner re-scores the engine's tokens: close, not equal (bf16, kernels)
            assert 0 <= row["logprob_gap_abs_mean"] < 0.5
    # each step's sampler was a freshly published adapter; only the newest stays loaded
    loaded = {m["id"] for m in json.loads(_get(engine, "/v1/models"))["data"]} - before
    assert len(loaded) == 1 and next(iter(loaded)).endswith("-1")
    # every metrics line says how much of its step's prompts the engine's prefix cache held
    lines = [json.loads(line) for line in
             (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    assert all(0 <= line["engine_prefix_hit_rate"] <= 1 for line in lines)


def test_a_datum_holds_the_sampled_tokens_and_their_engine_logprobs(
    engine: Engine, tmp_path: Path
) -> None:
    """One rollout group through the run's own path, its datums built as GRPO builds them."""
    from agent_gym_train.run.clients import VersionedSampler
    from agent_gym_train.run.episode import build_datum
    from agent_gym_train.run.run import device_defaults, open_run

    args = device_defaults(Args(env_id="agent_gym/Search-v0", env_kwargs={"split": "train"},
                                sampler="vllm", vllm_url=engine.url, steps=1, batch_size=1,
                                group_size=2, max_tokens=16, max_turns=2, threads=1,
                                out=str(tmp_path / "run"), progress=False))
    with open_run(args, 1) as run:
        sampler = run.training.save_weights_and_get_sampling_client()
        groups = run.rollouts(0, VersionedSampler(sampler, 0), run.tasks(run.rng(0), 1),
                              run.rollout_config(2))
    for episode in groups[0]:
        sequence = episode.sequence
        datum = build_datum(sequence, 1.0)
        targets = datum.loss_fn_inputs["target_tokens"].data
        logprobs = datum.loss_fn_inputs["logprobs"].data
        trained = [i for i, t in enumerate(targets) if t != IGNORE_TARGET]
        # every sampled token and only those train, each with the logprob the engine gave
        assert trained == [p - 1 for span in sequence.spans for p in range(span.start, span.end)]
        assert [targets[i] for i in trained] == [sequence.tokens[i + 1] for i in trained]
        # the datum stores logprobs as float32: equal to the engine's up to that rounding
        assert [logprobs[i] for i in trained] == pytest.approx(
            [lp for span in sequence.spans for lp in span.logprobs], rel=1e-6, abs=1e-6)
        assert episode.version == 0


def test_merged_weights_are_the_learners_and_each_request_runs_on_its_own_version(
    engine: Engine, tmp_path: Path
) -> None:
    """Two versions on one engine that holds one at a time: each request is scored on its
    own sampler's weights however they interleave, and those are the learner's."""
    tokenizer = load_tokenizer("smollm2")
    learner = LocalServiceClient(checkpoint_dir=tmp_path / "ck", device="cpu", threads=1)
    client = learner.create_lora_training_client("smollm2", rank=8, seed=0)
    with torch.no_grad():  # an update large enough to tell the versions apart, head included
        draw = torch.Generator().manual_seed(0)
        for name, parameter in client.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=draw) * 0.02)
    save_engine_model(load_model("smollm2"), smollm2_dir(), tmp_path / BASE_WEIGHTS)
    weights = MergedWeights(engine, tokenizer, tmp_path, keep=2, loaded=None)
    base, trained = weights.base(), weights.publish(weights.saver(client))
    prompt = ModelInput.from_ints(ChatRenderer(tokenizer).prompt(
        [{"role": "user", "content": "Name a colour."}]) + tokenizer.encode("Blue, like the sea"))

    async def twice(sampler: VLLMSampler) -> list[list[float | None]]:
        # One request of a sampler at a time: this server also serves LoRA (for the adapter
        # test), and the CPU wheel's LoRA logits fail on two prompt-logprob requests in one
        # batch; a server of merged weights alone runs without LoRA.
        return [await sampler.compute_logprobs_async(prompt) for _ in range(2)]

    async def interleaved() -> list[list[list[float | None]]]:
        return list(await asyncio.gather(twice(base), twice(trained)))

    (on_base, base_again), (on_trained, trained_again) = asyncio.run(interleaved())
    assert weights.reloads >= 2  # the engine switched between the two versions
    assert on_base[1:] == pytest.approx(base_again[1:], abs=1e-3)
    assert on_trained[1:] == pytest.approx(trained_again[1:], abs=1e-3)
    moved = max(abs(a - b) for a, b in zip(on_base[1:], on_trained[1:], strict=True))
    learner_scores = client.save_weights_and_get_sampling_client().compute_logprobs(
        prompt).result()
    gap = [abs(a - b) for a, b in zip(on_trained[1:], learner_scores[1:], strict=True)]
    # the engine's bfloat16 against the learner's float32: far closer than the two versions
    assert sum(gap) / len(gap) < 0.1 < moved


def test_full_fine_tuning_reaches_the_engine_as_merged_weights(
    engine: Engine, tmp_path: Path
) -> None:
    args = Args(env_id="agent_gym/Search-v0", env_kwargs={"split": "train"},
                sampler="vllm", vllm_url=engine.url, lora_rank=0, steps=2, batch_size=1,
                group_size=2, max_tokens=16, max_turns=2, threads=1,
                out=str(tmp_path / "run"), progress=False)
    history = train(args)
    assert [row["sampler_version"] for row in history] == [0, 1]
    assert (tmp_path / "run" / "engine" / "v1" / "model.safetensors").is_file()


def test_a_server_that_dies_is_one_line(engine: Engine, tmp_path: Path) -> None:
    """The module's last use of its server: killed, every later request is one line."""
    sampler = VLLMWeights(engine, load_tokenizer("smollm2"), tmp_path, keep=1).base()
    assert engine.process is not None
    os.killpg(engine.process.pid, signal.SIGKILL)
    engine.process.wait(timeout=30)
    with pytest.raises(EngineError, match=r"^the vLLM server exited with status -9") as caught:
        asyncio.run(sampler.sample_async(ModelInput.from_ints([1, 2, 3])))
    assert "\n" not in str(caught.value)


def test_an_eval_on_a_checkpoint_samples_from_vllm_and_leaves_nothing_when_killed(
    tmp_path: Path,
) -> None:
    """``agent-gym eval --policy vllm:smollm2@CHECKPOINT`` plays episodes on a server it
    starts from the checkpoint's weights; SIGKILLed mid-eval, the kernel's parent-death
    signal stops the server, and the server its workers; the model written for the server
    goes with the next run's scratch folder."""
    learner = LocalServiceClient(checkpoint_dir=tmp_path / "ck", device="cpu", threads=1)
    checkpoint = learner.create_lora_training_client("smollm2", rank=8).save_state(
        "c").result().path
    out = tmp_path / "eval"
    temporary = Path(tempfile.gettempdir())
    before = set(temporary.glob(f"{Scratch.PREFIX}*"))
    run = subprocess.Popen(
        [sys.executable, "-m", "agent_gym.cli", "eval", "agent_gym/Search-v0", "--policy",
         f"vllm:smollm2@{checkpoint}", "--episodes", "18", "--env-arg", "split=test",
         "--max-tokens", "24", "--concurrency", "1", "--quiet", "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and run.poll() is None and not (
                (out / "episodes.jsonl").is_file() and (out / "episodes.jsonl").read_text()):
            time.sleep(1)
        servers = _members_of_children(run.pid)
        assert run.poll() is None and servers, "the eval ended or never started its server"
        played = json.loads((out / "episodes.jsonl").read_text().splitlines()[0])
        assert played["completion_tokens"] > 0
    finally:
        run.kill()
        run.wait(timeout=30)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and any(_members(group) for group in servers):
        time.sleep(1)
    assert [_members(group) for group in servers] == [[] for _ in servers]
    left = set(temporary.glob(f"{Scratch.PREFIX}*")) - before
    assert any((folder / "model").is_dir() for folder in left)
    Scratch.make().remove()
    assert not any(folder.exists() for folder in left)


def _members_of_children(parent: int) -> list[int]:
    """The process groups of ``parent``'s children (each server leads its own)."""
    groups = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == parent and int(fields[2]) == int(entry.name):
                    groups.append(int(entry.name))
    return groups


def _members(group: int) -> list[int]:
    """Live processes of a process group (zombies of an exited parent are not running)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == group:
            found.append(int(entry.name))
    return found


def _get(engine: Engine, path: str) -> str:
    import httpx

    return httpx.get(engine.url + path, timeout=30).text
