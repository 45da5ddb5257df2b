"""A dataclass of options as a command line: ``option`` declares a field with its ``--help``
line, ``options_parser`` gives every field its ``--field-name``."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import field
from typing import TYPE_CHECKING, TypeVar

from agent_gym import untrusted
from agent_gym.cli.parsing import OneLineParser

if TYPE_CHECKING:
    from agent_gym_train.args import RunArgs

T = TypeVar("T")


def option(default: T, help: str, choices: Sequence[str] = ()) -> T:
    """A field of a trainer's ``Args``: its default and the ``--help`` line it gets
    (the parser adds the default; ``choices`` are checked and listed)."""
    return field(default=default, metadata={"help": help, "choices": tuple(choices)})


def options_parser(
    args_type: type[RunArgs], prog: str, description: str, *, explicit_only: bool = False
) -> argparse.ArgumentParser:
    """``--field-name`` for every field: booleans as ``--x/--no-x``, dicts as JSON objects,
    numbers typed by their annotation (``int | None`` defaults to None), the rest strings.

    With ``explicit_only`` every default is left out of the namespace, so parsing tells
    which options the user gave (a continued run keeps the others from its checkpoint).
    """
    parser = OneLineParser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for spec in dataclasses.fields(args_type):
        flag = "--" + spec.name.replace("_", "-")
        default: object = spec.default if spec.default is not dataclasses.MISSING else {}
        if explicit_only:
            default = argparse.SUPPRESS
        kind = str(spec.type).removesuffix(" | None")
        help_text = spec.metadata.get("help", "")
        choices = spec.metadata.get("choices") or None
        if kind == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
        elif kind.startswith("dict"):
            parser.add_argument(flag, type=_json_object, default=default, metavar="JSON",
                                help=help_text)
        elif spec.name == "ray":
            parser.add_argument(flag, nargs="?", const="local", default=default,
                                metavar="ADDRESS", help=help_text)
        else:
            parser.add_argument(flag, type={"int": int, "float": float}.get(kind, str),
                                default=default, choices=choices, help=help_text)
    return parser


def _json_object(text: str) -> dict[str, object]:
    try:
        value = untrusted.loads(text)
    except untrusted.UntrustedJSONError as err:  # argparse would say only "invalid _json_object"
        raise argparse.ArgumentTypeError(f"{text[:80]!r} {err}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value
