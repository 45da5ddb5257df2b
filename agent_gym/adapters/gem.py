"""agent_gym envs as GEM envs (``gem-llm``: ``gem.core.Env``).

GEM's contract is Gymnasium's five-tuple ``step`` and ``reset(seed) -> (obs, info)``, which
agent_gym envs already keep, with two differences that need this thin adapter: GEM's own
wrappers call ``reset(seed)`` positionally (Gymnasium's ``seed`` is keyword-only), and GEM
envs may be asked to ``spawn(same_state=True)`` a copy at the current point of the episode,
which is exactly a restore from ``save_state()``.

GEM hands a reset's info on to whatever drives the env, a policy's prompt builder included,
so the adapter keeps the env's ``info["privileged"]`` (answers, oracle actions) out of it:
a critic or oracle reads it from ``GemEnv.privileged``.
"""

from __future__ import annotations

from typing import Any

import gymnasium

try:
    from gem.core import Env
except ImportError as err:  # gem-llm is an optional extra
    raise ImportError("agent_gym.adapters.gem needs gem-llm: pip install gem-llm") from err


class GemEnv(Env):
    """A GEM env playing ``env_id`` (built with ``env_kwargs``); ``reset_options`` picks the
    task of every reset (``{"task_id": ...}``, ``{"index": i}``), else the seed does."""

    def __init__(self, env_id: str, reset_options: dict[str, Any] | None = None,
                 **env_kwargs: Any) -> None:
        self.env_id = env_id
        self.env_kwargs = env_kwargs
        self.reset_options = dict(reset_options or {})
        self.env = gymnasium.make(env_id, **env_kwargs)
        # The episode's privileged info, for a critic; never in an info GEM passes on.
        self.privileged: dict[str, Any] = {}

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed)
        return self._reset(seed=seed, options=self.reset_options or None)

    def _reset(self, **kwargs: Any) -> tuple[str, dict[str, Any]]:
        observation, info = self.env.reset(**kwargs)
        self.privileged = dict(info.get("privileged") or {})
        return observation, {key: value for key, value in info.items() if key != "privileged"}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return self.env.step(action)

    def spawn(self, same_state: bool = False, **kwargs: Any) -> GemEnv:
        """A new env with these settings (``kwargs`` override them); with ``same_state``
        it continues from this episode's current point, restored and verified by replay."""
        settings = {**self.env_kwargs, **kwargs}
        twin = GemEnv(self.env_id, self.reset_options, **settings)
        if same_state:
            twin._reset(options={"state": self.env.unwrapped.save_state()})
        return twin

    def close(self) -> None:
        self.env.close()
