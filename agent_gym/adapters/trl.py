"""agent_gym envs for TRL's ``GRPOTrainer(environment_factory=...)``.

TRL's contract (trl >= 1.x, ``GRPOTrainer`` docs): the factory is a zero-argument callable
returning an object with ``reset(**dataset_row)`` and one public, typed, Google-docstring
method per tool; TRL renders those methods as the tools of the prompt, parses the model's
tool calls and calls the methods by name. This module builds such a class for any agent_gym
env id: one method per tool the env declares (``search(query)``, ``code_interpreter(code)``,
``alfworld_step(action)``), each running the call as an env step, so the model sees what the
env answers.

The episode is scored the way ``agent-gym eval`` scores it, not the way TRL read it. TRL
finds tool calls with its own lenient parser (it runs a call followed by more text, or two
calls in one reply, both of which the env refuses) and would hand a reply cut at the length
limit over as an answer. So ``trl_reward(tokenizer)`` builds the reward function from the
sampled tokens instead: it cuts each completion into the assistant's turns and plays every
turn the model finished, verbatim, through the episode restored to the row's starting point,
where the env's own strict parser judges it; a turn cut at the length limit is never shown
to the env, as in eval, so the episode keeps what it earned before. The replay runs each
tool call a second time (a sandboxed cell, a search): it costs one more env step per call,
and an env whose tools are not deterministic (a live web search) may score a turn on an
observation the model did not see; the bundled envs' tools are deterministic::

    Env = trl_environment("agent_gym/Search-v0", max_turns=5)
    trainer = GRPOTrainer(model=..., processing_class=tokenizer,
                          reward_funcs=trl_reward(tokenizer), environment_factory=Env,
                          train_dataset=trl_dataset("agent_gym/Search-v0", max_turns=5), ...)

The tokenizer's chat template must render tool calls (TRL checks); the embedded model's does
(``agent_gym_train.backends.models.load_tokenizer``). A dataset row with a ``state`` (``EnvState``
JSON) restores that mid-episode state instead of starting the task, so every member of a
GRPO group starts from the identical point. Nothing of ``info["privileged"]`` reaches the
model: the prompt is the env's opening messages and a tool returns only the observation.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import gymnasium

from agent_gym.env.base import TextEnv
from agent_gym.env.state import EnvState

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

EPISODE_OVER = "The episode is over; give your final answer."


class AgentGymTRLEnv:
    """Base of the classes ``trl_environment`` builds; ``env_id`` and ``env_kwargs`` are set
    on each subclass, so the class itself is TRL's zero-argument factory."""

    env_id: str = ""
    env_kwargs: Mapping[str, Any] = {}

    def __init__(self) -> None:
        # Built at the first reset: TRL constructs one instance just to read its tools.
        self._env: gymnasium.Env | None = None
        self._start: EnvState | None = None
        self._done = False

    def reset(self, task_id: str | None = None, state: str | None = None,
              **_columns: Any) -> str | None:
        """Start the row's task (``task_id``) or restore its saved ``state``. The prompt
        is the dataset's ``prompt`` column, so nothing is appended to it (``None``)."""
        if self._env is None:
            self._env = gymnasium.make(self.env_id, **self.env_kwargs)
            # TRL never closes its environments: the env (a sandbox, an engine) is closed
            # when this object goes, or at exit.
            self._closer = weakref.finalize(self, self._env.close)
        if state:
            self._env.reset(options={"state": EnvState.from_json(state)})
        elif task_id is not None:
            self._env.reset(options={"task_id": task_id})
        else:
            self._env.reset()
        # Where scoring replays the episode from: the reset info (and its privileged part)
        # is not kept, so nothing the policy must not see is held here.
        self._start = self._env.unwrapped.save_state()
        self._done = False
        return None

    def _call_tool(self, argument: str) -> str:
        """The observation of the env's tool called with ``argument``, written by the env's
        own protocol: what the model is shown while TRL generates. The score is the replay's
        (``_score``), where the env judges the reply the model actually wrote."""
        if self._env is None:
            raise RuntimeError("reset() the environment first")
        if self._done:
            return EPISODE_OVER
        observation, _, terminated, truncated, _ = self._env.step(
            self._env.unwrapped.protocol.format(argument))
        self._done = terminated or truncated
        return observation

    def _score(self, replies: Sequence[str]) -> float:
        """The env's total reward for the episode whose assistant turns are ``replies``
        (verbatim, each one the model finished), played from the row's starting point."""
        if self._env is None or self._start is None:
            raise RuntimeError("reset() the environment first")
        self._env.reset(options={"state": self._start})
        total = 0.0
        for reply in replies:
            _, reward, terminated, truncated, _ = self._env.step(reply)
            total += float(reward)
            if terminated or truncated:
                break
        self._done = True  # the episode was scored: a later tool call plays nothing
        return total

    def _close(self) -> None:
        """Close the env now (private: TRL exposes each public method as a tool)."""
        if self._env is not None:
            self._closer()


