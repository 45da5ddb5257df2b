"""Any agent_gym env as an in-process OpenEnv ``Environment``.

What NeMo-Gym's OpenEnv resources server and SkyRL's OpenEnv integration import: a subclass
of OpenEnv's ``Environment`` (the installed ``openenv`` package's) with ``reset``, ``step``
and ``state`` on OpenEnv's ``Action``, ``Observation`` and ``State`` types, which OpenEnv's
own ``create_app`` also serves::

    from openenv.core.env_server.http_server import create_app
    from agent_gym.adapters.openenv import (AgentGymAction, AgentGymEnvironment,
                                            AgentGymObservation)

    factory = AgentGymEnvironment.factory("agent_gym/Search-v0", max_turns=5)
    app = create_app(factory, AgentGymAction, AgentGymObservation, env_name="Search-v0",
                     max_concurrent_envs=16)

It behaves as ``agent-gym serve`` does, with the same code (``serve.sessions.Episode`` and
``TaskList``): the observation is the server's (``wire.observation_payload``: text,
Gymnasium info, terminated, truncated), so ``info["privileged"]`` never reaches a caller
that shows observations to a policy, and a critic in the same process asks for it with
``privileged()``. ``reset`` takes what the server's does (``task_id``, ``index``,
``split``, or a saved ``state`` to continue mid-episode, refused unless it was saved from
an env with this one's settings), ``step`` checks an action as the server does, and the
task-listing methods OpenEnv's server turns into its task API are here too. Whatever the
server refuses, this refuses in the same words.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import gymnasium
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State
from pydantic import Field

import agent_gym  # noqa: F401  (importing it registers the envs)
from agent_gym.env.base import TextEnv
from agent_gym.env.state import _json_kwargs
from agent_gym.serve.sessions import Episode, TaskIndexError, TaskList
from agent_gym.serve.wire import ProtocolError, server_version


class AgentGymAction(Action):
    """The assistant's reply; a tool call is written in it as the env's prompt asks."""

    text: str = Field(description="the assistant's message")


class AgentGymObservation(Observation):
    """The env's observation, and its Gymnasium info without ``privileged``."""

    text: str = Field(default="", description="the env's observation")
    info: dict[str, Any] = Field(default_factory=dict, description="the Gymnasium info "
                                 "(messages, tools, turn, invalid, ...) without 'privileged'")
    terminated: bool = False
    truncated: bool = False


class AgentGymState(State):
    """OpenEnv's state plus the episode's ``EnvState`` (pass it back to ``reset`` as
    ``state`` to continue from here) and what a client plans episodes with."""

    env_state: dict[str, Any] | None = None
    num_tasks: int = Field(ge=1)
    max_turns: int = Field(ge=1)


class AgentGymEnvironment(Environment[AgentGymAction, AgentGymObservation, AgentGymState]):
    """One agent_gym env (``gymnasium.make(env_id, **env_kwargs)``) behind OpenEnv's
    ``Environment`` interface. Each instance builds its own env, so sessions may run
    concurrently. What the server refuses raises ``ValueError`` with the server's words,
    a task index out of range ``IndexError`` (``refused``)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, env_id: str, **env_kwargs: Any) -> None:
        super().__init__()
        env = gymnasium.make(env_id, disable_env_checker=True, **env_kwargs)
        if not isinstance(env.unwrapped, TextEnv):
            env.close()
            raise ValueError(f"{env_id} is not an agent_gym env")
        self.env_id = env_id
        self.env = env
        self.episode = Episode(env, env_id, _json_kwargs(env_id, env.unwrapped._env_kwargs))

    @classmethod
    def factory(cls, env_id: str, **env_kwargs: Any) -> Callable[[], AgentGymEnvironment]:
        """The zero-argument factory OpenEnv's ``create_app`` and ``HTTPEnvServer`` take;
        a ``partial`` of the class, so they see that it supports concurrent sessions
        without building one to find out."""
        return functools.partial(cls, env_id, **env_kwargs)

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> AgentGymObservation:
        """Start a task (``task_id``, ``index`` with an optional ``split``, or at random)
        or continue a saved ``state``."""
        given = {"seed": seed, "episode_id": episode_id, **kwargs}
        with refused():
            return self._observation(self.episode.reset(
                {key: value for key, value in given.items() if value is not None}))

    def step(self, action: AgentGymAction, timeout_s: float | None = None,
             **kwargs: Any) -> AgentGymObservation:
        """Step with an ``AgentGymAction`` (or the server's action object, a mapping)."""
        fields = action.model_dump() if isinstance(action, Action) else action
        with refused():
            return self._observation(self.episode.step(fields))

    @property
    def state(self) -> AgentGymState:
        return AgentGymState(**self.episode.state())

    def privileged(self) -> dict[str, Any]:
        """The episode's privileged info (answers, oracle actions, walkthroughs), for a
        critic or an oracle in this process: never part of an observation."""
        with refused():
            return self.episode.privileged_info()

    def get_metadata(self) -> EnvironmentMetadata:
        from agent_gym.serve.app import env_description

        return EnvironmentMetadata(name=self.env_id, description=env_description(self.env_id),
                                   version=server_version(), author="agent-gym")

    # OpenEnv's task API (``TaskProvider``), answered by the server's ``TaskList``.
    def list_splits(self) -> list[str]:
        return [self._tasks.split]

    def list_tasks(self, split: str) -> list[dict[str, Any]]:
        return self.get_task_range(split)

    def num_tasks(self, split: str) -> int:
        with refused():
            return len(self._tasks.ids(split))

    def get_task(self, split: str, index: int) -> dict[str, Any]:
        with refused():
            return self._tasks.task(split, index)

    def get_task_range(self, split: str, start: int | None = None,
                       stop: int | None = None) -> list[dict[str, Any]]:
        with refused():
            return self._tasks.tasks(split, start, stop)

    @functools.cached_property
    def _tasks(self) -> TaskList:
        """Read on the first task-API call: an env built to play episodes never needs it."""
        return TaskList.of(self.env)

    def close(self) -> None:
        self.env.close()

    @staticmethod
    def _observation(payload: dict[str, Any]) -> AgentGymObservation:
        return AgentGymObservation(**payload["observation"], reward=payload["reward"],
                                   done=payload["done"])


@contextlib.contextmanager
def refused() -> Iterator[None]:
    """The server's refusals (``ProtocolError``s, which its transports turn into error
    replies) as the exceptions OpenEnv's ``Environment`` callers expect, in the same words:
    ``IndexError`` for a task index out of range, which OpenEnv's server answers with 400,
    ``ValueError`` for the rest."""
    try:
        yield
    except TaskIndexError as exc:
        raise IndexError(str(exc)) from exc
    except ProtocolError as exc:
        raise ValueError(str(exc)) from exc
