"""agent_gym envs for TRL's ``GRPOTrainer(environment_factory=...)``.

TRL's contract (trl >= 1.x, ``GRPOTrainer`` docs): the factory is a zero-argument callable
returning an object with ``reset(**dataset_row)`` and one public, typed, Google-docstring
method per tool; TRL renders those methods as the tools of the prompt, parses the model's
tool calls and calls the methods by name. This module builds such a class for any agent_gym
env id: one method per tool the env declares (``search(query)``, ``code_interpreter(code)``,
``alfworld_step(action)``), each executing the call as an env step.

The episode's reward goes to the trainer through ``env_reward``, a reward function, rather
than TRL's ``get_reward()`` hook: agent_gym envs score the *final reply* (the answer after
the last tool call), and ``get_reward()`` is called without it. ``env_reward`` receives the
completions and the environments from TRL, plays each final reply as the episode's last
step and returns the env's total reward::

    Env = trl_environment("agent_gym/Search-v0", max_turns=5)
    trainer = GRPOTrainer(model=..., reward_funcs=env_reward, environment_factory=Env,
                          train_dataset=trl_dataset("agent_gym/Search-v0", max_turns=5), ...)

A dataset row with a ``state`` (``EnvState`` JSON) restores that mid-episode state instead of
starting the task, so every member of a GRPO group starts from the identical point.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import gymnasium

from agent_gym.env.base import TextEnv
from agent_gym.env.state import EnvState

EPISODE_OVER = "The episode is over; give your final answer."


class AgentGymTRLEnv:
    """Base of the classes ``trl_environment`` builds; ``env_id`` and ``env_kwargs`` are set
    on each subclass, so the class itself is TRL's zero-argument factory."""

    env_id: str = ""
    env_kwargs: Mapping[str, Any] = {}

    def __init__(self) -> None:
        # Built at the first reset: TRL constructs one instance just to read its tools.
        self._env: gymnasium.Env | None = None
        self._done = False
        self._total_reward = 0.0
        self._last_info: dict[str, Any] = {}

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
            _, info = self._env.reset(options={"state": EnvState.from_json(state)})
        elif task_id is not None:
            _, info = self._env.reset(options={"task_id": task_id})
        else:
            _, info = self._env.reset()
        self._done = False
        self._total_reward = 0.0
        self._last_info = info
        return None

    def _act(self, text: str) -> str:
        """One env step with ``text`` as the assistant's message; returns the observation."""
        if self._env is None:
            raise RuntimeError("reset() the environment first")
        if self._done:
            return EPISODE_OVER
        observation, reward, terminated, truncated, info = self._env.step(text)
        self._total_reward += float(reward)
        self._done = terminated or truncated
        self._last_info = info
        return observation

    def _call_tool(self, argument: str) -> str:
        """The env's tool called with ``argument``, written by the env's own protocol."""
        return self._act(self._env.unwrapped.protocol.format(argument))

    def _close(self) -> None:
        """Close the env now (private: TRL exposes each public method as a tool)."""
        if self._env is not None:
            self._closer()

    # Private, like every helper here: TRL exposes each public method as a tool.
    def _finish(self, final_reply: str | None) -> float:
        """Play the final reply (if the episode is still open) and return the episode's
        total reward."""
        if final_reply is not None and not self._done and self._env is not None:
            self._act(final_reply)
        return self._total_reward


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


def env_reward(completions: Sequence[Any], environments: Sequence[AgentGymTRLEnv],
               **_: Any) -> list[float]:
    """TRL reward function: each episode's total env reward, after its final reply.

    The final reply is the last assistant message of the completion when the model ended
    without a tool call; a completion that ends in a tool result (TRL stopped the tool loop)
    has no final reply and keeps the reward earned so far.
    """
    rewards = []
    for completion, environment in zip(completions, environments, strict=True):
        rewards.append(environment._finish(_final_reply(completion)))
    return rewards


def _final_reply(completion: Any) -> str | None:
    if isinstance(completion, str):
        return completion
    if not completion:
        return None
    last = completion[-1]
    if last.get("role") != "assistant" or last.get("tool_calls"):
        return None
    content = last.get("content")
    if isinstance(content, list):  # multimodal content parts
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


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
