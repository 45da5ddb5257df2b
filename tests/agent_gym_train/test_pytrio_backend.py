"""The GRPO trainer against pytrio's real client code, through a test double of the service."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import pytrio.client.sampling
import pytrio.client.training
from pytrio import AdamParams, ModelInput, SamplingParams
from pytrio.errors.base import ValidationError
from pytrio.protocol.actor.events.event import EventType

from agent_gym.eval.config import EvalConfig
from agent_gym.eval.run import evaluate
from agent_gym.render import ChatRenderer
from agent_gym_train.backends import make_service
from agent_gym_train.backends.local import LocalServiceClient
from agent_gym_train.grpo import Args, train
from agent_gym_train.policies import SamplerPolicy
from agent_gym_train.run.episode import build_datum
from agent_gym_train.run.rollout import RolloutConfig, rollout_group
from tests.helpers import grpo_toy
from tests.helpers.pytrio_double import (
    MAX_SAMPLES_PER_REQUEST,
    FakePytrioServer,
    FakeServiceClient,
)

MODEL_ID = "agent-gym/say-digit-tiny"


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakePytrioServer:
    model = grpo_toy.save_tiny_model(tmp_path / "model")
    fake = FakePytrioServer({MODEL_ID: model}, tmp_path / "remote")
    # pytrio fetches tokenizers from a model hub by id; serve the local one instead.
    monkeypatch.setattr(pytrio.client.training, "get_tokenizer", fake.tokenizer)
    monkeypatch.setattr(pytrio.client.sampling, "get_tokenizer", fake.tokenizer)
    return fake


def args_for(backend: str, model: str, out: Path, **overrides: object) -> Args:
    settings: dict = {
        "env_id": grpo_toy.ENV_ID, "backend": backend, "model": model, "lora_rank": 4,
        "steps": 4, "batch_size": 4, "group_size": 4, "learning_rate": 1e-2, "max_turns": 2,
        "max_tokens": 6, "max_trajectory_tokens": 64, "out": str(out), "progress": False,
        "save_every": 2,
    }
    return Args(**(settings | overrides))


@pytest.mark.parametrize("loss", ["importance_sampling", "ppo", "cispo"])
def test_same_trainer_same_numbers_on_pytrio_and_local(
    server: FakePytrioServer, tmp_path: Path, loss: str
) -> None:
    remote = train(args_for("pytrio", MODEL_ID, tmp_path / "remote-run", loss=loss),
                   service=FakeServiceClient(server))
    local = train(args_for("local", server.models[MODEL_ID], tmp_path / "local-run", loss=loss),
                  service=LocalServiceClient(checkpoint_dir=tmp_path / "local-ckpt"))
    assert [r["reward_mean"] for r in remote] == [r["reward_mean"] for r in local]
    assert [r["trained_tokens"] for r in remote] == [r["trained_tokens"] for r in local]
    assert [r["loss"] for r in remote] == pytest.approx([r["loss"] for r in local], abs=1e-6)

    # A fresh sampler from the current weights every step; one update per step.
    assert server.count(EventType.TRAINER_SAVE_WEIGHTS) == 4
    trained_steps = sum(1 for r in remote if r["datums"])
    assert trained_steps and server.count(EventType.TRAINER_OPTIMIZE_STEP) == trained_steps
    assert len(server.groups) == trained_steps  # one forward_backward per logical batch
    assert any(len(group) > 1 for group in server.groups)  # ... which the SDK split
    assert all(len(r.data) <= MAX_SAMPLES_PER_REQUEST for g in server.groups for r in g)
    assert {r.loss.type for g in server.groups for r in g} == {loss}
    if loss in ("ppo", "cispo"):  # cispo's default: a one-sided clip
        assert server.groups[0][0].loss.config == {
            "clip_low_threshold": 0.8 if loss == "ppo" else 0.0,
            "clip_high_threshold": 1.2 if loss == "ppo" else 4.0,
        }
    # The first sampling call of every group asks for all its branches at once.
    assert any(request.num_samples == 4 for request in server.samples)
    assert server.count(EventType.TRAINER_SAVE_STATE) == 2


@pytest.mark.parametrize("options", [
    {"loss": "gspo"},
    {"loss": "gspo", "loss_aggregation": "sequence-mean", "clip_low": 0.05, "clip_high": 0.1},
    {"loss": "ppo", "loss_aggregation": "sequence-mean", "clip_high": 0.28},
])
def test_custom_losses_run_unchanged_on_pytrio(
    server: FakePytrioServer, tmp_path: Path, options: dict
) -> None:
    """Losses pytrio lacks go through its client's own forward_backward_custom: a forward
    for the logprobs, the loss here, a cross_entropy pass weighted by its gradient; the
    local backend's forward_backward_custom gives the same numbers."""
    remote = train(args_for("pytrio", MODEL_ID, tmp_path / "remote-run", **options),
                   service=FakeServiceClient(server))
    local = train(args_for("local", server.models[MODEL_ID], tmp_path / "local-run", **options),
                  service=LocalServiceClient(checkpoint_dir=tmp_path / "local-ckpt"))
    assert [r["reward_mean"] for r in remote] == [r["reward_mean"] for r in local]
    assert [r["loss"] for r in remote] == pytest.approx([r["loss"] for r in local], abs=1e-6)
    assert [r["clip_fraction"] for r in remote if r["datums"]] == pytest.approx(
        [r["clip_fraction"] for r in local if r["datums"]])
    trained_steps = sum(1 for r in remote if r["datums"])
    assert trained_steps and server.count(EventType.TRAINER_OPTIMIZE_STEP) == trained_steps
    # One forward and one forward_backward per trained step (split alike), cross_entropy.
    assert len(server.groups) == 2 * trained_steps
    assert server.count(EventType.TRAINER_FORWARD) == server.count(
        EventType.TRAINER_FORWARD_BACKWARD) > trained_steps
    assert {r.loss.type for g in server.groups for r in g} == {"cross_entropy"}


