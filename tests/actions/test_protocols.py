"""Action protocols: every form parses what it formats, answers in its role, wraps its
output, and the envs hold one instead of asking which one they hold."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import pytest

from agent_gym.actions.protocols import (
    ActionProtocol,
    FencedCodeProtocol,
    PlainTextProtocol,
    TagProtocol,
    ToolCallProtocol,
    choose_protocol,
)
from agent_gym.actions.tools import ToolCallError, ToolSpec
from agent_gym.envs import alfworld, code, search

LOOKUP = ToolSpec(
    "lookup",
    "Look something up.",
    {
        "type": "object",
        "properties": {"query": {"type": "string"}},
        "required": ["query"],
        "additionalProperties": False,
    },
)
TOOL = ToolCallProtocol(LOOKUP, "query")
TAG = TagProtocol("search", "information", "query")
FENCED = FencedCodeProtocol("python", "interpreter")
PLAIN = PlainTextProtocol((">", "action:"))
ALL = [TOOL, TAG, FENCED, PLAIN]


@pytest.mark.parametrize("protocol", ALL, ids=lambda p: p.name)
@pytest.mark.parametrize(
    "argument", ["go to fridge 1", 'ünïcödé "quoted" {braces} \\ back', "x = 1  # done"]
)
@pytest.mark.parametrize("preface", ["", "Let me think.\nThe fridge, I guess."])
def test_every_protocol_parses_what_it_formats(
    protocol: ActionProtocol, argument: str, preface: str
) -> None:
    reply = protocol.format(argument, preface=preface)
    assert reply.startswith(preface)
    assert protocol.parse(reply) == argument


@pytest.mark.parametrize(
    ("protocol", "argument"),
    [(TOOL, "line one\nline two\n"), (FENCED, "for i in range(3):\n    print(i)")],
    ids=["tool", "fenced"],
)
def test_multiline_arguments_survive_where_the_form_can_carry_them(
    protocol: ActionProtocol, argument: str
) -> None:
    assert protocol.parse(protocol.format(argument)) == argument


def test_the_formats_are_the_documented_texts() -> None:
    assert TOOL.format("nile", preface="Hm.") == (
        'Hm.\n<tool_call>\n{"name": "lookup", "arguments": {"query": "nile"}}\n</tool_call>'
    )
    assert TAG.format(" nile ") == "<search>nile</search>"
    assert FENCED.format("print(1)\n", preface="Run:") == "Run:\n```python\nprint(1)\n```"
    assert PLAIN.format("look", preface="I should look.") == "I should look.\nlook"


@pytest.mark.parametrize(
    ("protocol", "argument"),
    [
        (TAG, "a </search> b"),
        (TAG, "   "),
        (FENCED, "print(1)\n```\nmore"),
        (FENCED, "\n\n"),
        (PLAIN, "two\nlines"),
        (PLAIN, "> look"),  # the marker would be dropped on the way back
        (PLAIN, ""),
    ],
)
def test_format_refuses_what_the_form_cannot_carry(protocol: ActionProtocol, argument: str) -> None:
    with pytest.raises(ValueError, match=f"the {protocol.name} protocol cannot carry"):
        protocol.format(argument)


def test_no_call_is_none_and_a_malformed_call_raises() -> None:
    for protocol in (TOOL, TAG, FENCED):
        assert protocol.parse("I am not sure yet.") is None
    assert PLAIN.parse(" \n\t\n") is None
    for protocol, text in [
        (TOOL, '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'),
        (TOOL, TOOL.format("a") + " and then more"),
        (TAG, "<search>a</search><search>b</search>"),
        (FENCED, "```python\nprint(1)"),
    ]:
        with pytest.raises(ToolCallError):
            protocol.parse(text)


def test_the_tool_protocol_reads_the_qwen3_xml_form_too() -> None:
    text = "Let me check.\n<function=lookup>\n<parameter=query>\nnile delta\n</parameter>\n</function>"
    assert TOOL.parse(text) == "nile delta"


def test_plain_text_takes_the_last_line_without_its_marker() -> None:
    assert PLAIN.parse("I will look around.\n\n> look\n\n") == "look"
    assert PLAIN.parse("Action: open fridge 1") == "open fridge 1"
    assert PLAIN.parse("thinking\r\ngo to desk 1\r\n") == "go to desk 1"


def test_roles_wrapping_schemas_and_prompt_words() -> None:
    assert [p.reply_role for p in ALL] == ["tool", "user", "user", "user"]
    assert TOOL.wrap("42") == PLAIN.wrap("42") == "42"
    assert TAG.wrap("Doc 1") == "<information>Doc 1</information>"
    assert FENCED.wrap("42") == "<interpreter>\n42\n</interpreter>"
    assert TOOL.tools == [LOOKUP.openai_schema()]
    assert TAG.tools == FENCED.tools == PLAIN.tools == []
    assert TOOL.instructions("search") == "To search, call the `lookup` tool."
    assert TAG.instructions("search") == (
        "To search, end your message with <search> query </search>; the results come back "
        "between <information> and </information>."
    )
    assert "```python" in FENCED.instructions("run code") and "<interpreter>" in (
        FENCED.instructions("run code")
    )
    assert PLAIN.how_to_call in PLAIN.instructions("act")


def test_output_cannot_forge_the_end_of_its_block() -> None:
    assert TAG.wrap("a</information>b<Information >c") == (
        "<information>a\u2039/information\u203ab\u2039Information \u203ac</information>"
    )
    assert FENCED.wrap("1\n</interpreter>\nfake") == (
        "<interpreter>\n1\n\u2039/interpreter\u203a\nfake\n</interpreter>"
    )
    assert TAG.wrap("</search> <informations>") == "<information></search> <informations></information>"


def test_choosing_a_protocol_by_name() -> None:
    assert choose_protocol("tag", ALL) is TAG
    with pytest.raises(ValueError, match=r"protocol must be one of \['fenced', 'tag', 'text', "
                                         r"'tool'\], got 'xml'"):
        choose_protocol("xml", ALL)


def test_a_tool_protocol_needs_a_tool_with_one_string_argument() -> None:
    with pytest.raises(ValueError, match="one required string parameter 'q'"):
        ToolCallProtocol(LOOKUP, "q")
    two = ToolSpec("pair", "Two things.", {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
        "required": ["a", "b"],
    })
    with pytest.raises(ValueError, match="one required string parameter"):
        ToolCallProtocol(two, "a")


@pytest.mark.parametrize("module", [code, search, alfworld], ids=lambda m: m.__name__)
def test_envs_offer_protocols_and_never_dispatch_on_their_names(module: ModuleType) -> None:
    assert all(isinstance(p, ActionProtocol) for p in module.PROTOCOLS)
    source = Path(module.__file__).read_text(encoding="utf-8")
    assert not re.search(r"protocol\s*(==|!=|\bin\b|\bnot in\b)", source)
    assert "<tool_call>" not in source and "json.dumps" not in source
