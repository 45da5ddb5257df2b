"""Policies to benchmark: anything that turns a chat (plus tool schemas) into assistant text.

Every policy answers with the assistant's raw text, exactly what an env's ``step`` takes;
a policy that speaks native tool calls (OpenAI ``tool_calls``) is translated into the
Hermes ``<tool_call>`` text the envs parse, never repaired on the way.

Specs for the command line:

* ``oracle`` — replays the env's own solution from privileged info (an upper bound, and a
  check that every task is solvable);
* ``random`` — a random admissible action, for envs that list them, phrased in the env's
  action protocol;
* ``openai:MODEL@BASE_URL`` — any OpenAI-compatible chat endpoint (vLLM, SGLang,
  llama.cpp, OpenAI); the key comes from ``$OPENAI_API_KEY``; append ``#text`` to describe
  tools in the prompt instead of passing them natively (for servers that ignore ``tools``,
  as llama-cpp-python's does with a model's own chat template, or drop ``role: "tool"``
  content, as it does with ``--chat_format chatml-function-calling``);
* ``local[:MODEL][@CHECKPOINT]`` — the local torch backend's sampler (default model: the
  embedded SmolLM2-135M-Instruct; ``tiny``, or any local Hugging Face directory; a
  checkpoint saved by ``agent-gym train``);
* ``vllm[:MODEL][@CHECKPOINT]`` — the same model or checkpoint served by a vLLM server the
  policy starts from the vLLM venv (``make setup``) and stops when it closes;
* ``pytrio:MODEL[@CHECKPOINT]`` — a PyTRIO sampler of a base model or a trained checkpoint
  (credentials as for ``pytrio``).

The sampler policies (``local``, ``vllm``, ``pytrio``) need torch or the PyTRIO SDK, which this
package does not depend on: another installed package supplies them under the
``agent_gym.policies`` entry-point group, one entry per spec prefix, each a callable
``(spec, *, seed, max_tokens, temperature, device, threads, precision) -> Policy``
(``device``, ``threads`` and ``precision``, the dtype of the sampler's weights, place a
local model; remote samplers ignore them). The bundled ``agent_gym_train``
package registers all three.

A prompt longer than the policy's context is an outcome of the episode, not a failure of
the policy: a policy raises :class:`ContextLengthError` (a server said so, or the prompt is
longer than a local model's positions) and eval ends the episode there as ``context_length``.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol

import httpx

from agent_gym import untrusted
from agent_gym.actions.protocols import ActionProtocol
from agent_gym.actions.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, format_tool_call
from agent_gym.seeding import derive_seed


class PolicyError(RuntimeError):
    """A policy could not produce a reply (its server kept failing, say)."""


class ContextLengthError(PolicyError):
    """The prompt does not fit the policy's context: the episode cannot continue, and no
    retry or resume would change that."""


# How OpenAI-compatible servers say a request does not fit the context (lower case):
# OpenAI's error code and message, vLLM's and SGLang's messages, llama.cpp's C++ server
# ("exceeds the available context size") and llama-cpp-python ("exceed context window").
CONTEXT_LENGTH_MARKERS = (
    "context_length_exceeded",
    "maximum context length",
    "exceeds the context",
    "exceeds the available context",
    "exceed context window",
    "exceed_context_size",
    "longer than the maximum model length",
    "longer than the model's context length",
)
# How servers say a request is malformed, when they answer it with a 5xx: a retry sends the
# same request and gets the same answer. llama.cpp's server answers content it cannot
# template, such as ``null``, with HTTP 500 and nlohmann::json's "type must be string";
# llama-cpp-python's (0.3.36, measured) with HTTP 500 and its request schema's "validation
# errors", or the Python TypeError its Jinja template raised ("can only concatenate str
# (not "NoneType") to str").
VALIDATION_MARKERS = (
    "validation error", "invalid", "type must be", "must be a string", "unsupported",
    "not supported", "expected string", "can only concatenate", "nonetype",
)
ERROR_TEXT_LIMIT = 2000  # enough of a server's error body to show its cause


def says_context_length(text: str) -> bool:
    """Whether a server's error text says the prompt exceeds the model's context."""
    lowered = text.lower()
    return any(marker in lowered for marker in CONTEXT_LENGTH_MARKERS)


@dataclass
class PolicyInput:
    """What a policy may look at. Model policies read only ``messages`` and ``tools``;
    ``privileged``, ``info`` and ``protocol`` are there for scripted baselines.

    ``protocol`` is the env's action protocol (its ``protocol`` attribute), through which a
    scripted policy phrases a command the way the env parses it; None when the env has
    none, which means it takes a command as plain text, unless it offers tools (then how
    to call them is unknown, and a scripted policy must refuse rather than guess).

    ``messages`` may be a window of the episode's chat (``agent_gym.render.window_messages``):
    a policy that keeps state across turns must check that they extend what it saw before.
    ``seed`` is the episode's (distinct per task and rollout) and ``rollout`` its index among
    the task's rollouts: a sampling policy derives its draws from them, so rollouts differ
    and a resumed run draws what an unbroken one would.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    turn: int
    privileged: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    rollout: int = 0
    protocol: ActionProtocol | None = None


