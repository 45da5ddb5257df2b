"""math-large (agent_gym.envs.math_large): 1000 train / 250 test original word problems,
each answer checked by computing it, the splits sharing no name or object."""

from __future__ import annotations

import ast
import re
from collections import Counter

import gymnasium
import pytest

import agent_gym  # noqa: F401  (registers the envs)
from agent_gym.data import DataError
from agent_gym.envs import math_large
from agent_gym.rewards import extract_gsm8k_answer
from tests.envs.test_gsm8k import _evaluate


def test_generation_is_deterministic_and_matches_the_recorded_digest() -> None:
    assert math_large.digest(math_large.generate()) == math_large.DIGEST
    assert math_large.generate() == math_large.generate()  # drawn afresh, not the cached set


def test_sizes_and_every_template_in_the_same_proportion() -> None:
    train, test = math_large.records("train"), math_large.records("test")
    assert (len(train), len(test)) == (1000, 250)
    assert len(math_large.records(None)) == 1250
    assert len({r["id"] for r in train + test}) == 1250
    assert len({r["question"] for r in train + test}) == 1250  # no problem asked twice
    shapes = [Counter(int(r["id"].rsplit("-", 1)[1]) % len(math_large.TEMPLATES) for r in split)
              for split in (train, test)]
    assert shapes == [Counter(dict.fromkeys(range(10), 100)), Counter(dict.fromkeys(range(10), 25))]


def test_every_answer_is_checked_by_computing_it() -> None:
    for record in math_large.records(None):
        computed = _evaluate(ast.parse(record["program"], mode="eval"))
        assert computed == record["value"] > 0, record["id"]  # integers on both sides
        assert extract_gsm8k_answer(record["answer"]) == str(record["value"]), record["id"]


def test_the_splits_share_no_person_and_no_object() -> None:
    def named(split: str) -> set[str]:
        words = {w for r in math_large.records(split)
                 for w in re.findall(r"[A-Za-z]+", r["question"])}
        pools = (*math_large._PEOPLE.values(),
                 *([noun, box] for pool in math_large._GOODS.values() for noun, box in pool),
                 *([item] for pool in math_large._ITEMS.values() for item, *_ in pool))
        as_pool_word = {form: word for pool in pools for word in pool
                        for form in (word, math_large._plural(word))}
        return {as_pool_word[w] for w in words if w in as_pool_word}

    train, test = named("train"), named("test")
    assert train and test
    assert not train & test


def test_gsm8k_and_the_code_interpreter_load_it_by_name() -> None:
    gsm8k = gymnasium.make("agent_gym/GSM8K-v0", dataset="math-large", split="test")
    _, info = gsm8k.reset(options={"index": 0})
    assert info["task_id"] == "math-large-test-0000"
    _, reward, terminated, *_ = gsm8k.step(info["privileged"]["oracle_actions"][0])
    assert (reward, terminated) == (1.0, True)
    gsm8k.close()
    code = gymnasium.make("agent_gym/CodeInterpreter-v0", dataset="math-large", split="train")
    try:
        _, info = code.reset(options={"index": 7})
        for action in info["privileged"]["oracle_actions"]:
            _, reward, terminated, *_ = code.step(action)
        assert (reward, terminated) == (1.0, True)
    finally:
        code.close()


@pytest.mark.parametrize(("env_id", "kwargs", "message"), [
    ("agent_gym/GSM8K-v0", {"dataset": "math-large", "split": "validation"}, "splits"),
    ("agent_gym/GSM8K-v0", {"dataset": "gsm-huge"}, "dataset must be"),
    ("agent_gym/CodeInterpreter-v0", {"dataset": "math-large", "split": "dev"}, "splits"),
])
def test_a_wrong_dataset_or_split_is_one_clear_error(env_id: str, kwargs: dict, message: str
                                                     ) -> None:
    with pytest.raises(DataError, match=message):
        gymnasium.make(env_id, **kwargs)


def test_a_differently_drawn_set_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(math_large, "SEED", math_large.SEED + 1)
    with pytest.raises(DataError, match="different math-large set"):
        math_large.records("test")
