"""Action protocols: the textual forms in which a reply calls an env's one tool.

An env that offers a tool (run code, search, act in the house) accepts calls in one of a
few forms, chosen by its ``protocol`` constructor argument: a function tool call, a tag
pair, a fenced code block, or a plain command on the last line. Everything that depends on
the form lives in its protocol object: how a reply is parsed, how a scripted reply is
written (oracles, policies and tests format through it, so protocol text is never written
by hand), which chat role the env's answer takes, how that answer is wrapped, which tool
schemas the actor is shown, and the words a prompt uses to say how to call. An env holds
one protocol and never asks which one it holds.

Parsing is strict (exactly one call, at the end of the reply, nothing repaired) and linear
in the reply's length; a malformed call raises ``ToolCallError``, whose message the env
returns as the observation of an invalid step.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from agent_gym.actions.tools import (
    ToolCallError,
    ToolSpec,
    format_tool_call,
    parse_fenced_code,
    parse_tag_call,
    parse_tool_call,
)

Role = Literal["tool", "user"]


class ActionProtocol(ABC):
    """One form of calling a tool that takes a single string argument."""

    name: ClassVar[str]
    # A `tool` message must answer a function call the template rendered; every other
    # form is plain assistant text, so the env answers it as the user.
    reply_role: ClassVar[Role] = "user"

    @abstractmethod
    def parse(self, text: str) -> str | None:
        """The argument of the call that ends ``text``; None when the reply makes no call.

        Raises ``ToolCallError`` when the reply holds a call that is not exactly one
        well-formed call at its end.
        """

    @abstractmethod
    def format(self, argument: str, preface: str = "") -> str:
        """A reply that says ``preface`` and then calls the tool with ``argument``.

        Raises ``ValueError`` when this form cannot carry the argument (``parse`` would
        read back something else), so a scripted reply can never be silently misread.
        """

    @property
    @abstractmethod
    def how_to_call(self) -> str:
        """An imperative clause for prompts and error messages, e.g. "call the `search`
        tool"."""

    @property
    def tools(self) -> list[dict[str, Any]]:
        """OpenAI-style function schemas to show the actor; only function calls have any."""
        return []

    def wrap(self, output: str) -> str:
        """The observation that carries the tool's output back to the actor."""
        return output

    def instructions(self, purpose: str) -> str:
        """The prompt's sentence on how to call, e.g. ``instructions("search")``."""
        return f"To {purpose}, {self.how_to_call}{self._where_output_goes()}."

    def _where_output_goes(self) -> str:
        """A clause on where the output comes back; a tool message needs none."""
        return ""

    def _checked(self, reply: str, argument: str) -> str:
        """``reply`` if it parses back to ``argument``: a scripted reply the env would read
        differently would fail oracles and tests far from the cause."""
        try:
            parsed = self.parse(reply)
        except ToolCallError as err:
            raise ValueError(f"the {self.name} protocol cannot carry {argument!r}: {err}") from err
        if parsed != argument:
            raise ValueError(
                f"the {self.name} protocol cannot carry {argument!r}: it would be read back as "
                f"{parsed!r}"
            )
        return reply


def choose_protocol(name: str, offered: Sequence[ActionProtocol]) -> ActionProtocol:
    """The protocol an env offers under ``name``; a clear error for any other name."""
    by_name = {protocol.name: protocol for protocol in offered}
    if name not in by_name:
        raise ValueError(f"protocol must be one of {sorted(by_name)}, got {name!r}")
    return by_name[name]


def _after(preface: str, call: str) -> str:
    return f"{preface}\n{call}" if preface else call


def _neutralised(output: str, tag: str) -> str:
    """``output`` with each ``<tag>`` or ``</tag>`` in it (any case) shown as ``‹/tag›``.

    The output travels between those very tags, so a passage or a program that printed
    ``</information>`` would otherwise end its block early and could forge what follows
    as the env's own text. One regex pass, linear in the output.
    """
    pattern = re.compile(rf"<(/?{re.escape(tag)}\s*)>", re.IGNORECASE)
    return pattern.sub(lambda m: f"\u2039{m.group(1)}\u203a", output)