@dataclass
class Reply:
    """The assistant's text; ``cut`` when a token budget stopped it before it ended.

    ``finish_reason`` is the server's (``stop``, ``length``, ``tool_calls``); ``tool_calls``
    counts the native tool calls of a reply to a request that offered tools natively (None
    when none were offered), so a run can tell that a server ignores its tools.
    """

    text: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cut: bool = False
    finish_reason: str | None = None
    tool_calls: int | None = None


class Policy(Protocol):
    name: str

    async def act(self, observation: PolicyInput) -> Reply: ...


# --------------------------------------------------------------------- scripted baselines
class OraclePolicy:
    """Plays ``privileged["oracle_actions"]``, the solution each env scripts for its task."""

    name = "oracle"

    async def act(self, observation: PolicyInput) -> Reply:
        if not observation.privileged:
            raise PolicyError(
                "the oracle got no privileged info: a served env (agent_gym/Remote-v0) gives "
                "it only to a client with the server's critic token (serve "
                "--critic-token-env VAR; --env-arg critic_token_env=VAR)")
        script = observation.privileged.get("oracle_actions")
        if not script:
            raise PolicyError("this env gives no oracle_actions in its privileged info")
        return Reply(script[min(observation.turn, len(script) - 1)])


class RandomAdmissiblePolicy:
    """A uniformly random admissible action: the floor any learned policy must beat.

    Each choice is seeded by the episode's opening chat and the turn, not by a shared
    stream, so concurrent or resumed runs choose exactly as a sequential one would. The
    command is phrased in the env's protocol: ALFWorld's default protocol takes a tool
    call, and bare commands sent to it were all refused, a floor of 0 that measured nothing.
    """

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    async def act(self, observation: PolicyInput) -> Reply:
        admissible = observation.info.get("admissible_actions")
        if not admissible:
            raise PolicyError("this env lists no admissible_actions in its info")
        opening = json.dumps(observation.messages[:2], sort_keys=True)
        # Rollout 0 keeps the key runs had before rollouts existed, so they replay unchanged.
        rollout = f":{observation.rollout}" if observation.rollout else ""
        key = f"{self.seed}:{observation.turn}:{opening}{rollout}".encode()
        rng = random.Random(hashlib.sha256(key).digest())
        return Reply(phrase_action(observation, rng.choice(list(admissible))))


def phrase_action(observation: PolicyInput, command: str) -> str:
    """``command`` as a reply the env reads back as exactly that command.

    Raises ``PolicyError`` when the env's protocol cannot carry it, or when the env offers
    tools without saying how to call them: a reply the env would refuse measures nothing.
    """
    if observation.protocol is None:
        if observation.tools:
            raise PolicyError(
                "this env offers tools but exposes no action protocol (env.unwrapped.protocol), "
                "so a scripted policy cannot tell how to call them"
            )
        return command
    try:
        return observation.protocol.format(command)
    except ValueError as err:
        raise PolicyError(str(err)) from err


