"""SFT: demonstrations played through real envs, the cross_entropy loss by hand, and a
real run that raises the likelihood of held-out demonstrations."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import json
from pathlib import Path

import gymnasium
import pytest
import torch

from agent_gym.eval.config import EvalConfig
from agent_gym.eval.policies import make_policy
from agent_gym.eval.run import evaluate
from agent_gym.render import ChatRenderer
from agent_gym_train.backends import IGNORE_TARGET
from agent_gym_train.backends.local import LocalServiceClient
from agent_gym_train.run.episode import cross_entropy_datum
from agent_gym_train.sft import (
    Args,
    Demonstration,
    demonstration_datums,
    oracle_demonstrations,
    parse_args,
    play_demonstration,
    run_demonstrations,
    train,
)
from tests.helpers.chat_templates import smollm2_tokenizer

SEARCH = functools.partial(gymnasium.make, "agent_gym/Search-v0")
GSM8K = functools.partial(gymnasium.make, "agent_gym/GSM8K-v0")
DATASETS = Path(__file__).resolve().parents[2] / "agent_gym" / "datasets"


def split_file(tmp_path: Path, name: str, source: str, rows: slice) -> str:
    """Some of a bundled data set's records as their own JSONL file."""
    lines = (DATASETS / source).read_text(encoding="utf-8").splitlines()[rows]
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_a_multi_turn_demonstration_trains_only_its_actions() -> None:
    renderer = ChatRenderer(smollm2_tokenizer())
    env = SEARCH()
    try:
        [demo] = oracle_demonstrations(SEARCH)[:1]
        assert len(demo.actions) == 2  # a search, then the answer
        sequence, reward = play_demonstration(env, renderer, demo)
        _, info = env.reset(options=dict(demo.reset_options))
    finally:
        env.close()
    assert reward == 1.0 and len(sequence.spans) == 2
    first, second = sequence.completion(0), sequence.completion(1)
    # Token-continuous: the first action follows the opening prompt, the second follows the
    # first and the env's observation, and the sequence ends with the second action.
    opening = renderer.prompt(info["messages"], info.get("tools"))
    assert sequence.tokens[: sequence.spans[0].start] == tuple(opening)
    assert sequence.spans[1].start > sequence.spans[0].end
    assert sequence.spans[1].end == len(sequence.tokens)
    datum = cross_entropy_datum(sequence)
    assert set(datum.loss_fn_inputs) == {"target_tokens", "weights"}
    targets = datum.loss_fn_inputs["target_tokens"].data
    weights = datum.loss_fn_inputs["weights"].data
    trained = [t for t, w in zip(targets, weights, strict=True) if w]
    assert trained == [*first, *second]
    assert all((t == IGNORE_TARGET) == (w == 0.0) for t, w in zip(targets, weights, strict=True))
    # Each action ends with the template's stop token: the model learns to end its turn.
    assert first[-1] in renderer.stop_tokens
    assert renderer.completion_text(list(second)) == demo.actions[1]


def test_a_mixtures_oracle_demonstrations_play_in_their_members() -> None:
    make = functools.partial(gymnasium.make, "agent_gym/Mixture-v0", members=[
        {"env_id": "agent_gym/GSM8K-v0"}, {"env_id": "agent_gym/Search-v0"}])
    renderer, env = ChatRenderer(smollm2_tokenizer()), make()
    try:
        demos = oracle_demonstrations(make)
        assert len(demos) == env.unwrapped.num_tasks
        n = env.unwrapped.parts[0].num_tasks
        for demo in (demos[0], demos[n]):  # one of each member
            assert play_demonstration(env, renderer, demo)[1] == 1.0
    finally:
        env.close()


def test_unrewarded_and_overlong_demonstrations_are_dropped() -> None:
    renderer = ChatRenderer(smollm2_tokenizer())
    [good] = oracle_demonstrations(GSM8K)[:1]
    wrong = Demonstration(good.reset_options, ["The answer is \\boxed{-1}."], "hand-made")
    datums, dropped = demonstration_datums(GSM8K, renderer, [good, wrong], max_length=4096)
    assert len(datums) == 1 and dropped == {"unrewarded": 1, "too_long": 0}
    datums, dropped = demonstration_datums(GSM8K, renderer, [good], max_length=10)
    assert not datums and dropped == {"unrewarded": 0, "too_long": 1}


