"""A critic's or an oracle's read of a served episode's privileged info, beside any client.

The episode's answers and oracle actions never travel with an observation, so a critic asks
the server for them by naming the session (``POST /privileged`` with the server's critic
token, ``--critic-token-env``). OpenEnv's clients have no call for that request, but their
public calls show the session's id:

* ``GenericEnvClient`` (and any ``/ws`` client): ``(await env.state())["session_id"]``;
* ``MCPToolClient`` (openenv 0.4.2 and later, whose session is opened over HTTP):
  ``(await env.reset(...)).observation.session_id``, as for every session opened over HTTP
  (``/reset``'s ``observation.session_id``).

With it, ``privileged`` (or ``privileged_sync``) asks over plain HTTP, beside the client's
own connection, which goes on playing the episode::

    async with GenericEnvClient(base_url=url) as env:
        await env.reset(index=0)
        session = (await env.state())["session_id"]
        answers = await privileged(url, session, critic_token=os.environ["CRITIC_TOKEN"])
        answers["oracle_actions"]

``token`` is the server's bearer token (``--token-env``), when it has one.
"""

from __future__ import annotations

from typing import Any

import httpx

from agent_gym.serve.remote import RemoteEnvError
from agent_gym.serve.wire import PRIVILEGED


async def privileged(base_url: str, session_id: str, critic_token: str, *,
                     token: str | None = None, timeout: float = 60.0) -> dict[str, Any]:
    """The current episode's privileged info in session ``session_id`` of the server at
    ``base_url``; the server's refusal (wrong token, unknown session, no episode yet) is a
    ``RemoteEnvError`` with its wire code."""
    async with httpx.AsyncClient(timeout=timeout) as http:
        response = await http.post(**_request(base_url, session_id, critic_token, token))
    return _answer(response)


def privileged_sync(base_url: str, session_id: str, critic_token: str, *,
                    token: str | None = None, timeout: float = 60.0) -> dict[str, Any]:
    """``privileged`` for callers without an event loop (OpenEnv's ``.sync()`` clients)."""
    with httpx.Client(timeout=timeout) as http:
        response = http.post(**_request(base_url, session_id, critic_token, token))
    return _answer(response)


def _request(base_url: str, session_id: str, critic_token: str,
             token: str | None) -> dict[str, Any]:
    """The ``POST /privileged``, from a client's base URL (``http(s)://`` or ``ws(s)://``)."""
    url = base_url.rstrip("/").replace("ws://", "http://", 1).replace("wss://", "https://", 1)
    return {"url": f"{url}/{PRIVILEGED}",
            "json": {"session_id": session_id, "critic_token": critic_token},
            "headers": {"Authorization": f"Bearer {token}"} if token else {}}


def _answer(response: httpx.Response) -> dict[str, Any]:
    try:
        payload = response.json()
    except ValueError:
        payload = None
    if response.status_code == 200 and isinstance(payload, dict) and PRIVILEGED in payload:
        return payload[PRIVILEGED]
    detail = payload.get("detail") if isinstance(payload, dict) else None
    if isinstance(detail, dict):
        raise RemoteEnvError(str(detail.get("code")), str(detail.get("message")))
    raise RemoteEnvError(f"HTTP {response.status_code}", response.text[:500])