def _tool_method(schema: Mapping[str, Any]) -> Callable[..., str]:
    """A method named after the tool, with its one string parameter typed and described in
    a Google docstring, as TRL (through ``transformers.utils.get_json_schema``) requires of
    tools. Every agent_gym tool takes one required string (the protocols' contract)."""
    function = schema["function"]
    name = function["name"]
    properties: Mapping[str, Any] = function.get("parameters", {}).get("properties", {})
    (argument, spec), = properties.items()
    signature = inspect.Signature([
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter(argument, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str),
    ])
    lines = [function.get("description") or name, "", "Args:",
             f"    {argument}: {spec.get('description') or argument}", "",
             "Returns:", "    What the environment observes after the call."]

    def method(self: AgentGymTRLEnv, *args: Any, **kwargs: Any) -> str:
        value = signature.bind(self, *args, **kwargs).arguments[argument]
        if not isinstance(value, str):
            raise TypeError(f"{name}: {argument} must be a string, got {type(value).__name__}")
        return self._call_tool(value)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = "\n".join(lines)
    method.__signature__ = signature  # type: ignore[attr-defined]
    method.__annotations__ = {argument: str}
    return method


def trl_environment(env_id: str, **env_kwargs: Any) -> type[AgentGymTRLEnv]:
    """A class for ``GRPOTrainer(environment_factory=...)`` that plays ``env_id`` built with
    ``env_kwargs``: one method per env tool, ``reset`` from a dataset row."""
    probe = gymnasium.make(env_id, **env_kwargs)
    try:
        if not isinstance(probe.unwrapped, TextEnv):
            raise ValueError(f"{env_id} is not an agent_gym env")
        protocol = getattr(probe.unwrapped, "protocol", None)
    finally:
        probe.close()
    tools = [] if protocol is None else protocol.tools
    if protocol is not None and not tools:
        raise ValueError(
            f"{env_id} was built with protocol={protocol.name!r}; TRL calls tools as "
            "functions, so build it with protocol='tool'"
        )
    namespace: dict[str, Any] = {"env_id": env_id, "env_kwargs": dict(env_kwargs),
                                 "__doc__": f"{env_id} for TRL's GRPOTrainer."}
    for schema in tools:
        method = _tool_method(schema)
        if method.__name__ in namespace or method.__name__.startswith("_") or \
                hasattr(AgentGymTRLEnv, method.__name__):
            raise ValueError(f"{env_id}'s tool {method.__name__!r} clashes with the adapter")
        namespace[method.__name__] = method
    class_name = "".join(ch for ch in env_id.split("/")[-1].title() if ch.isalnum())
    return type(class_name, (AgentGymTRLEnv,), namespace)


