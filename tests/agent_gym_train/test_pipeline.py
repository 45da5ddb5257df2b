"""Rollouts ahead of the learner (agent_gym_train.run.pipeline) and GRPO with --max-staleness."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pytrio import Datum

from agent_gym_train import grpo
from agent_gym_train.backends.local import LocalServiceClient, LocalTrainingClient
from agent_gym_train.backends.runtime import native_bf16
from agent_gym_train.grpo import degenerate, train
from agent_gym_train.run.clients import VersionedSampler
from agent_gym_train.run.episode import build_datum
from agent_gym_train.run.losses import Objective
from agent_gym_train.run.pipeline import RolloutPipeline, Weights, off_policy_objective
from agent_gym_train.run.run import Run, device_defaults, open_run
from tests.agent_gym_train.test_grpo import toy_args, toy_model  # noqa: F401 (a fixture)


class RecordingTraining:
    """A real local training client that also keeps every datum it trains, in order, and
    can hold an optimizer step until something else happened (``before_update``)."""

    def __init__(self, client: LocalTrainingClient) -> None:
        self.client = client
        self.trained: list[list[Datum]] = []
        self.losses: list[tuple[Any, ...]] = []  # forward_backward's loss and its config
        self.before_update: Callable[[int], None] | None = None

    def forward_backward(self, data: list[Datum], *args: Any, **kwargs: Any) -> Any:
        self.trained.append(list(data))
        self.losses.append(args)
        return self.client.forward_backward(data, *args, **kwargs)

    def forward_backward_custom(self, data: list[Datum], *args: Any, **kwargs: Any) -> Any:
        self.trained.append(list(data))
        return self.client.forward_backward_custom(data, *args, **kwargs)

    def optim_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.before_update is not None:
            self.before_update(len(self.trained) - 1)
        return self.client.optim_step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


class RecordingService(LocalServiceClient):
    """The local backend whose training clients record what they train."""

    def __init__(self, out: Path, sampler_precision: str = "float32") -> None:
        super().__init__(checkpoint_dir=out, device="cpu", threads=1,
                         sampler_precision=sampler_precision)
        self.training: list[RecordingTraining] = []

    def create_full_training_client(self, *args: Any, **kwargs: Any) -> Any:
        self.training.append(RecordingTraining(super().create_full_training_client(
            *args, **kwargs)))
        return self.training[-1]


def assert_same_datums(got: list[Datum], want: list[Datum]) -> None:
    """The same tokens, targets and advantages exactly, and the same sampler logprobs up to
    float noise: rows join the sampler's decode batch as their env steps return, and a
    batch of another shape rounds differently (two runs of the synchronous loop itself
    differ by about 2e-7)."""
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.model_input.to_ints() == b.model_input.to_ints()
        assert sorted(a.loss_fn_inputs) == sorted(b.loss_fn_inputs)
        assert a.loss_fn_inputs["target_tokens"].data == b.loss_fn_inputs["target_tokens"].data
        # advantages: rewards minus their group's mean, the same arithmetic on the same
        # rewards; a tolerance all the same, for a CPU whose numpy sums in another order
        assert a.loss_fn_inputs["advantages"].data == pytest.approx(
            b.loss_fn_inputs["advantages"].data, abs=1e-12)
        assert a.loss_fn_inputs["logprobs"].data == pytest.approx(
            b.loss_fn_inputs["logprobs"].data, abs=1e-5)


def synchronous_grpo(args: grpo.Args, service: RecordingService) -> None:
    """GRPO's loop as it was before rollouts could run ahead: a sampler on the current
    weights, the step's groups, their datums, one update."""
    args = device_defaults(args)
    with open_run(args, args.steps, service) as run:
        config = run.rollout_config(args.group_size)
        for step in run.progress():
            sampler = run.training.save_weights_and_get_sampling_client()
            groups = run.rollouts(step, VersionedSampler(sampler, step),
                                  run.tasks(run.rng(step), args.batch_size), config)
            datums = []
            for group in groups:
                if degenerate(group):
                    continue
                rewards = np.array([episode.reward for episode in group])
                datums += [build_datum(sequence, float(advantage))
                           for episode, advantage in zip(group, rewards - rewards.mean(),
                                                         strict=True)
                           for sequence in episode.sequences]
            run.update(datums)
            run.finish(step, {"step": step, "datums": len(datums)})


