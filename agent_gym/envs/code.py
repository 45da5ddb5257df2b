"""CodeInterpreter-v0: ReTool-style math with a Python interpreter in a bubblewrap sandbox."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent_gym import data
from agent_gym.actions.protocols import FencedCodeProtocol, ToolCallProtocol, choose_protocol
from agent_gym.actions.tools import ToolCallError, ToolSpec
from agent_gym.env.base import BackendFailure, Opening, OutcomeEnv, Task, Transition
from agent_gym.envs import math_large
from agent_gym.rewards import DEFAULT_MATH_TIMEOUT, score_math
from agent_gym.sandbox import ExecResult, Limits, SandboxError, open_sandbox

CODE_TOOL = ToolSpec(
    name="code_interpreter",
    description=(
        "Run Python 3 code in a sandbox without network access and return what it prints "
        "(stdout, then stderr). The value of a final expression is shown, as in a notebook."
    ),
    parameters={
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the Python code to run"}},
        "required": ["code"],
        "additionalProperties": False,
    },
)
PROTOCOLS = (ToolCallProtocol(CODE_TOOL, "code"), FencedCodeProtocol("python", "interpreter"))
_STATE = {
    "stateful": "Variables, functions and imports persist from one run to the next.",
    "stateless": "Every run starts a fresh interpreter: nothing persists between runs.",
}
PROMPT = (
    "Solve the math problem. You can run Python code, once per message and at most {n} "
    "times in all. {how} {state} When you are done, reply without running code and put the "
    "final answer in \\boxed{{}}."
)
NO_ANSWER = "No code and no final answer found: run code, or give the final answer in \\boxed{}."
EMPTY_ANSWER = "The \\boxed{} answer is empty: write the final answer inside it."
# The DAPO-Math-17k prompt wraps each problem in an instruction for a different answer
# format ("Answer: ..."); the env asks for \boxed{}, so the problem is cut out of it.
_DAPO_HEAD = "Solve the following math problem step by step."
_DAPO_TAIL = "\n\nRemember to put your answer on its own line after"
HUB_SETS: dict[str, tuple[str, tuple[str | None, ...], str]] = {
    "dapo": ("BytedTsinghua-SIA/DAPO-Math-17k", (None,), "train"),
    "aime2025": ("opencompass/AIME2025", ("AIME2025-I", "AIME2025-II"), "test"),
}


class CodeInterpreterEnv(OutcomeEnv):
    """Multi-turn math with a sandboxed Python tool; the answer goes in ``\\boxed{}``.

    Observation: the problem at reset; after a code call, its output (stdout, stderr, or
    the timeout / crash note), sanitised and capped at ``max_obs_chars`` and wrapped by the
    protocol; after an answer, what was read as the answer.
    Action: the assistant's reply. With ``protocol="tool"`` code runs through a
    ``code_interpreter`` tool call (Hermes JSON or Qwen3 XML), answered by a ``tool``
    message; with ``protocol="fenced"`` through a ```python block ending the message, its
    output in ``<interpreter>`` tags in a ``user`` message. A reply without a call is the
    final answer: its last ``\\boxed{}`` is graded (an empty one is no answer).
    Reward: ``reward_correct`` when math-verify finds the answer equal to the reference,
    ``reward_incorrect`` when it does not, and ``reward_incorrect`` on the last step when
    the turns run out without an answer (so +1/-1 and 1/0 are both a matter of
    arguments). An invalid step (malformed call, no call and no answer, code budget spent)
    earns ``-invalid_penalty``; a sandbox failure is not the agent's fault and costs
    nothing (no penalty, no code call spent; in stateful mode the interpreter starts afresh).
    Episode end: terminated by a boxed answer; truncated after ``max_turns`` replies.
    Info: after a run ``exec_status``, ``exec_error``, ``state_lost``, ``exec_seconds``,
    ``code_calls`` and ``isolation`` (with ``sandbox_warning`` when not isolated, and
    ``sandbox_error`` when the sandbox failed); after an answer ``answer``, ``correct`` and
    ``code_calls``; ``no_answer`` on a truncated last step.
    Save/restore: the base class replays every reply on a fresh sandbox, so cells are
    re-executed in order and each output is checked against its saved digest. Cells whose
    output depends on time or on OS randomness will not replay identically (``random``
    is seeded and ``PYTHONHASHSEED`` fixed in the sandbox). A sandbox that failed (did not
    start, broke its protocol) is recorded in the state with its message, and a restore
    reproduces that failure at that step instead of running the cell on a sandbox that works
    again (``TextEnv._outside``).
    Trust: ``isolation``, ``timeout``, ``memory_mb``, ``pool_size``, ``math_timeout`` and the
    data sources (``data_path``, ``dataset``, ``split``) are host settings: a state never
    chooses them (``agent_gym.make_from_state`` takes them from its caller only).

    Args:
        data_path: a JSONL/parquet file of problems: ``problem``/``question``/``prompt``
            (a string or a chat list) with ``answer`` or ``reward_model.ground_truth``
            (DAPO-Math-17k and AIME files load as they are); overrides ``dataset``.
        dataset: ``"bundled"`` (original problems where computing helps),
            ``"math-large"`` (1000 train / 250 test original word problems:
            ``agent_gym.envs.math_large``), ``"dapo"`` (DAPO-Math-17k) or ``"aime2025"``
            (both 2025 papers) from the hub.
        split: the hub split (default: train for dapo, test for aime2025); ``"train"`` or
            ``"test"`` of ``"math-large"`` (default: both).
        protocol: ``"tool"`` or ``"fenced"``.
        mode: ``"stateful"`` (one notebook-like interpreter per episode) or
            ``"stateless"`` (a fresh interpreter per call, pre-started by a pool of
            ``pool_size``).
        isolation: ``"bwrap"``; ``"rlimits"`` is the explicit, unsafe opt-in for hosts
            without user namespaces (reported in every step's ``info["isolation"]``).
        max_code_calls, max_turns, max_obs_chars: the budgets.
        timeout, memory_mb: per call wall-time (s) and address-space (MiB) limits; the
            memory limit also bounds all of a sandbox's processes together (a cgroup, else
            a watcher: ``env.sandbox.memory_bound`` says which).
        reward_correct, reward_incorrect: the two outcome rewards.
        invalid_penalty: subtracted from the reward of an invalid step.
        math_timeout: seconds allowed to math-verify per answer.
    """

    env_id = "agent_gym/CodeInterpreter-v0"
    # The sandbox's isolation and limits, the hub (network) and host files: never a state's.
    host_settings = frozenset({
        "isolation", "timeout", "memory_mb", "pool_size", "math_timeout", "data_path",
        "dataset", "split",
    })

    def __init__(
        self,
        data_path: str | None = None,
        dataset: str = "bundled",
        split: str | None = None,
        mode: str = "stateful",
        protocol: str = "tool",
        isolation: str = "bwrap",
        max_code_calls: int = 6,
        max_turns: int = 8,
        max_obs_chars: int = 2000,
        timeout: float = 10.0,
        memory_mb: int = 1024,
        pool_size: int = 1,
        reward_correct: float = 1.0,
        reward_incorrect: float = 0.0,
        invalid_penalty: float = 0.0,
        math_timeout: float = DEFAULT_MATH_TIMEOUT,
        render_mode: str | None = None,
    ) -> None:
        self.protocol = choose_protocol(protocol, PROTOCOLS)
        if mode not in _STATE:
            raise ValueError(f"mode must be 'stateful' or 'stateless', got {mode!r}")
        if max_code_calls < 0 or memory_mb < 64 or pool_size < 0:
            raise ValueError("need max_code_calls >= 0, memory_mb >= 64 and pool_size >= 0")
        super().__init__(
            load_tasks(data_path, dataset, split),
            max_turns=max_turns,
            reward_correct=reward_correct,
            reward_incorrect=reward_incorrect,
            invalid_penalty=invalid_penalty,
            max_obs_chars=max_obs_chars,
            render_mode=render_mode,
        )
        self.mode = mode
        self.max_code_calls = max_code_calls
        self.timeout = timeout
        self.math_timeout = math_timeout
        limits = Limits(
            timeout=timeout, cpu_seconds=max(1, int(timeout)), memory_bytes=memory_mb << 20
        )
        self.sandbox = open_sandbox(
            mode,
            isolation=isolation,
            limits=limits,
            pool_size=pool_size if mode == "stateless" else 0,
        )
        self.isolation = self.sandbox.isolation
        self._calls = 0

    # ------------------------------------------------------------------ episode
    def _start(self, task: Task) -> Opening:
        self._calls = 0
        self.sandbox.reset()
        problem = task.payload["problem"]
        system = PROMPT.format(
            n=self.max_code_calls, how=self.protocol.instructions("run code"),
            state=_STATE[self.mode],
        )
        return Opening(
            observation=problem,
            messages=[
                {"role": "system", "content": system},
                {"role": "user", "content": problem},
            ],
            tools=self.protocol.tools,
            privileged={
                "reference_answer": task.payload["answer"],
                "oracle_actions": self._oracle(task),
            },
        )

    def _oracle(self, task: Task) -> list[str]:
        """A scripted solution: run the bundled program when there is one, then answer."""
        final = f"The answer is \\boxed{{{task.payload['answer']}}}."
        program = task.payload.get("program")
        if not program or self.max_code_calls < 1:
            return [final]
        return [self.protocol.format(program, preface="Let me compute it."), final]

    def _step(self, action: str) -> Transition:
        try:
            code = self.protocol.parse(action)
        except ToolCallError as err:
            return self._invalid(f"Invalid action: {err}.", role="user")
        if code is not None:
            return self._run(code)
        score = score_math(action, self.task.payload["answer"], self.math_timeout)
        info: dict[str, Any] = {
            "answer": score.answer,
            "correct": score.correct,
            "code_calls": self._calls,
        }
        if not score.answer:  # an empty \boxed{} is no answer, like an empty "Answer:"
            message = NO_ANSWER if score.answer is None else EMPTY_ANSWER
            return self._invalid(message, role="user", info=info)
        return Transition(
            f"Final answer: {score.answer}", self._outcome(score.correct), terminated=True,
            role="user", info=info,
        )

    def _run(self, code: str) -> Transition:
        """Run one parsed call; whatever comes back answers it, in the protocol's role."""
        if self._calls >= self.max_code_calls:
            return self._invalid(
                f"No code runs left (the budget is {self.max_code_calls}); give the final "
                "answer in \\boxed{}.",
                role=self.protocol.reply_role,
            )
        info: dict[str, Any] = {"isolation": self.isolation}
        if self.sandbox.launcher.warning:
            info["sandbox_warning"] = self.sandbox.launcher.warning
        try:
            result = self._outside(lambda: self.sandbox.run(code, timeout=self.timeout),
                                   SandboxError)
        except BackendFailure as err:
            # Not the agent's fault: no call spent and no penalty; the episode goes on. A
            # notebook's interpreter is gone with the failure, so it starts afresh, in the
            # episode and in every restore of it alike.
            info["sandbox_error"] = err.message
            lost = ""
            if self.mode == "stateful":
                self.sandbox.reset()
                lost = " Its state was lost: variables and imports are gone."
            return self._observe(f"The code interpreter failed: {err.message}.{lost} Try again.",
                                 info)
        self._calls += 1
        info.update(_result_info(result), code_calls=self._calls)
        return self._observe(result.observation(), info)

    def _observe(self, text: str, info: dict[str, Any]) -> Transition:
        """The output in the protocol's wrapping (the base sanitises and caps it)."""
        return Transition(self.protocol.wrap(text), role=self.protocol.reply_role, info=info)

    @staticmethod
    def _invalid(message: str, role: str, info: dict[str, Any] | None = None) -> Transition:
        return Transition(message, invalid=True, role=role, info=info or {})

    def _close(self) -> None:
        self.sandbox.close()


def _result_info(result: ExecResult) -> dict[str, Any]:
    return {
        "exec_status": result.status,
        "exec_error": result.error,
        "state_lost": result.state_lost,
        "exec_seconds": round(result.duration, 4),
    }


# ---------------------------------------------------------------------- data
def load_tasks(data_path: str | None, dataset: str, split: str | None) -> list[Task]:
    if data_path is not None:
        records, source = data.load_records(data_path), Path(data_path).stem
    elif dataset in HUB_SETS:
        name, configs, default_split = HUB_SETS[dataset]
        records = [r for c in configs for r in data.load_hub(name, c, split or default_split)]
        source = dataset
    elif dataset == math_large.NAME:  # the answer alone, and a program that prints it
        records = [{"id": r["id"], "problem": r["question"], "answer": str(r["value"]),
                    "program": f"print({r['program']})"} for r in math_large.records(split)]
        source = math_large.NAME
    elif dataset == "bundled":
        if split is not None:
            raise data.DataError(
                "the bundled set has a single split; pass dataset='dapo' or "
                "'aime2025' to choose a split"
            )
        records, source = data.bundled("code_math"), "code_math"
    else:
        raise data.DataError(f"dataset must be 'bundled', '{math_large.NAME}', 'dapo' or "
                             f"'aime2025', got {dataset!r}")
    tasks = []
    for index, record in enumerate(records):
        problem, answer = _problem(record), _answer(record)
        if problem is None or answer is None:
            raise data.DataError(
                f"{source}: record {index} needs a problem ('problem', 'question' or "
                "'prompt') and an answer ('answer' or reward_model.ground_truth)"
            )
        extra = record.get("extra_info") if isinstance(record.get("extra_info"), dict) else {}
        task_id = str(record.get("id") or extra.get("index") or f"{source}-{index}")
        payload = {"problem": problem, "answer": answer}
        if isinstance(record.get("program"), str):
            payload["program"] = record["program"]
        tasks.append(Task(task_id, payload))
    return tasks


def _problem(record: dict[str, Any]) -> str | None:
    for key in ("problem", "question"):
        if isinstance(record.get(key), str) and record[key].strip():
            return record[key].strip()
    prompt = record.get("prompt")
    if isinstance(prompt, list):  # verl/DAPO format: a chat whose last user turn holds it
        turns = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        prompt = turns[-1].get("content") if turns else None
    if not isinstance(prompt, str) or not prompt.strip():
        return None
    if prompt.startswith(_DAPO_HEAD) and _DAPO_TAIL in prompt:
        prompt = prompt.split("\n\n", 1)[1].rsplit(_DAPO_TAIL, 1)[0]
    return prompt.strip()


def _answer(record: dict[str, Any]) -> str | None:
    answer = record.get("answer")
    if answer is None and isinstance(record.get("reward_model"), dict):
        answer = record["reward_model"].get("ground_truth")
    if answer is None or isinstance(answer, bool) or str(answer).strip() == "":
        return None
    return str(answer).strip()
