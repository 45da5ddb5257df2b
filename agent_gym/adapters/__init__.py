"""Adapters that put agent_gym envs behind other trainers' in-process env contracts.

* ``agent_gym.adapters.trl``: a class for TRL's ``GRPOTrainer(environment_factory=...)``.
* ``agent_gym.adapters.tinker``: an ``EnvGroupBuilder`` for tinker-cookbook's RL loops.

Each is imported on its own, so using one never needs the other trainer installed.
verifiers and GEM need no adapter: see the README section "Use the envs from other trainers".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from agent_gym.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


def tool_call_text(name: str, arguments: Mapping[str, Any]) -> str:
    """A structured tool call (as trainers parse it) written in the Hermes/Qwen JSON form
    that every agent_gym tool env parses, so the env executes exactly that call."""
    call = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}"