def test_staleness_zero_trains_exactly_the_synchronous_datums(
    toy_model: str, tmp_path: Path  # noqa: F811
) -> None:
    settings = {"steps": 4, "batch_size": 3, "group_size": 4}
    pipelined, reference = RecordingService(tmp_path / "a"), RecordingService(tmp_path / "b")
    history = train(toy_args(toy_model, tmp_path / "pipelined", max_staleness=0, **settings),
                    pipelined)
    synchronous_grpo(toy_args(toy_model, tmp_path / "reference", **settings), reference)
    got, want = pipelined.training[0], reference.training[0]
    assert len(got.trained) == len(want.trained) > 0
    for a, b in zip(got.trained, want.trained, strict=True):
        assert_same_datums(a, b)
    for a, b in zip(got.model.parameters(), want.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)  # and so the same weights
    assert [row["staleness"] for row in history] == [0] * 4
    assert [row["sampler_version"] for row in history] == [0, 1, 2, 3]


def test_rollouts_run_while_the_learner_trains_one_version_behind(
    toy_model: str, tmp_path: Path  # noqa: F811
) -> None:
    """With --max-staleness 1, step t+1's rollouts start before step t's update ends: the
    update is held until they started (a synchronous loop would wait here forever)."""
    service = RecordingService(tmp_path / "checkpoints")
    started: dict[int, threading.Event] = {}
    real = Run.rollouts

    def recording(run: Run, step: int, *args: Any, **kwargs: Any) -> Any:
        started.setdefault(step, threading.Event()).set()
        return real(run, step, *args, **kwargs)

    def hold_update(update: int) -> None:
        if update + 1 < 5:  # the last update has no later rollouts to wait for
            assert started.setdefault(update + 1, threading.Event()).wait(timeout=60), (
                f"step {update + 1}'s rollouts did not start while update {update} waited")

    Run.rollouts = recording  # type: ignore[method-assign]
    try:
        original_create = service.create_full_training_client

        def create(*args: Any, **kwargs: Any) -> Any:
            client = original_create(*args, **kwargs)
            client.before_update = hold_update
            return client

        service.create_full_training_client = create  # type: ignore[method-assign]
        history = train(toy_args(toy_model, tmp_path / "run", steps=5, batch_size=3,
                                 group_size=4, max_staleness=1, dynamic_sampling=False,
                                 loss="importance_sampling"), service)
    finally:
        Run.rollouts = real  # type: ignore[method-assign]
    assert [row["sampler_version"] for row in history] == [0, 0, 1, 2, 3]
    assert [row["staleness"] for row in history] == [0, 1, 1, 1, 1]
    trained = [row for row in history if row["datums"]]
    # stale data trains importance_sampling truncated (reported as cispo's clip fraction)
    assert trained and all(row["loss"] is not None for row in trained)


class FakeTraining:
    """Weights as a counter: a sampler is the version it was taken at."""

    def __init__(self) -> None:
        self.version = 0

    def save_weights_and_get_sampling_client(self) -> Any:
        return self.version


def counter_weights(training: FakeTraining) -> Weights:
    """A pipeline's weights on the counter: no checkpoints, no threads to share."""
    return Weights(current=training.save_weights_and_get_sampling_client,
                   saved=lambda path: 0, checkpoints={}, initial=None, threads=None)


@pytest.mark.parametrize(("staleness", "start"), [(0, 0), (1, 0), (2, 0), (2, 3)])
def test_each_step_samples_on_the_newest_weights_its_bound_allows(
    staleness: int, start: int
) -> None:
    training = FakeTraining()
    training.version = start
    collect = lambda step, policy: (step, policy.sampler, policy.version)  # noqa: E731
    steps = range(start, start + 6)
    with closing(RolloutPipeline(collect, steps, counter_weights(training),
                                 staleness)) as rollouts:
        for step in steps:
            sampled = rollouts.take(step)
            # the sampler given is the weights of the version it is said to be
            assert sampled.batch == (step, sampled.version, sampled.version)
            assert sampled.version == max(start, step - staleness)
            assert 0 <= step - sampled.version <= staleness
            training.version += 1  # the update
            rollouts.publish(training.version)


