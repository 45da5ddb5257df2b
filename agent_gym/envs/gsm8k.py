"""GSM8K: grade-school math word problems, answered in ``\\boxed{}``."""

from __future__ import annotations

from typing import Any

from agent_gym import data
from agent_gym.env.base import Opening, OutcomeEnv, Task, Transition
from agent_gym.envs import math_large
from agent_gym.rewards import DEFAULT_MATH_TIMEOUT, extract_gsm8k_answer, score_math

SYSTEM_PROMPT = (
    "Solve the math problem. Think step by step, then give the final answer as a number "
    "in \\boxed{}."
)
NO_ANSWER = "No final answer found: write the final answer inside \\boxed{}."
EMPTY_ANSWER = "The \\boxed{} answer is empty: write the final answer inside it."


class GSM8KEnv(OutcomeEnv):
    """Math word problems graded by math-verify. There is no tool, so no action protocol:
    every reply is an attempt at the answer.

    Observation: the problem text at reset; after a step, a short note on what was read as
    the answer (the reference is never revealed).
    Action: the assistant's reply; its last ``\\boxed{...}`` is the answer.
    Reward: ``reward_correct`` when math-verify finds the answer equivalent to the
    reference, else ``reward_incorrect``; a reply without a boxed answer, or whose last
    ``\\boxed{}`` is empty, is invalid (``-invalid_penalty``), and on the last turn it also
    earns ``reward_incorrect``.
    Episode end: terminated by a boxed answer; truncated once ``max_turns`` replies went by
    without one. At the default ``max_turns=1`` the task is single-turn: its one reply
    terminates the episode, answered or not (a cut would tell a trainer there was more to come).
    Info: ``answer`` (what was read, or None) and ``correct``; ``no_answer`` on an unanswered
    last step.
    Trust: ``data_path``, ``dataset``, ``split`` (a hub download) and ``math_timeout`` are
    host settings, never taken from a saved state (``agent_gym.make_from_state`` takes them
    from its caller).

    Args:
        data_path: a JSONL/parquet file with ``question`` and ``answer`` (GSM8K format,
            ``#### n`` at the end); overrides ``dataset`` and ``split``.
        dataset: ``"bundled"`` (54 original problems; with ``split``, ``openai/gsm8k`` from
            the hub) or ``"math-large"`` (1000 train / 250 test original problems whose
            splits share no name or object: ``agent_gym.envs.math_large``).
        split: with ``"bundled"``, the ``openai/gsm8k`` split (config ``main``) to load
            from the hub, e.g. ``"test"``; with ``"math-large"``, ``"train"`` or ``"test"``
            (default: both).
        max_turns: replies allowed (1 = single-turn).
        reward_correct, reward_incorrect: the two outcome rewards.
        invalid_penalty: subtracted from the reward of a reply without a boxed answer.
        math_timeout: seconds allowed to math-verify per answer.
    """

    env_id = "agent_gym/GSM8K-v0"
    # Host files, the hub (network) and the grader's time budget: never from a state.
    host_settings = frozenset({"data_path", "dataset", "split", "math_timeout"})

    def __init__(
        self,
        data_path: str | None = None,
        dataset: str = "bundled",
        split: str | None = None,
        max_turns: int = 1,
        reward_correct: float = 1.0,
        reward_incorrect: float = 0.0,
        invalid_penalty: float = 0.0,
        math_timeout: float = DEFAULT_MATH_TIMEOUT,
        render_mode: str | None = None,
    ) -> None:
        super().__init__(
            load_tasks(data_path, dataset, split),
            max_turns=max_turns,
            reward_correct=reward_correct,
            reward_incorrect=reward_incorrect,
            invalid_penalty=invalid_penalty,
            render_mode=render_mode,
        )
        self.math_timeout = math_timeout

    def _start(self, task: Task) -> Opening:
        question = task.payload["question"]
        return Opening(
            observation=question,
            messages=[
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": question},
            ],
            privileged={
                "reference_answer": task.payload["reference"],
                "oracle_actions": [f"The answer is \\boxed{{{task.payload['reference']}}}."],
            },
        )

    def _step(self, action: str) -> Transition:
        score = score_math(action, self.task.payload["reference"], self.math_timeout)
        info: dict[str, Any] = {"answer": score.answer, "correct": score.correct}
        if not score.answer:  # an empty \boxed{} is no answer, like an empty "Answer:"
            message = NO_ANSWER if score.answer is None else EMPTY_ANSWER
            return Transition(message, invalid=True, role="user", info=info)
        return Transition(
            f"Final answer: {score.answer}", self._outcome(score.correct), terminated=True,
            role="user", info=info,
        )


def load_tasks(data_path: str | None, dataset: str, split: str | None) -> list[Task]:
    if data_path is not None:
        records, source = data.load_records(data_path), data_path
    elif dataset == math_large.NAME:
        records, source = math_large.records(split), math_large.NAME
    elif dataset != "bundled":
        raise data.DataError(f"dataset must be 'bundled' or '{math_large.NAME}', got {dataset!r}")
    elif split is not None:
        records, source = data.load_hub("openai/gsm8k", "main", split), "openai/gsm8k"
    else:
        records, source = data.bundled("gsm8k_mini"), "bundled gsm8k_mini"
    data.require_fields(records, ("question", "answer"), source)
    tasks = []
    for index, record in enumerate(records):
        task_id = str(record.get("id", f"gsm8k-{split or 'local'}-{index}"))
        reference = extract_gsm8k_answer(record["answer"])
        tasks.append(Task(task_id, {"question": record["question"], "reference": reference}))
    return tasks