# --------------------------------------------------------------------- OpenAI-compatible
class OpenAIChatPolicy:
    """Chat completions over httpx with timeouts and bounded retries with backoff.

    ``native_tools=True`` passes the tool schemas as ``tools`` (with ``tool_choice:
    "auto"``: llama.cpp's server ignores tools without it) and turns returned
    ``tool_calls`` into ``<tool_call>`` text; ``False`` describes the tools in the system
    prompt and lets the model write the tags itself (for servers without tool support).

    Only transient failures are retried (connection errors, 408/409/429, 5xx that do not
    say the request is malformed); a read timeout is not (the server is still on the
    request), and a context overflow raises :class:`ContextLengthError`.

    The HTTP client belongs to the event loop that uses it: it is made on first use in a
    loop and remade when a later ``asyncio.run`` calls the policy (a client's connections
    are bound to the loop that opened them; reusing them from another loop raised
    ``Event loop is closed`` for every env of a suite after the first). ``aclose`` closes
    it; ``agent_gym.eval.run.evaluate`` does so when its run ends.
    """

    RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
    CLIENTS = 8

    def __init__(
        self,
        model: str,
        base_url: str,
        *,
        api_key: str | None = None,
        native_tools: bool = True,
        temperature: float = 0.0,
        max_tokens: int = 256,
        timeout: float = 60.0,
        max_retries: int = 3,
        backoff: float = 0.5,
    ) -> None:
        self.name = f"openai:{model}"
        self.model = model
        self.base_url = base_url.rstrip("/")
        self.native_tools = native_tools
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "")
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        # Clients belong to the event loop that made them (a suite runs one loop per env).
        self._clients: list[httpx.AsyncClient] = []
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._calls = itertools.count()

    def _http(self) -> httpx.AsyncClient:
        """One of several clients, used in turn, made for the running loop.

        httpcore's pool scans every connection it holds (a socket poll for each idle one)
        on each request and each release, so one pool of 32 busy connections cost 4.5 ms of
        loop time per request; pools of a few connections each keep that scan short. One
        TLS context serves them all. Clients left by a finished loop cannot be closed from
        this one; their sockets went with that loop.
        """
        loop = asyncio.get_running_loop()
        if not self._clients or self._client_loop is not loop:
            tls = httpx.create_ssl_context()
            self._clients = [
                httpx.AsyncClient(
                    base_url=self.base_url, headers=self._headers, timeout=self.timeout,
                    verify=tls,
                    limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
                ) for _ in range(self.CLIENTS)
            ]
            self._client_loop = loop
        return self._clients[next(self._calls) % self.CLIENTS]

    async def act(self, observation: PolicyInput) -> Reply:
        body: dict[str, Any] = {
            "model": self.model,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        if self.temperature > 0:  # greedy replies need no seed; sampled ones get their own
            body["seed"] = derive_seed(observation.seed, observation.turn)
        offered = self.native_tools and bool(observation.tools)
        if self.native_tools:
            body["messages"] = _native_tool_messages(observation.messages)
            if observation.tools:
                body["tools"] = observation.tools
                body["tool_choice"] = "auto"
        else:
            body["messages"] = _text_tool_messages(observation.messages, observation.tools)
        payload = await self._post("/chat/completions", body)
        try:
            choice = payload["choices"][0]
            message = choice["message"]
            calls = message.get("tool_calls") or []
            text = _tool_calls_as_text(message.get("content") or "", calls)
        except (KeyError, IndexError, TypeError) as err:
            raise PolicyError(
                f"malformed chat completion: {str(payload)[:ERROR_TEXT_LIMIT]}"
            ) from err
        usage = payload.get("usage") or {}
        finish = choice.get("finish_reason")
        return Reply(text, usage.get("prompt_tokens"), usage.get("completion_tokens"),
                     cut=finish == "length", finish_reason=finish,
                     tool_calls=len(calls) if offered else None)

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        problem = ""
        client = self._http()
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = await client.post(path, json=body)
            except httpx.ReadTimeout as err:
                # The server has the request and is still on it (or on those queued before
                # it): a resend queues a second copy behind the first, which llama-cpp-python
                # keeps computing for no one. Measured: ALFWorld at --concurrency 4 against
                # its one-slot CPU server lost 3 of 4 episodes to 4 timeouts each.
                # At --concurrency 1 the one request itself was slower than the timeout
                # (llama.cpp's chatml-function-calling format took over 60 s for a
                # CodeInterpreter reply): the advice names both causes.
                raise PolicyError(
                    f"ReadTimeout: no reply within --timeout {self.timeout:g} s (the server may "
                    f"still be computing it); a reply of up to --max-tokens {self.max_tokens} "
                    "must fit in that time: raise --timeout or lower --max-tokens, and keep "
                    "--concurrency at most the server's parallel slots (beyond them requests "
                    "wait for each other)"
                ) from err
            except httpx.TransportError as err:
                problem = f"{type(err).__name__}: {err}"
                continue
            if response.status_code == 200:
                try:
                    return response.json()
                except json.JSONDecodeError as err:
                    problem = f"response is not JSON: {response.text[:ERROR_TEXT_LIMIT]!r}"
                    if attempt == self.max_retries:
                        raise PolicyError(problem) from err
                    continue
            text = response.text[:ERROR_TEXT_LIMIT]
            problem = f"HTTP {response.status_code}: {text}"
            if says_context_length(text):
                raise ContextLengthError(problem)
            transient = response.status_code in self.RETRY_STATUS and not (
                response.status_code == 500 and _says_invalid(text)
            )
            if not transient:
                raise PolicyError(problem)
        raise PolicyError(f"gave up after {self.max_retries + 1} attempts; last: {problem}")

    async def aclose(self) -> None:
        clients, self._clients, self._client_loop = self._clients, [], None
        await asyncio.gather(*(client.aclose() for client in clients))


def _says_invalid(text: str) -> bool:
    lowered = text.lower()
    return any(marker in lowered for marker in VALIDATION_MARKERS)


_CALL_RE = re.compile(
    re.escape(TOOL_CALL_OPEN) + r"\s*(\{.*\})\s*" + re.escape(TOOL_CALL_CLOSE), re.DOTALL
)


def _native_tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Our transcript (tool calls as text) in the OpenAI shape (``tool_calls`` with ids)."""
    converted: list[dict[str, Any]] = []
    pending_id: str | None = None
    for index, message in enumerate(messages):
        if message["role"] == "assistant":
            match = _CALL_RE.search(message["content"])
            call = _json_or_none(match.group(1)) if match else None
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                pending_id = f"call_{index}"
                converted.append({
                    "role": "assistant",
                    # "" and not null: llama.cpp's server answers null content with a 500.
                    "content": message["content"][: match.start()].strip(),
                    "tool_calls": [{
                        "id": pending_id, "type": "function",
                        "function": {"name": call["name"],
                                     "arguments": json.dumps(call.get("arguments", {}))},
                    }],
                })
                continue
            pending_id = None
            converted.append({"role": "assistant", "content": message["content"]})
        elif message["role"] == "tool":
            if pending_id is None:  # an error answer to a call that never parsed
                converted.append({"role": "user", "content": message["content"]})
            else:
                converted.append(
                    {"role": "tool", "tool_call_id": pending_id, "content": message["content"]}
                )
                pending_id = None
        else:
            converted.append({"role": message["role"], "content": message["content"]})
    return converted


def _text_tool_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    converted = []
    for message in messages:
        if message["role"] == "tool":
            content = f"<tool_response>\n{message['content']}\n</tool_response>"
            converted.append({"role": "user", "content": content})
        else:
            converted.append({"role": message["role"], "content": message["content"]})
    if tools:
        described = "\n".join(json.dumps(tool["function"]) for tool in tools)
        guide = (
            "\n\nYou can call these tools:\n" + described + "\nTo call one, end your reply with "
            '<tool_call>{"name": NAME, "arguments": {...}}</tool_call>.'
        )
        if converted and converted[0]["role"] == "system":
            converted[0] = {"role": "system", "content": converted[0]["content"] + guide}
        else:
            converted.insert(0, {"role": "system", "content": guide.strip()})
    return converted


def _tool_calls_as_text(content: str, tool_calls: list[dict[str, Any]] | None) -> str:
    parts = [content.strip()] if content.strip() else []
    for call in tool_calls or []:
        function = call["function"]
        # Arguments arrive as a JSON string; format_tool_call keeps it verbatim for the env.
        parts.append(format_tool_call(function["name"], function.get("arguments") or "{}"))
    return "\n".join(parts)


def _json_or_none(text: str) -> Any:
    try:  # a server's or model's text
        return untrusted.loads(text)
    except untrusted.UntrustedJSONError:
        return None


# --------------------------------------------------------------------- specs
POLICY_ENTRY_POINTS = "agent_gym.policies"
PolicyBuilder = Callable[..., "Policy"]


def plugin_policies() -> dict[str, PolicyBuilder]:
    """Spec prefixes other packages supply, such as ``local`` and ``pytrio``, by name; each
    builder is imported only when a spec uses it."""
    return {point.name: point.load for point in entry_points(group=POLICY_ENTRY_POINTS)}


def make_policy(
    spec: str, *, seed: int = 0, max_tokens: int = 256, temperature: float = 0.0,
    timeout: float = 60.0, device: str = "auto", threads: int | None = None,
    precision: str = "float32",
) -> Policy:
    """Build a policy from a command-line spec (see the module docstring); ``timeout`` is
    an ``openai:`` policy's HTTP timeout in seconds."""
    if spec == "oracle":
        return OraclePolicy()
    if spec == "random":
        return RandomAdmissiblePolicy(seed)
    if spec.startswith("openai:"):
        rest, _, mode = spec.removeprefix("openai:").partition("#")
        model, at, base_url = rest.partition("@")
        if not at or not model or not base_url:
            raise ValueError(f"expected openai:MODEL@BASE_URL, got {spec!r}")
        if mode not in ("", "text", "native"):
            raise ValueError(f"tool mode must be #native or #text, got #{mode}")
        return OpenAIChatPolicy(
            model, base_url, native_tools=mode != "text", max_tokens=max_tokens,
            temperature=temperature, timeout=timeout,
        )
    plugins = plugin_policies()
    prefix = spec.partition(":")[0]
    if prefix in plugins:
        builder = plugins[prefix]()
        return builder(spec, seed=seed, max_tokens=max_tokens, temperature=temperature,
                       device=device, threads=threads, precision=precision)
    known = ["oracle", "random", "openai:MODEL@URL", *(f"{name}[:MODEL]" for name in plugins)]
    raise ValueError(f"unknown policy {spec!r}; use one of: {', '.join(known)}")