class _CompletionTurns:
    """Cuts a TRL completion, given as token ids, into the assistant's turns.

    TRL builds a multi-turn completion as ``turn + tool results + turn + ...``: each turn is
    what the model sampled, ended by its end-of-sequence token, and TRL appends the tool
    results rendered by the chat template, ending with the template's generation prompt
    (``<|im_start|>assistant\\n`` in ChatML), after which the next turn begins. A turn
    without the end token was cut at the length limit; only the last one can be, since
    TRL stops a completion that has no room left.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no end-of-sequence token to end a turn with")
        probe = [{"role": "user", "content": "?"}]
        closed = tokenizer.apply_chat_template(probe, tokenize=False)
        opened = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        if not opened.startswith(closed) or opened == closed:
            raise ValueError("the chat template's generation prompt does not extend the chat, "
                             "so a completion's turns cannot be told apart")
        self.tokenizer = tokenizer
        self.header = list(tokenizer.encode(opened[len(closed):], add_special_tokens=False))
        self.end = tokenizer.eos_token_id

    def finished(self, completion_ids: Sequence[int]) -> list[str]:
        """The text of every turn the model ended itself, in order; a cut last turn is
        left out (eval never shows a cut reply to the env)."""
        ids = list(completion_ids)
        replies: list[str] = []
        start = 0
        while True:
            try:
                end = ids.index(self.end, start)
            except ValueError:  # cut at the length limit
                return replies
            replies.append(self.tokenizer.decode(ids[start:end], skip_special_tokens=False))
            start = _find(ids, self.header, end + 1)
            if start < 0:
                return replies
            start += len(self.header)


def _find(ids: Sequence[int], part: Sequence[int], start: int) -> int:
    """Where ``part`` first occurs in ``ids`` at or after ``start``; -1 when it does not.
    The tool results it skips are env observations, whose control tokens the env breaks
    up, so the generation prompt does not occur inside them; only TRL's note of a call it
    could not make (an unknown tool) quotes the model, which then scores its own text."""
    width = len(part)
    for i in range(start, len(ids) - width + 1):
        if ids[i : i + width] == part:
            return i
    return -1


def trl_reward(tokenizer: PreTrainedTokenizerBase) -> Callable[..., list[float]]:
    """TRL reward function (named ``env_reward`` in TRL's logs): each episode's total env
    reward, the episode replayed from its completion's tokens (see the module docstring).
    ``tokenizer`` is the trainer's ``processing_class``."""
    turns = _CompletionTurns(tokenizer)

    def env_reward(completion_ids: Sequence[Sequence[int]],
                   environments: Sequence[AgentGymTRLEnv], **_: Any) -> list[float]:
        return [environment._score(turns.finished(ids))
                for ids, environment in zip(completion_ids, environments, strict=True)]

    return env_reward


def trl_dataset(env_id: str, *, task_ids: Iterable[str] | None = None,
                states: Iterable[EnvState] | None = None, **env_kwargs: Any) -> Any:
    """A ``datasets.Dataset`` for the env: one row per task (``prompt``, ``task_id``,
    ``state=None``), or one per saved state, whose ``prompt`` is the chat up to that point.
    Each row costs one reset (the prompt is the env's opening), so pass ``task_ids`` to
    build a subset of a large or slow-to-reset env."""
    from datasets import Dataset

    env = gymnasium.make(env_id, **env_kwargs)
    rows: list[dict[str, Any]] = []
    try:
        if states is not None:
            for state in states:
                _, info = env.reset(options={"state": state})
                rows.append({"prompt": info["messages"] + info["history"],
                             "task_id": state.task_id, "state": state.to_json()})
        else:
            unwrapped = env.unwrapped
            ids = list(task_ids) if task_ids is not None else [t.task_id for t in unwrapped.tasks]
            for task_id in ids:
                _, info = env.reset(options={"task_id": task_id})
                rows.append({"prompt": info["messages"], "task_id": task_id, "state": None})
    finally:
        env.close()
    return Dataset.from_list(rows)