def test_demonstrations_from_an_eval_run_are_its_successes(tmp_path: Path) -> None:
    config = EvalConfig("agent_gym/GSM8K-v0", "oracle", episodes=3)
    asyncio.run(evaluate(config, make_policy("oracle"), tmp_path / "run", progress=False))
    episodes = tmp_path / "run" / "episodes.jsonl"
    failed = json.loads(episodes.read_text().splitlines()[0]) | {"success": False, "episode": 9}
    with episodes.open("a") as handle:
        handle.write(json.dumps(failed) + "\n")
    demos = run_demonstrations(tmp_path / "run", "agent_gym/GSM8K-v0")
    assert len(demos) == 3 and not any(d.source.endswith("#9") for d in demos)
    assert all(d.actions and d.actions[0].startswith("The answer is") for d in demos)
    with pytest.raises(ValueError, match="GSM8K-v0 episodes, not agent_gym/Search-v0"):
        run_demonstrations(tmp_path / "run", "agent_gym/Search-v0")


def test_demonstrations_skip_what_a_damaged_run_cannot_say_and_name_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = EvalConfig("agent_gym/GSM8K-v0", "oracle", episodes=3)
    asyncio.run(evaluate(config, make_policy("oracle"), tmp_path / "run", progress=False))
    episodes = tmp_path / "run" / "episodes.jsonl"
    good = episodes.read_bytes()
    episodes.write_bytes(b"\xff not utf-8\n[]\n" + good + b'{"episode": 7, "rew')
    demos = run_demonstrations(tmp_path / "run", "agent_gym/GSM8K-v0")
    assert len(demos) == 3
    err = capsys.readouterr().err
    assert "line 1 is not UTF-8" in err and "line 2 is not a JSON object" in err
    assert "line 6 is cut off" in err
    assert episodes.read_bytes().startswith(b"\xff")  # read, never changed


def test_cross_entropy_on_demonstrations_matches_hand_computation(tmp_path: Path) -> None:
    """pytrio's cross_entropy: loss_mean = -sum(w * log p) / #(target != -100 and w != 0),
    and its gradient, on two real demonstration datums (one with a weight of 2)."""
    renderer = ChatRenderer(smollm2_tokenizer())
    datums, _ = demonstration_datums(GSM8K, renderer, oracle_demonstrations(GSM8K)[:2], 4096)
    weights = list(datums[1].loss_fn_inputs["weights"].data)
    weights[weights.index(1.0)] = 2.0
    datums[1].loss_fn_inputs["weights"].data = weights
    training = LocalServiceClient(checkpoint_dir=tmp_path).create_full_training_client("tiny:5")
    reference = copy.deepcopy(training.model).double()
    output = training.forward_backward(datums, "cross_entropy").result()

    total = torch.zeros((), dtype=torch.float64)
    counted = 0
    for datum in datums:
        ids = datum.model_input.to_ints()
        logp = torch.log_softmax(reference(input_ids=torch.tensor([ids])).logits[0], dim=-1)
        for i, (target, weight) in enumerate(zip(datum.loss_fn_inputs["target_tokens"].data,
                                                 datum.loss_fn_inputs["weights"].data,
                                                 strict=True)):
            if target != IGNORE_TARGET and weight:
                total = total - weight * logp[i, target]
                counted += 1
    expected = total / counted
    expected.backward()
    assert output.metrics["token_count"] == counted == 22  # two replies of 10 tokens + stop
    assert output.metrics["loss_mean"] == pytest.approx(float(expected.detach()), rel=1e-5)
    hand = dict(reference.named_parameters())
    for name, parameter in training.model.named_parameters():
        torch.testing.assert_close(parameter.grad.double(), hand[name].grad, rtol=1e-3,
                                   atol=1e-7)