@dataclass(frozen=True)
class ToolCallProtocol(ActionProtocol):
    """A function call in the Hermes/Qwen JSON form or the Qwen3 XML form (both parsed by
    ``tools.parse_tool_call``; replies are formatted in the JSON form). The tool's answer
    is a ``tool`` message, as chat templates expect after a call."""

    tool: ToolSpec
    argument: str  # the name of the tool's one string parameter

    name: ClassVar[str] = "tool"
    reply_role: ClassVar[Role] = "tool"

    def __post_init__(self) -> None:
        properties = self.tool.parameters.get("properties", {})
        required = set(self.tool.parameters.get("required", ()))
        if properties.get(self.argument, {}).get("type") != "string" or required - {
            self.argument
        }:
            raise ValueError(
                f"tool {self.tool.name!r} must take the one required string parameter "
                f"{self.argument!r}"
            )

    def parse(self, text: str) -> str | None:
        call = parse_tool_call(text, [self.tool])
        return None if call is None else str(call.arguments[self.argument])

    def format(self, argument: str, preface: str = "") -> str:
        call = format_tool_call(self.tool.name, {self.argument: argument})
        return self._checked(_after(preface, call), argument)

    @property
    def how_to_call(self) -> str:
        return f"call the `{self.tool.name}` tool"

    @property
    def tools(self) -> list[dict[str, Any]]:
        return [self.tool.openai_schema()]


@dataclass(frozen=True)
class TagProtocol(ActionProtocol):
    """A tag pair ending the reply, as in Search-R1: ``<search> query </search>``; the
    output comes back inside another pair, ``<information>...</information>``."""

    tag: str
    output_tag: str
    placeholder: str  # what the prompt shows between the tags, e.g. "query"

    name: ClassVar[str] = "tag"

    def parse(self, text: str) -> str | None:
        return parse_tag_call(text, self.tag)

    def format(self, argument: str, preface: str = "") -> str:
        argument = argument.strip()
        return self._checked(_after(preface, f"<{self.tag}>{argument}</{self.tag}>"), argument)

    @property
    def how_to_call(self) -> str:
        return f"end your message with <{self.tag}> {self.placeholder} </{self.tag}>"

    def _where_output_goes(self) -> str:
        return f"; the results come back between <{self.output_tag}> and </{self.output_tag}>"

    def wrap(self, output: str) -> str:
        return f"<{self.output_tag}>{_neutralised(output, self.output_tag)}</{self.output_tag}>"


@dataclass(frozen=True)
class FencedCodeProtocol(ActionProtocol):
    """A fenced code block ending the reply (```python ... ```), its output returned
    inside ``<interpreter>`` tags on lines of their own, as ReTool does."""

    language: str = "python"
    output_tag: str = "interpreter"

    name: ClassVar[str] = "fenced"

    def parse(self, text: str) -> str | None:
        return parse_fenced_code(text, self.language)

    def format(self, argument: str, preface: str = "") -> str:
        code = argument.strip("\n")
        return self._checked(_after(preface, f"```{self.language}\n{code}\n```"), code)

    @property
    def how_to_call(self) -> str:
        return f"end your message with one ```{self.language} code block"

    def _where_output_goes(self) -> str:
        return f"; its output comes back between <{self.output_tag}> and </{self.output_tag}>"

    def wrap(self, output: str) -> str:
        inner = _neutralised(output, self.output_tag)
        return f"<{self.output_tag}>\n{inner}\n</{self.output_tag}>"


@dataclass(frozen=True)
class PlainTextProtocol(ActionProtocol):
    """The last non-empty line of the reply is the command, so a model may think first.
    A leading marker models like to write (``>``, ``Action:``) is dropped, in that order,
    compared without case."""

    markers: tuple[str, ...] = (">", "action:")

    name: ClassVar[str] = "text"

    def parse(self, text: str) -> str | None:
        stripped = text.rstrip()
        if not stripped:
            return None
        line = stripped.splitlines()[-1].strip()
        for marker in self.markers:
            if line[: len(marker)].lower() == marker:
                line = line[len(marker) :]
        return line.strip()

    def format(self, argument: str, preface: str = "") -> str:
        argument = argument.strip()
        return self._checked(_after(preface, argument), argument)

    @property
    def how_to_call(self) -> str:
        return "end your reply with the command alone on its own line"
