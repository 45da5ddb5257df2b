"""Run by tests/serve/test_openenv_latest.py with the Python of `.venv-openenv` (the newest
OpenEnv, which cannot share the main venv with verifiers): OpenEnv's `GenericEnvClient` and
`MCPToolClient` each play task 0 of the env served at URL to its end, behind the server's
bearer token, with the oracle's replies that a critic reads through public calls only (the
session id from the client's own `state()` or reset observation, then
`agent_gym.serve.critic.privileged`). Prints one JSON line: what each client saw.

    python tests/serve/openenv_clients.py URL   (tokens in AGENT_GYM_TEST_TOKEN, _CRITIC)
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from importlib.metadata import version
from typing import Any

from openenv import GenericEnvClient
from openenv.core.mcp_client import MCPToolClient

from agent_gym.actions.tools import ToolSpec, parse_tool_call
from agent_gym.serve.critic import privileged
from tests.serve.episodes import PRIVILEGED_KEYS

TOKEN = os.environ["AGENT_GYM_TEST_TOKEN"]
CRITIC = os.environ["AGENT_GYM_TEST_CRITIC"]
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


def leaks(reply: Any) -> list[str]:
    text = json.dumps(reply, default=str)
    return [key for key in PRIVILEGED_KEYS if f'"{key}"' in text]


async def generic(url: str) -> dict[str, Any]:
    async with GenericEnvClient(base_url=url, headers=HEADERS) as env:
        opening = await env.reset(index=0)
        session = (await env.state())["session_id"]
        oracle = (await privileged(url, session, CRITIC, token=TOKEN))["oracle_actions"]
        seen, total, result = [opening.observation], 0.0, opening
        for reply in oracle:
            result = await env.step({"text": reply})
            seen.append(result.observation)
            total += result.reward or 0.0
            if result.done:
                break
        return {"reward": total, "done": result.done, "leaks": leaks(seen),
                "replies": len(oracle)}


async def mcp(url: str) -> dict[str, Any]:
    async with MCPToolClient(base_url=url, headers=HEADERS) as env:
        opening = await env.reset(index=0)
        session = opening.observation.session_id
        oracle = (await privileged(url, session, CRITIC, token=TOKEN))["oracle_actions"]
        tools = await env.list_tools()
        specs = [ToolSpec(tool.name, tool.description, tool.input_schema) for tool in tools]
        seen, total, done = [opening.observation.model_dump()], 0.0, False
        for reply in oracle:
            call = parse_tool_call(reply, specs)
            name, arguments = ("answer", {"text": reply}) if call is None else (
                call.name, call.arguments)
            result = await env.call_tool(name, **arguments)
            seen.append(result)
            total += result["reward"]
            done = result["done"]
            if done:
                break
        return {"reward": total, "done": done, "leaks": leaks(seen),
                "tools": [tool.name for tool in tools]}


async def main(url: str) -> None:
    report = {"openenv": version("openenv"), "generic": await generic(url),
              "mcp": await mcp(url)}
    print(json.dumps(report))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
