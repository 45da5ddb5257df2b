import ast
import json
import operator
from pathlib import Path

import gymnasium
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agent_gym.data import DataError, bundled
from agent_gym.rewards import extract_gsm8k_answer

_OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.USub: operator.neg,
}


def _evaluate(node: ast.AST) -> float:
    """Arithmetic only: the bundled problems carry their solution as an expression."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp):
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp):
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unexpected syntax {ast.dump(node)}")


def test_bundled_answers_are_checked_by_computing_them() -> None:
    records = bundled("gsm8k_mini")
    assert len(records) >= 50
    assert len({r["id"] for r in records}) == len(records)
    for record in records:
        computed = _evaluate(ast.parse(record["program"], mode="eval"))
        assert float(extract_gsm8k_answer(record["answer"])) == pytest.approx(computed), record["id"]


def test_correct_boxed_answer_earns_reward_one_and_wrong_earns_zero() -> None:
    env = gymnasium.make("agent_gym/GSM8K-v0")
    _, info = env.reset(seed=0)
    reference = info["privileged"]["reference_answer"]
    _, reward, terminated, _, step_info = env.step(f"Step by step... \\boxed{{{reference}}}")
    assert (reward, terminated, step_info["correct"]) == (1.0, True, True)
    env.reset(seed=0)
    assert env.step(f"\\boxed{{{reference}1}}")[1] == 0.0


def test_every_bundled_task_accepts_its_reference() -> None:
    env = gymnasium.make("agent_gym/GSM8K-v0")
    for index in range(len(env.unwrapped.tasks)):
        _, info = env.reset(options={"index": index})
        reward = env.step(f"\\boxed{{{info['privileged']['reference_answer']}}}")[1]
        assert reward == 1.0, info["task_id"]


def test_configurable_rewards() -> None:
    env = gymnasium.make("agent_gym/GSM8K-v0", reward_correct=1.0, reward_incorrect=-1.0)
    env.reset(seed=1)
    assert env.step("\\boxed{-12345}")[1] == -1.0


def test_local_jsonl_and_parquet(tmp_path: Path) -> None:
    rows = [{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"},
            {"question": "What is 10 / 4?", "answer": "#### 2.5"}]
    jsonl = tmp_path / "tiny.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    parquet = tmp_path / "tiny.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    for path in (jsonl, parquet):
        env = gymnasium.make("agent_gym/GSM8K-v0", data_path=str(path))
        _, info = env.reset(options={"index": 1})
        assert info["task_id"] == "gsm8k-local-1"
        assert env.step("\\boxed{\\frac{5}{2}}")[1] == 1.0


def test_bad_data_files_give_clear_errors(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "x", "answer": "#### 1"}\n{not json\n')
    with pytest.raises(DataError, match=r"broken\.jsonl:2"):
        gymnasium.make("agent_gym/GSM8K-v0", data_path=str(broken))
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"question": "x"}\n')
    with pytest.raises(DataError, match="lacks the field"):
        gymnasium.make("agent_gym/GSM8K-v0", data_path=str(missing))
    with pytest.raises(DataError, match="does not exist"):
        gymnasium.make("agent_gym/GSM8K-v0", data_path=str(tmp_path / "nope.jsonl"))
