"""Tool schemas, the one strict tool-call parser, and tool-output sanitising.

The parser refuses rather than repairs: a policy that learns from guessed repairs learns
to emit broken calls. Every refusal carries a message a model (or a person) can act on,
and envs return it as the observation of an invalid step.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jsonschema

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_FUNCTION_RE = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.DOTALL)
_PARAMETER_OPEN = "<parameter="
_PARAMETER_CLOSE = "</parameter>"
# Chat-template control tokens a tool could echo back to forge a turn boundary.
_SPECIAL_TOKEN_RE = re.compile(
    r"<\|[A-Za-z0-9_.:\-]{1,48}\|>"
    r"|</?(?:tool_call|tool_response|tools|think|s)>"
    r"|\[/?(?:INST|SYSTEM_PROMPT|TOOL_CALLS|TOOL_RESULTS|AVAILABLE_TOOLS)\]"
)


class ToolCallError(ValueError):
    """The assistant's text holds a tool call that cannot be executed; the message says why."""


@dataclass(frozen=True)
class ToolSpec:
    """A function tool: its name, what it does, and a JSON schema of its arguments."""

    name: str
    description: str
    parameters: Mapping[str, Any] = field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )

    def openai_schema(self) -> dict[str, Any]:
        """The OpenAI / chat-template function schema (``tools=[...]``)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def format_tool_call(name: str, arguments: Mapping[str, Any] | str) -> str:
    """The Hermes/Qwen text of one call, laid out as the chat templates render it (the
    JSON on its own line between the tags), so scripted replies look like a model's.

    ``arguments`` given as a string is JSON a model wrote (an OpenAI ``tool_calls`` entry):
    it is kept verbatim, so the env's parser, not this formatter, judges it.
    """
    raw = arguments if isinstance(arguments, str) else json.dumps(dict(arguments),
                                                                   ensure_ascii=False)
    payload = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {raw}}}'
    return f"{TOOL_CALL_OPEN}\n{payload}\n{TOOL_CALL_CLOSE}"


def parse_tool_call(text: str, tools: Sequence[ToolSpec]) -> ToolCall | None:
    """Parse the single tool call that ends ``text``; None when there is no call at all.

    Accepts the Hermes/Qwen JSON form ``<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>`` and the Qwen3 XML form ``<function=NAME><parameter=P>v</parameter>
    </function>`` (bare or inside ``<tool_call>``). Raises ``ToolCallError`` for anything
    that looks like a call but is not exactly one valid, schema-conforming call at the end.
    """
    opens, closes = text.count(TOOL_CALL_OPEN), text.count(TOOL_CALL_CLOSE)
    functions = text.count("<function=")
    if not (opens or closes or functions):
        return None
    if opens != closes:
        raise ToolCallError(
            f"unbalanced tool-call tags: {opens} '{TOOL_CALL_OPEN}' and {closes} "
            f"'{TOOL_CALL_CLOSE}'; write exactly one complete call"
        )
    if opens > 1 or functions > 1:
        raise ToolCallError(
            f"found {max(opens, functions)} tool calls; make exactly one call per turn"
        )
    by_name = {tool.name: tool for tool in tools}
    if opens:
        start = text.index(TOOL_CALL_OPEN)
        end = text.index(TOOL_CALL_CLOSE)
        if end < start:
            raise ToolCallError(f"'{TOOL_CALL_CLOSE}' comes before '{TOOL_CALL_OPEN}'")
        _require_at_end(text, end + len(TOOL_CALL_CLOSE))
        body = text[start + len(TOOL_CALL_OPEN) : end].strip()
        if body.startswith("<function="):
            call = _parse_xml_call(body, by_name)
        else:
            call = _parse_json_call(body, by_name)
    else:
        match = _FUNCTION_RE.search(text)
        if match is None:
            raise ToolCallError("'<function=...>' is not closed by '</function>'")
        _require_at_end(text, match.end())
        call = _parse_xml_call(match.group(0), by_name)
    _check_arguments(call, by_name[call.name])
    return call


def parse_tag_call(text: str, tag: str) -> str | None:
    """Parse a plain tag protocol such as ``<search>query</search>`` ending ``text``.

    Returns the stripped content, or None when the tag does not occur. The same strictness
    as ``parse_tool_call``: exactly one, balanced, at the end, not empty.
    """
    opening, closing = f"<{tag}>", f"</{tag}>"
    opens, closes = text.count(opening), text.count(closing)
    if not (opens or closes):
        return None
    if opens != closes:
        raise ToolCallError(f"unbalanced tags: {opens} '{opening}' and {closes} '{closing}'")
    if opens > 1:
        raise ToolCallError(f"found {opens} {opening} calls; make exactly one per turn")
    start, end = text.index(opening), text.index(closing)
    if end < start:
        raise ToolCallError(f"'{closing}' comes before '{opening}'")
    _require_at_end(text, end + len(closing))
    content = text[start + len(opening) : end].strip()
    if not content:
        raise ToolCallError(f"{opening}{closing} is empty")
    return content


def parse_fenced_code(text: str, language: str = "python") -> str | None:
    """Parse the single fenced code block (```python ... ```) that ends ``text``."""
    fence = f"```{language}"
    count = text.count(fence)
    if count == 0:
        return None
    if count > 1:
        raise ToolCallError(f"found {count} {fence} blocks; send exactly one per turn")
    start = text.index(fence) + len(fence)
    end = text.find("```", start)
    if end < 0:
        raise ToolCallError(f"the {fence} block is not closed with ```")
    _require_at_end(text, end + 3)
    code = text[start:end].strip("\n")
    if not code.strip():
        raise ToolCallError(f"the {fence} block is empty")
    return code


def sanitize_tool_output(text: str, max_chars: int | None = None) -> str:
    """Make tool output safe to place inside a chat turn.

    Control tokens (``<|im_end|>``, ``<|eot_id|>``, ``</tool_response>``...) are broken up
    so that, when the observation is tokenised, they cannot close the turn or fake a new
    one. Over-long output keeps its head and its tail, which is where errors usually are.
    """
    text = _SPECIAL_TOKEN_RE.sub(lambda m: "\u2039" + m.group(0)[1:-1] + "\u203a", text)
    if max_chars is not None and len(text) > max_chars:
        marker = f"\n...[{len(text) - max_chars} characters omitted]...\n"
        keep = max(max_chars - len(marker), 0)
        head = keep // 3
        text = text[:head] + marker + text[len(text) - (keep - head) :]
    return text


def _require_at_end(text: str, end: int) -> None:
    trailing = text[end:].strip()
    if trailing:
        preview = trailing if len(trailing) <= 60 else trailing[:60] + "..."
        raise ToolCallError(
            f"the tool call must end the message, but it is followed by {preview!r}"
        )


def _parse_json_call(body: str, by_name: Mapping[str, ToolSpec]) -> ToolCall:
    payload = _strict_json(body, "the tool call is not valid JSON")
    if not isinstance(payload, dict):
        raise ToolCallError('the tool call must be a JSON object {"name": ..., "arguments": {...}}')
    extra = set(payload) - {"name", "arguments"}
    if extra:
        raise ToolCallError(f"unexpected keys in the tool call: {sorted(extra)}")
    name = payload.get("name")
    if not isinstance(name, str):
        raise ToolCallError('the tool call needs a string "name"')
    _require_known(name, by_name)
    arguments = payload.get("arguments", {})
    if not isinstance(arguments, dict):
        raise ToolCallError(f'"arguments" of {name} must be a JSON object')
    return ToolCall(name, arguments)


def _strict_json(text: str, invalid: str) -> Any:
    """``json.loads`` that refuses a key given twice in one object; ``invalid`` starts the
    refusal of text that is not JSON.

    Plain ``json.loads`` keeps the last duplicate silently, so ``{"query": "a", "query":
    "b"}`` would run a search the model may not have meant; the XML form already refuses a
    repeated parameter, and both forms are held to the same rule.
    """
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as err:
        raise ToolCallError(f"{invalid} ({err})") from err
    except RecursionError as err:  # a model stuck repeating "[" nests past Python's stack
        raise ToolCallError(f"{invalid} (it is nested too deeply)") from err
    except ToolCallError:
        raise
    except ValueError as err:  # a number of more digits than int() converts (4,300)
        raise ToolCallError(f"{invalid} ({err})") from err


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ToolCallError(f"key {key!r} is given twice in the tool call's JSON")
        result[key] = value
    return result


def _parse_xml_call(body: str, by_name: Mapping[str, ToolSpec]) -> ToolCall:
    match = _FUNCTION_RE.fullmatch(body)
    if match is None:
        raise ToolCallError(
            "malformed call: expected <function=NAME><parameter=P>value</parameter></function>"
        )
    name = match.group(1).strip()
    _require_known(name, by_name)
    properties = by_name[name].parameters.get("properties", {})
    arguments: dict[str, Any] = {}
    for key, raw in _xml_parameters(name, match.group(2)):
        if key in arguments:
            raise ToolCallError(f"parameter {key!r} of {name} is given twice")
        arguments[key] = _xml_value(name, key, raw, properties.get(key, {}))
    return ToolCall(name, arguments)


def _xml_parameters(tool: str, inner: str) -> Iterator[tuple[str, str]]:
    """The ``(name, raw value)`` of each ``<parameter=NAME>value</parameter>`` in ``inner``.

    One left-to-right scan with ``str.find``, stopping at the first problem: a lazy regex
    rescanned the rest of the call from every unclosed ``<parameter=`` (quadratic; 52 KB
    took seconds). Only whitespace may separate parameters.
    """
    pos = 0
    while True:
        opening = inner.find(_PARAMETER_OPEN, pos)
        between = inner[pos:] if opening < 0 else inner[pos:opening]
        if between.strip():
            raise ToolCallError(
                f"unexpected text inside <function={tool}>: {between.strip()[:60]!r}; "
                "put every argument in <parameter=NAME>...</parameter>"
            )
        if opening < 0:
            return
        name_end = inner.find(">", opening)
        key = inner[opening + len(_PARAMETER_OPEN) : name_end]
        if name_end < 0 or "\n" in key:
            raise ToolCallError(
                f"malformed parameter in <function={tool}>: write <parameter=NAME> on one line"
            )
        closing = inner.find(_PARAMETER_CLOSE, name_end)
        if closing < 0:
            raise ToolCallError(
                f"<parameter={key.strip()[:60]}> of {tool} is not closed by '{_PARAMETER_CLOSE}'"
            )
        yield key.strip(), inner[name_end + 1 : closing]
        pos = closing + len(_PARAMETER_CLOSE)


def _xml_value(tool: str, key: str, raw: str, schema: Mapping[str, Any]) -> Any:
    # Qwen3 templates put values on their own lines; one surrounding newline is layout.
    value = raw.removeprefix("\n").removesuffix("\n")
    if schema.get("type", "string") == "string":
        return value
    invalid = f"parameter {key!r} of {tool} must be JSON of type {schema.get('type')}"
    return _strict_json(value, invalid)


def _preview(text: str, limit: int = 60) -> str:
    """``text`` as a refusal quotes it: a model's 900,000-character tool name is not worth
    echoing back (the env caps every observation anyway; this keeps the reason readable)."""
    return text if len(text) <= limit else text[:limit] + "..."


def _require_known(name: str, by_name: Mapping[str, ToolSpec]) -> None:
    if name not in by_name:
        available = ", ".join(sorted(by_name)) or "none"
        raise ToolCallError(f"unknown tool {_preview(name)!r}; available tools: {available}")


def _check_arguments(call: ToolCall, tool: ToolSpec) -> None:
    validator = jsonschema.Draft202012Validator(dict(tool.parameters))
    error = jsonschema.exceptions.best_match(validator.iter_errors(call.arguments))
    if error is not None:
        where = ".".join(str(p) for p in error.absolute_path) or "arguments"
        raise ToolCallError(
            f"invalid arguments for {call.name} ({_preview(where)}): {_preview(error.message, 200)}"
        )
