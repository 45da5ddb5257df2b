"""What the tests that play every env over the wire share: each env's server settings (turns
enough for its oracle), the MCP tools it offers, and the keys no reply to a policy may hold.
Plain data, so the newest OpenEnv's venv can import it too (tests/serve/openenv_clients.py)."""

from __future__ import annotations

SERVED: dict[str, tuple[str, ...]] = {
    "agent_gym/GSM8K-v0": ("--env-arg", "max_turns=2"),
    "agent_gym/CodeInterpreter-v0": ("--env-arg", "max_turns=4"),
    "agent_gym/Search-v0": ("--env-arg", "max_turns=5"),
    "agent_gym/ALFWorld-v0": ("--env-arg", "max_turns=12"),
}
TOOLS = {"agent_gym/GSM8K-v0": ["answer"],
         "agent_gym/CodeInterpreter-v0": ["code_interpreter", "answer"],
         "agent_gym/Search-v0": ["search", "answer"],
         "agent_gym/ALFWorld-v0": ["alfworld_step", "answer"]}
# The info key, and what it holds in the four envs.
PRIVILEGED_KEYS = ("privileged", "oracle_actions", "reference_answer", "walkthrough",
                   "gold_passage_ids")