def test_resume_from_a_remote_checkpoint(server: FakePytrioServer, tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(args_for("pytrio", MODEL_ID, out, steps=2), service=FakeServiceClient(server))
    saved = json.loads((out / "checkpoint.json").read_text())
    assert saved["step"] == 2 and saved["path"].startswith("pytrio://")
    history = train(args_for("pytrio", MODEL_ID, out, steps=4),
                    service=FakeServiceClient(server))
    assert [row["step"] for row in history] == [2, 3]
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in rows] == [0, 1, 2, 3]


def test_rollouts_ahead_of_the_learner_on_pytrio(server: FakePytrioServer, tmp_path: Path) -> None:
    """--max-staleness 1 through pytrio's client: the rollouts of step t+1 are sampled on
    the weights before update t (the same numbers as the local backend's), stale data trains
    truncated importance sampling (pytrio's cispo on [0, 2]), and a continued run samples
    its first step on the earlier checkpoint's weights, as the uninterrupted run did."""
    remote = train(args_for("pytrio", MODEL_ID, tmp_path / "remote-run", max_staleness=1,
                            save_every=1), service=FakeServiceClient(server))
    local = train(args_for("local", server.models[MODEL_ID], tmp_path / "local-run",
                           max_staleness=1, save_every=1),
                  service=LocalServiceClient(checkpoint_dir=tmp_path / "local-ckpt"))
    assert [r["sampler_version"] for r in remote] == [0, 0, 1, 2]
    assert [r["reward_mean"] for r in remote] == [r["reward_mean"] for r in local]
    assert [r["datums_digest"] for r in remote] == [r["datums_digest"] for r in local]
    trained = [group for group in server.groups if group]
    assert trained and {r.loss.type for g in trained for r in g} == {"cispo"}
    assert trained[0][0].loss.config == {"clip_low_threshold": 0.0, "clip_high_threshold": 2.0}

    out = tmp_path / "continued"
    train(args_for("pytrio", MODEL_ID, out, steps=2, max_staleness=1, save_every=1),
          service=FakeServiceClient(server))
    saved = json.loads((out / "checkpoint.json").read_text())
    assert set(saved["earlier"]) == {"1"} and saved["earlier"]["1"].startswith("pytrio://")
    continued = train(args_for("pytrio", MODEL_ID, out, steps=4, max_staleness=1,
                               save_every=1), service=FakeServiceClient(server))
    assert [r["sampler_version"] for r in continued] == [1, 2]
    assert [r["datums_digest"] for r in continued] == [r["datums_digest"] for r in remote[2:]]