def test_a_failed_rollout_reaches_the_learner_and_the_worker_stops() -> None:
    def collect(step: int, policy: Any) -> int:
        if step == 2:
            raise ValueError("the env broke")
        return step

    training = FakeTraining()
    with closing(RolloutPipeline(collect, range(5), counter_weights(training), 1)) as rollouts:
        assert rollouts.take(0).batch == 0
        training.version = 1
        rollouts.publish(1)
        assert rollouts.take(1).batch == 1
        training.version = 2
        rollouts.publish(2)
        with pytest.raises(RuntimeError, match="rollout worker failed") as raised:
            rollouts.take(2)
        assert isinstance(raised.value.__cause__, ValueError)
    assert rollouts._worker is not None
    rollouts._worker.join(timeout=10)
    assert not rollouts._worker.is_alive()


def test_leaving_early_stops_the_worker_and_gives_the_threads_back() -> None:
    threads = torch.get_num_threads()
    weights = counter_weights(FakeTraining())
    with closing(RolloutPipeline(lambda step, policy: step, range(10), weights, 1)) as rollouts:
        rollouts.take(0)  # then leave without publishing: the worker waits for version 1
    assert rollouts._worker is not None
    rollouts._worker.join(timeout=10)
    assert not rollouts._worker.is_alive()
    assert torch.get_num_threads() == threads


def test_staleness_options_are_checked() -> None:
    with pytest.raises(SystemExit):
        grpo.parse_args(["--max-staleness", "-1"])
    with pytest.raises(SystemExit):
        grpo.parse_args(["--max-staleness", "1", "--max-importance-weight", "0.5"])
    with pytest.raises(ValueError, match="not be negative"):
        RolloutPipeline(lambda step, policy: step, range(1), counter_weights(FakeTraining()), -1)


@pytest.mark.skipif(not native_bf16(torch.device("cpu")), reason="this CPU has no bf16 units")
def test_a_bfloat16_sampler_trains_importance_sampling_truncated(
    toy_model: str, tmp_path: Path  # noqa: F811
) -> None:
    """Rollouts from a bfloat16 copy carry that copy's logprobs, off the learner's by the
    rounding: importance_sampling trains truncated (cispo on [0, 2]) exactly as with stale
    data, while float32 sampling keeps the plain loss."""
    truncated = ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 2.0})
    for precision, want in (("bfloat16", truncated), ("float32", ("importance_sampling", None))):
        service = RecordingService(tmp_path / precision / "checkpoints", precision)
        history = train(toy_args(toy_model, tmp_path / precision / "run", steps=2,
                                 batch_size=3, group_size=4, dynamic_sampling=False,
                                 loss="importance_sampling", sampler_precision=precision),
                        service)
        (training,) = service.training
        assert training.losses and all(loss == want for loss in training.losses), precision
        assert all(row["loss"] is not None for row in history if row["datums"])


@pytest.mark.parametrize(("sampler", "staleness", "precision", "truncated"), [
    ("local", 0, "float32", False), ("local", 1, "float32", True),
    ("local", 0, "bfloat16", True), ("local", 2, "bfloat16", True),
    ("vllm", 0, "float32", True)])
def test_samples_from_other_weights_train_truncated(
    sampler: str, staleness: int, precision: str, truncated: bool
) -> None:
    """Every trainer asks ``off_policy_objective``: data from older weights, a rounded copy
    or an engine trains importance_sampling truncated; exact on-policy data does not, and a
    loss that clips its own ratio is left as it is."""
    plain = Objective("importance_sampling")
    got = off_policy_objective(plain, sampler, precision, staleness, 1.5)
    assert got == (plain.truncated(1.5) if truncated else plain)
    assert (off_policy_objective(Objective("ppo"), sampler, precision, staleness, 1.5)
            == Objective("ppo"))