def test_sft_raises_the_likelihood_of_heldout_demonstrations(tmp_path: Path) -> None:
    """The embedded SmolLM2 on GSM8K-v0: two updates on four tasks' oracle demonstrations
    lower the NLL of four other tasks' demonstrations (never trained on) by a wide margin.
    The answers differ per task, so what transfers is the reply's form, which is what the
    base model lacks (it never writes a boxed answer unprompted)."""
    args = Args(env_id="agent_gym/GSM8K-v0",
                env_kwargs={"data_path": split_file(tmp_path, "train.jsonl",
                                                    "gsm8k_mini.jsonl", slice(0, 4))},
                heldout_env_kwargs={"data_path": split_file(
                    tmp_path, "test.jsonl", "gsm8k_mini.jsonl", slice(40, 42))},
                epochs=2, batch_size=4, learning_rate=2e-3, lora_rank=8,
                out=str(tmp_path / "run"), progress=False)
    assert_heldout_nll_falls(train(args), tmp_path / "run", demonstrations=4, heldout=2)


def assert_heldout_nll_falls(rows: list[dict], run: Path, demonstrations: int,
                             heldout: int) -> None:
    """Two updates on every demonstration cut the held-out NLL per token by over 40%."""
    before, after = rows[0]["heldout_nll_before"], rows[-1]["heldout_nll"]
    assert after < 0.6 * before, (before, after)
    assert json.loads((run / "demonstrations.json").read_text()) == {
        "found": demonstrations, "used": demonstrations,
        "dropped": {"unrewarded": 0, "too_long": 0}, "heldout": heldout, "steps": 2}

def test_sft_refuses_another_loss() -> None:
    assert parse_args([]).loss == "cross_entropy"
    with pytest.raises(SystemExit):
        parse_args(["--loss", "importance_sampling"])  # SFT's objective is its own


def test_sft_continues_a_run_into_the_same_out(tmp_path: Path) -> None:
    """A second invocation with more epochs into the same --out continues from the
    checkpoint: it runs only the new steps, and scores the held-out set before only once."""
    train_path = split_file(tmp_path, "train.jsonl", "gsm8k_mini.jsonl", slice(0, 4))
    heldout_path = split_file(tmp_path, "test.jsonl", "gsm8k_mini.jsonl", slice(40, 41))
    args = Args(env_id="agent_gym/GSM8K-v0", env_kwargs={"data_path": train_path},
                heldout_env_kwargs={"data_path": heldout_path}, model="tiny", lora_rank=0,
                epochs=1, batch_size=2, save_every=1, out=str(tmp_path / "run"),
                progress=False)
    first = train(args)
    assert [row["step"] for row in first] == [0, 1] and "heldout_nll_before" in first[0]
    second = train(dataclasses.replace(args, epochs=2))
    assert [row["step"] for row in second] == [2, 3]
    assert not any("heldout_nll_before" in row for row in second)
    assert "heldout_nll" in second[-1]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3]


def test_sft_on_search_train_split_raises_the_likelihood_of_its_test_split(
    tmp_path: Path,
) -> None:
    """The embedded SmolLM2 on Search-v0, split by the env's own ``split`` field: two updates
    on the train-split oracle episodes of the first four bundled questions lower the NLL
    per token of the test-split one (another town, never trained on) by a wide margin. What
    transfers is the procedure (a search call for the entity, then a short tagged answer)."""
    data = split_file(tmp_path, "qa.jsonl", "search_qa.jsonl", slice(0, 4))
    args = Args(env_id="agent_gym/Search-v0", env_kwargs={"data_path": data, "split": "train"},
                heldout_env_kwargs={"data_path": data, "split": "test"},
                epochs=2, batch_size=3, learning_rate=2e-3, lora_rank=8,
                out=str(tmp_path / "run"), progress=False)
    assert_heldout_nll_falls(train(args), tmp_path / "run", demonstrations=3, heldout=1)
    trained = {t.task_id for t in SEARCH(data_path=data, split="train").unwrapped.tasks}
    held = {t.task_id for t in SEARCH(data_path=data, split="test").unwrapped.tasks}
    assert held == {"q003"} and not trained & held