def test_rollouts_and_datums_through_pytrio_types(server: FakePytrioServer) -> None:
    service = FakeServiceClient(server)
    training = service.create_lora_training_client(MODEL_ID, rank=8, seed=1)
    sampler = training.save_weights_and_get_sampling_client()
    renderer = ChatRenderer(training.get_tokenizer())
    config = RolloutConfig(group_size=5, max_turns=2, max_tokens=4, max_trajectory_tokens=48)
    episodes = asyncio.run(
        rollout_group(lambda: grpo_toy.SayDigitEnv(), {"index": 2}, sampler, renderer, config)
    )
    datums = [build_datum(e.sequence, float(i) - 2) for i, e in enumerate(episodes)]
    output = training.forward_backward(datums, "importance_sampling").result()
    assert len(output.loss_fn_outputs) == 5
    assert output.metrics["token_count"] == sum(e.sampled_tokens for e in episodes)
    # On-policy: the learner's logprobs equal the sampler's, so every ratio is 1.
    for datum, out in zip(datums, output.loss_fn_outputs, strict=True):
        sampled = datum.loss_fn_inputs["logprobs"].data
        assert out["logprobs"].data == pytest.approx(sampled, abs=1e-4)
    training.optim_step(AdamParams(learning_rate=1e-3)).result()
    prompt = ModelInput.from_ints(list(episodes[0].sequence.tokens))
    logprobs = sampler.compute_logprobs(prompt).result()
    assert logprobs[0] is None and len(logprobs) == len(episodes[0].sequence.tokens)


def test_pytrio_rejects_what_pytrio_rejects(server: FakePytrioServer) -> None:
    service = FakeServiceClient(server)
    with pytest.raises(ValidationError):
        service.create_lora_training_client(MODEL_ID, rank=2)
    training = service.create_lora_training_client(MODEL_ID, rank=4)
    sampler = training.save_weights_and_get_sampling_client()
    with pytest.raises(ValidationError, match="max_tokens"):
        sampler.sample(ModelInput.from_ints([1, 2]), 1, SamplingParams()).result()
    with pytest.raises(ValidationError, match="empty"):
        training.forward_backward([], "importance_sampling").result()


def test_backend_factory() -> None:
    assert isinstance(make_service("local"), LocalServiceClient)
    with pytest.raises(ValueError, match="unknown backend"):
        make_service("elsewhere")


def test_eval_with_a_pytrio_sampler_policy(server: FakePytrioServer, tmp_path: Path) -> None:
    client = FakeServiceClient(server).create_sampling_client(MODEL_ID)
    policy = SamplerPolicy(f"pytrio:{MODEL_ID}", client, max_tokens=4)
    config = EvalConfig(grpo_toy.ENV_ID, policy.name, episodes=3)
    summary = asyncio.run(evaluate(config, policy, tmp_path, progress=False))
    assert summary.episodes == 3 and summary.errors == 0
    assert summary.mean_tokens is not None and 1 <= summary.mean_tokens <= 8
    assert len(server.samples) >= 3  # every reply went through pytrio's client and wire types
