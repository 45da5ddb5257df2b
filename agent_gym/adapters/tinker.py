"""agent_gym envs for tinker-cookbook's RL loops: ``EnvGroupBuilder``, ``Env`` and ``RLDataset``.

The cookbook's contract (``tinker_cookbook.rl.types``): an ``EnvGroupBuilder`` is picklable
configuration whose ``make_envs()`` returns single-use token-level ``Env``s; a group's
rewards are centred by the algorithm (GRPO); an env that knows why an episode ended records
``metrics["stop/<reason>"] = 1``. The envs here are the cookbook's own
``EnvFromMessageEnv`` (its renderer turns messages into tokens and parses the sampled reply
back) around ``AgentGymMessageEnv``, which plays one agent_gym episode: the reply becomes the
env's action text (tool calls written in the Hermes JSON form the envs parse), and the env's
answer comes back as the next ``tool`` or ``user`` message.

``AgentGymEnvGroupBuilder(..., state=saved.to_json())`` restores the same mid-episode state
in every member of the group (verified by replay), so a group's branches start identically.
Everything heavy (the agent_gym env, the tokenizer, the renderer) is built in ``make_envs``,
in the process that runs the rollouts.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import gymnasium

from agent_gym.extras import install_hint

try:
    from tinker_cookbook import renderers
    from tinker_cookbook.rl import types
    from tinker_cookbook.rl.message_env import EnvFromMessageEnv, MessageEnv, MessageStepResult
    from tinker_cookbook.tokenizer_utils import Tokenizer, get_tokenizer
except ImportError as err:  # tinker-cookbook is an optional extra
    raise ImportError("agent_gym.adapters.tinker needs tinker-cookbook: "
                      + install_hint("tinker")) from err

from agent_gym.actions.tools import format_tool_call
from agent_gym.env.state import EnvState

_TOKENIZER_LOCKS: weakref.WeakKeyDictionary[Tokenizer, threading.RLock] = (
    weakref.WeakKeyDictionary())
_LOCKS_GUARD = threading.Lock()


class TurnTakingTokenizer:
    """A tokenizer whose calls take turns, one thread at a time.

    tinker-cookbook renders each env's prompt in a worker thread
    (``EnvFromMessageEnv._render_in_thread``) and its ``get_tokenizer`` hands every group
    the same cached tokenizer, so a group's envs encode on one Hugging Face fast tokenizer
    at once. That is not safe (transformers#47085): a group of 8 restored Search-v0 envs
    came out with ``<|im_end|>`` encoded as 7 text tokens instead of one, and a group of 2
    with two different first prompts, about once in every 7 test-suite runs. The lock
    belongs to the tokenizer, so every renderer made here over it shares it.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        with _LOCKS_GUARD:
            self._lock = _TOKENIZER_LOCKS.setdefault(tokenizer, threading.RLock())
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._tokenizer, name)
        if not callable(value):
            return value

        @functools.wraps(value)
        def in_turn(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return value(*args, **kwargs)

        return in_turn

    # Special methods are looked up on the type, never through ``__getattr__``.
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        with self._lock:
            return len(self._tokenizer)


class AgentGymMessageEnv(MessageEnv):
    """One agent_gym episode at the message level; the env is built at the first call.

    Only the opening chat, the env's replies and the reward reach the renderer and so the
    policy; the episode's privileged info (answers, oracle actions) stays in
    ``privileged``, for a critic or a group's reward to read."""

    def __init__(self, env_id: str, env_kwargs: dict[str, Any], reset_options: dict[str, Any],
                 renderer: renderers.Renderer) -> None:
        self.env_id = env_id
        self.env_kwargs = env_kwargs
        self.reset_options = reset_options
        self.renderer = renderer
        self.env: gymnasium.Env | None = None
        self.messages: list[renderers.Message] = []
        self.example_id: str | None = None
        self.privileged: dict[str, Any] = {}

    async def initial_observation(self) -> list[renderers.Message]:
        self.env = await asyncio.to_thread(gymnasium.make, self.env_id, **self.env_kwargs)
        _, info = await asyncio.to_thread(self.env.reset, options=self.reset_options)
        self.example_id = info["task_id"]
        self.privileged = dict(info["privileged"])
        chat = [dict(m) for m in info["messages"] + info.get("history", [])]
        if info.get("tools"):
            system = chat.pop(0)["content"] if chat and chat[0]["role"] == "system" else ""
            specs = [t["function"] for t in info["tools"]]
            try:
                prefix = self.renderer.create_conversation_prefix_with_tools(specs, system)
            except NotImplementedError as err:  # role_colon and other plain-text formats
                raise ValueError(
                    f"tinker-cookbook's {type(self.renderer).__name__} has no tool calling, and "
                    f"{self.env_id} was made with the tool protocol: pick a renderer that "
                    "calls tools (qwen3, llama3, ...) or the env's text protocol "
                    f"({TEXT_PROTOCOLS}), whose replies any renderer carries") from err
            chat = [*prefix, *chat]
        self.messages = [_message(m) for m in chat]
        return self.messages

    async def step(self, message: renderers.Message) -> MessageStepResult:
        if self.env is None:
            raise RuntimeError("initial_observation() must come first")
        text = reply_text(message)
        observation, reward, terminated, truncated, info = await asyncio.to_thread(
            self.env.step, text
        )
        reply = info["message"]
        answer: renderers.Message = {"role": reply["role"], "content": observation}
        if reply["role"] == "tool" and message.get("tool_calls"):
            answer["name"] = message["tool_calls"][0].function.name
        self.messages = [*self.messages, message, answer]
        metrics: dict[str, float] = {"invalid_action": float(info.get("invalid", False))}
        if terminated:
            metrics[f"{types.STOP_METRIC_PREFIX}{types.StopReason.COMPLETED}"] = 1.0
        elif truncated:
            metrics[f"{types.STOP_METRIC_PREFIX}{types.StopReason.MAX_TURNS}"] = 1.0
        return MessageStepResult(reward=float(reward), episode_done=terminated or truncated,
                                 next_messages=self.messages, metrics=metrics,
                                 logs={"turn": int(info.get("turn", 0))})

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None


def reply_text(message: renderers.Message) -> str:
    """The assistant's message as the env reads it: its text, then its tool calls in the
    Hermes form with the model's argument JSON kept verbatim, so the env's strict parser
    (not this adapter) judges them; unparsable ones go in as the model wrote them."""
    parts = [renderers.get_text_content(message)]
    parts += [format_tool_call(call.function.name, call.function.arguments or "{}")
              for call in message.get("tool_calls") or []]
    parts += [call.raw_text for call in message.get("unparsed_tool_calls") or []]
    return "\n".join(part for part in parts if part)


def _message(chat: dict[str, Any]) -> renderers.Message:
    message: renderers.Message = {"role": chat["role"], "content": chat["content"]}
    if "name" in chat:
        message["name"] = chat["name"]
    return message


# The env setting that puts each bundled tool env's calls in plain text.
TEXT_PROTOCOLS = ("Search-v0: protocol='tag'; CodeInterpreter-v0: protocol='fenced'; "
                  "ALFWorld-v0: protocol='text'")


@dataclass
class AgentGymEnvGroupBuilder(types.EnvGroupBuilder):
    """``group_size`` envs on one task (``task_id``) or one saved state (``state``, JSON).

    Picklable: it holds only names and settings. ``tokenizer`` is what tinker-cookbook's
    ``get_tokenizer`` loads (a Hugging Face id, or a local directory offline) and
    ``renderer_name`` one of its renderers (``"qwen3"``, ``"llama3"``, ``"role_colon"``, ...).
    """

    env_id: str
    env_kwargs: dict[str, Any]
    group_size: int
    renderer_name: str
    tokenizer: str
    task_id: str | None = None
    state: str | None = None
    max_trajectory_tokens: int | None = None
    _message_envs: list[AgentGymMessageEnv] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if (self.task_id is None) == (self.state is None):
            raise ValueError("give exactly one of task_id and state")
        if self.group_size < 1:
            raise ValueError("group_size must be at least 1")

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_message_envs": []}  # live envs never travel

    def reset_options(self) -> dict[str, Any]:
        if self.state is not None:
            return {"state": EnvState.from_json(self.state)}
        return {"task_id": self.task_id}

    async def make_envs(self) -> Sequence[types.Env]:
        tokenizer = TurnTakingTokenizer(get_tokenizer(self.tokenizer))
        renderer = renderers.get_renderer(self.renderer_name, tokenizer)
        self._message_envs = [
            AgentGymMessageEnv(self.env_id, dict(self.env_kwargs), self.reset_options(), renderer)
            for _ in range(self.group_size)
        ]
        return [EnvFromMessageEnv(renderer, env, max_trajectory_tokens=self.max_trajectory_tokens)
                for env in self._message_envs]

    async def compute_group_rewards(
        self, trajectory_group: list[types.Trajectory], env_group: Sequence[types.Env]
    ) -> list[tuple[float, types.Metrics]]:
        """The env's per-step rewards already are the return; add per-trajectory metrics."""
        return [(0.0, {"turns": float(len(t.transitions)),
                       "won": float(sum(x.reward for x in t.transitions) > 0)})
                for t in trajectory_group]

    async def cleanup(self) -> None:
        for env in self._message_envs:
            await asyncio.to_thread(env.close)
        self._message_envs = []

    def logging_tags(self) -> list[str]:
        return ["agent_gym", self.env_id.split("/")[-1]]


class AgentGymRLDataset(types.RLDataset):
    """Batches of group builders over an env's tasks, in order (``batch_size`` groups each)."""

    def __init__(self, env_id: str, env_kwargs: dict[str, Any], *, batch_size: int,
                 group_size: int, renderer_name: str, tokenizer: str,
                 task_ids: Sequence[str] | None = None) -> None:
        if task_ids is None:
            env = gymnasium.make(env_id, **env_kwargs)
            try:
                task_ids = [task.task_id for task in env.unwrapped.tasks]
            finally:
                env.close()
        self.builders = [
            AgentGymEnvGroupBuilder(env_id, dict(env_kwargs), group_size, renderer_name,
                                    tokenizer, task_id=task_id)
            for task_id in task_ids
        ]
        self.batch_size = batch_size

    def get_batch(self, index: int) -> Sequence[types.EnvGroupBuilder]:
        return self.builders[index * self.batch_size : (index + 1) * self.batch_size]

    def __len__(self) -> int:
        return len(self.builders) // self.batch_size
